"""Train an early-exit classifier on a frozen base model by distillation (KL to the full model's distribution).

    accelerate launch train/early_exit.py --config configs/early_exit/smollm2-135m.yaml [key=value ...] [--resume]
    python train/early_exit.py --config configs/early_exit/tiny.yaml optim.max_steps=2

The classifier (ResBlock adapter and/or its own norm, before the shared LM head) reads the base hidden state after
``layers[:exit_layer]`` and learns the full model's next-token distribution at every trained position. Only the
classifier is trained and checkpointed; the base stays frozen, so drafts keep sharing its KV cache. The result
(config.json + model.safetensors + README with top-1 agreement before/after) goes to ``heads_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
import time
from collections import Counter
from pathlib import Path

# This script is itself named early_exit.py: drop its folder from the import path so `early_exit` is the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

from early_exit.classifier import ExitClassifier, new_classifier  # noqa: E402
from selfspec import training as T  # noqa: E402
from selfspec.data import collate  # noqa: E402


@dataclasses.dataclass
class ClassifierConfig:
    exit_layer: int = 15  # E: decoder layers the draft runs (1..L-1)
    adapter_layers: int = 1  # zero-initialised ResBlocks before the norm (0 = none)
    own_norm: bool = True  # train a copy of the base final norm (False: reuse the base norm)
    draft_vocab_size: int | None = None  # score only the N most frequent training tokens when drafting (None: all)


@dataclasses.dataclass
class DraftDefaults:
    max_depth: int = 6  # chain length / deepest tree level when drafting
    top_k: int = 1  # children per node (1 = chain)
    threshold: float = 0.0  # stop a path when its draft confidence falls below this


@dataclasses.dataclass
class EarlyExitRecipeConfig:
    model: str = "smollm2-135m-instruct"  # alias, hub id or local path; tiny:<arch> for a tiny random test model
    output_dir: str = "runs/early-exit"  # checkpoints, self-distilled data, metrics.jsonl, logs
    heads_dir: str | None = None  # final classifier (None: <output_dir>/heads)
    seed: int = 0  # data order, sampling, initialisation
    resume: bool = False  # continue from the latest complete checkpoint in output_dir (same as --resume)
    loss_chunk_size: int = 1024  # positions per LM-head matmul in the loss (memory: chunk x vocab floats)
    cache_hidden_states: bool = True  # run the frozen base once over the training data, keep its states in memory
    loss_vocab: str = "auto"  # full | draft (KL over the draft vocabulary only: cheaper) | auto (draft if it is set)
    classifier: ClassifierConfig = dataclasses.field(default_factory=ClassifierConfig)  # what is trained
    draft: DraftDefaults = dataclasses.field(default_factory=DraftDefaults)  # draft policy saved with it
    data: T.DataConfig = dataclasses.field(default_factory=T.DataConfig)  # training data
    optim: T.OptimConfig = dataclasses.field(default_factory=T.OptimConfig)  # optimizer and schedule
    logging: T.LoggingConfig = dataclasses.field(default_factory=T.LoggingConfig)  # trackers, checkpoints

    def __post_init__(self):
        c = self.classifier
        if self.loss_vocab not in ("auto", "full", "draft"):
            raise ValueError(f"loss_vocab must be auto, full or draft, got {self.loss_vocab!r}")
        if self.loss_vocab == "draft" and c.draft_vocab_size is None:
            raise ValueError("loss_vocab: draft needs classifier.draft_vocab_size")
        if c.adapter_layers < 0:
            raise ValueError(f"classifier.adapter_layers must be >= 0, got {c.adapter_layers}")
        if c.adapter_layers == 0 and not c.own_norm:
            raise ValueError("nothing to train: set classifier.adapter_layers >= 1 or classifier.own_norm: true "
                             "(the training-free classifier needs no recipe: --draft early-exit exit_layer=E)")


def trained_positions(batch: dict) -> torch.Tensor:
    """``[b, s - 1]`` bool: positions whose next token is a trained (assistant) token."""
    return batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()


def frequent_tokens(examples: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent trained tokens, most frequent first, topped up with unseen ids in id order."""
    counts = Counter(t for e in examples for t, m in zip(e["input_ids"], e["loss_mask"]) if m)
    ranked = [t for t, _ in counts.most_common(size)]
    seen = set(ranked)
    ranked += [t for t in range(vocab_size) if t not in seen][: size - len(ranked)]
    return torch.tensor(ranked, dtype=torch.long)


class EarlyExitRecipe:
    def __init__(self, cfg: EarlyExitRecipeConfig, resume: bool = False, argv: list[str] | None = None):
        self.cfg, self.resume = cfg, resume
        self.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with the classifier
        self.output_dir = Path(cfg.output_dir)
        self.heads_dir = Path(cfg.heads_dir or self.output_dir / "heads")

    # ------------------------------------------------------------ setup
    def setup(self):
        cfg, c = self.cfg, self.cfg.classifier
        self.accelerator = acc = T.make_accelerator(self.output_dir, cfg.logging.report_to,
                                                    cfg.optim.gradient_accumulation_steps, cfg.seed)
        self.base, self.tokenizer = T.load_base_model(cfg.model)
        self.base.requires_grad_(False).eval()
        self.train_examples, self.eval_examples = T.prepare_examples(
            cfg.data, self.base, self.tokenizer, self.output_dir / "data", acc, cfg.seed)
        vocab = self.base.get_output_embeddings().weight.shape[0]
        draft_vocab = None if c.draft_vocab_size is None else frequent_tokens(self.train_examples, c.draft_vocab_size, vocab)
        classifier = new_classifier(self.base, c.exit_layer, adapter_layers=c.adapter_layers, own_norm=c.own_norm,
                                    draft_vocab=draft_vocab)
        classifier.config.policy = dataclasses.asdict(cfg.draft)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        global_batch = cfg.optim.batch_size * acc.num_processes
        self.steps_per_epoch = max(1, len(self.train_examples) // (global_batch * cfg.optim.gradient_accumulation_steps))
        self.total_steps = min(cfg.optim.max_steps or 10**12, self.steps_per_epoch * cfg.optim.epochs)
        optimizer = torch.optim.AdamW(classifier.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, T.lr_lambda(cfg.optim, self.total_steps))
        # Only the classifier is prepared (and checkpointed): the frozen base is shared, never copied or saved.
        self.model, self.optimizer, self.scheduler = acc.prepare(classifier, optimizer, scheduler)
        use_draft = cfg.loss_vocab == "draft" or (cfg.loss_vocab == "auto" and draft_vocab is not None)
        self.loss_rows = classifier.draft_vocab.clone() if use_draft else None
        self.hidden_cache = self._hidden_cache() if cfg.cache_hidden_states else None
        self.step = 0
        if self.resume and (ckpt := T.latest_checkpoint(self.output_dir)) is not None:
            self.step = T.load_checkpoint(acc, ckpt)["step"]
            acc.print(f"resumed from {ckpt} (step {self.step})")
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(T.config_to_dict(cfg), indent=2))
        acc.init_trackers(cfg.logging.project, config=_flatten(T.config_to_dict(cfg)))
        trainable, _ = T.count_parameters(self.model)
        acc.print(f"early-exit at layer {c.exit_layer}: {len(self.train_examples)} train / {len(self.eval_examples)} "
                  f"eval examples, {self.total_steps} steps, {trainable:,} trainable parameters")

    # ------------------------------------------------------------ loss
    @torch.no_grad()
    def base_states(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden after layers[:E], final hidden after the norm)``, both ``[b, s, hidden]``, of the frozen base."""
        out = self.base(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
        return out.hidden_states[self.cfg.classifier.exit_layer], out.hidden_states[-1]

    @torch.no_grad()
    def _hidden_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The frozen base's two states for every training example, computed once: every epoch reuses them."""
        out = []
        size = self.cfg.optim.batch_size
        for start in tqdm(range(0, len(self.train_examples), size), desc="base hidden states",
                          disable=not self.accelerator.is_local_main_process):
            chunk = self.train_examples[start:start + size]
            exit_hidden, final_hidden = self.base_states(collate(chunk, self.pad_id))
            out += [(exit_hidden[i, :len(e["input_ids"])].clone(), final_hidden[i, :len(e["input_ids"])].clone())
                    for i, e in enumerate(chunk)]
        return out

    def _cached_states(self, indices: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        states = [torch.zeros(len(indices), width, self.base.config.hidden_size) for _ in range(2)]
        for row, i in enumerate(indices):
            for which in range(2):
                part = self.hidden_cache[i][which]
                states[which][row, :len(part)] = part
        return states[0], states[1]

    def loss(self, batch: dict, denominator: torch.Tensor, indices: list[int] | None = None) -> torch.Tensor:
        """Summed KL(full || exit) over this process's trained positions, over the global per-process count.
        With a draft vocabulary as ``loss_vocab`` both distributions are renormalised over those rows."""
        if self.hidden_cache is not None and indices is not None:
            exit_hidden, final_hidden = self._cached_states(indices, batch["input_ids"].shape[1])
        else:
            exit_hidden, final_hidden = self.base_states(batch)
        valid = trained_positions(batch)
        features = self.model(exit_hidden[:, :-1][valid], self.base, features_only=True)  # [n, hidden]
        head = self.base.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if self.loss_rows is not None:
            weight = weight[self.loss_rows]
            bias = None if bias is None else bias[self.loss_rows]
        kl = T.chunked_kl(features, final_hidden[:, :-1][valid], weight, self.cfg.loss_chunk_size, bias)
        return kl / denominator

    # ------------------------------------------------------------ train
    def _step_batches(self, step: int) -> list[list[int]]:
        return T.step_batches(len(self.train_examples), step, self.steps_per_epoch, self.cfg.optim, self.accelerator,
                              self.cfg.seed)

    def train(self):
        cfg, acc = self.cfg, self.accelerator
        bar = tqdm(total=self.total_steps, initial=self.step, desc="early-exit", disable=not acc.is_local_main_process)
        self.model.train()
        self.history = []
        started = time.time()
        while self.step < self.total_steps:
            step_indices = self._step_batches(self.step)
            batches = [collate([self.train_examples[i] for i in ix], self.pad_id) for ix in step_indices]
            count = sum(trained_positions(b).sum() for b in batches)
            denominator = T.global_mean_denominator(acc, torch.as_tensor(count))
            loss_sum = 0.0
            for m, batch in enumerate(batches):
                with acc.no_sync(self.model) if m < len(batches) - 1 else _nullcontext():
                    loss = self.loss(batch, denominator, step_indices[m])
                    acc.backward(loss)
                loss_sum += loss.detach().item()
            if cfg.optim.max_grad_norm:
                acc.clip_grad_norm_(self.model.parameters(), cfg.optim.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            record = {"step": self.step, "loss": acc.reduce(torch.tensor(loss_sum), reduction="mean").item(),
                      "lr": self.scheduler.get_last_lr()[0]}
            self.history.append(record)
            if self.step % cfg.logging.log_every == 0 or self.step == self.total_steps:
                acc.log(record, step=self.step)
                self._append_metrics(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}")
            if cfg.logging.save_every and self.step % cfg.logging.save_every == 0:
                self.save_checkpoint()
        bar.close()
        if self.history and not (cfg.logging.save_every and self.step % cfg.logging.save_every == 0):
            self.save_checkpoint()  # the final state, so a later run with more steps can --resume from it
        self.train_seconds = time.time() - started

    def save_checkpoint(self):
        T.save_checkpoint(self.accelerator, self.output_dir, self.step, {"config": T.config_to_dict(self.cfg)},
                          keep_last=self.cfg.logging.keep_last)

    # ------------------------------------------------------------ evaluate and save
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Top-1 agreement with the full model on the held-out split: the trained classifier, and the training-free
        one (base norm + LM head at the same layer) for comparison."""
        trained = self.accelerator.unwrap_model(self.model).eval()
        untrained = new_classifier(self.base, self.cfg.classifier.exit_layer)
        head = self.base.get_output_embeddings()
        hits = {"top1_agreement": 0, "untrained_top1_agreement": 0}
        total = 0
        for start in range(0, len(self.eval_examples), self.cfg.optim.batch_size):
            batch = collate(self.eval_examples[start:start + self.cfg.optim.batch_size], self.pad_id)
            exit_hidden, final_hidden = self.base_states(batch)
            valid = trained_positions(batch)
            targets = head(final_hidden[:, :-1][valid]).argmax(-1)
            for name, classifier in (("top1_agreement", trained), ("untrained_top1_agreement", untrained)):
                features = classifier(exit_hidden[:, :-1][valid], self.base, features_only=True)
                hits[name] += int(T.chunked_rank_counts(features, head.weight, targets, 1, self.cfg.loss_chunk_size,
                                                        head.bias)[0])
            total += len(targets)
        return {name: h / max(total, 1) for name, h in hits.items()} | {"eval_positions": total}

    def save_heads(self, metrics: dict):
        cfg, acc = self.cfg, self.accelerator
        if not acc.is_main_process:
            return
        classifier: ExitClassifier = acc.unwrap_model(self.model)
        launcher = "accelerate launch" if "LOCAL_RANK" in os.environ else "python"
        command = f"{launcher} train/early_exit.py {' '.join(shlex.quote(a) for a in self.argv)}"
        classifier.config.metrics = {
            **metrics, "command": command, "recipe": T.config_to_dict(cfg), "steps": self.step,
            "train_examples": len(self.train_examples),
            "train_tokens": sum(len(e["input_ids"]) for e in self.train_examples),
            "final_loss": self.history[-1]["loss"] if self.history else None,
        }
        classifier.save_pretrained(self.heads_dir, self.base, notes=f"\nTrained with:\n\n```\n{command}\n```\n")
        acc.print(f"classifier saved to {self.heads_dir}; top-1 agreement {metrics['top1_agreement']:.3f} "
                  f"(untrained {metrics['untrained_top1_agreement']:.3f})")

    def _append_metrics(self, record: dict):
        if self.accelerator.is_main_process:
            with open(self.output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def cleanup(self):
        self.accelerator.end_training()


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


def main(argv: list[str] | None = None) -> dict:
    args = T.parse_recipe_args(argv, __doc__.splitlines()[0])
    cfg = T.load_config(EarlyExitRecipeConfig, args.config, args.overrides)
    recipe = EarlyExitRecipe(cfg, resume=args.resume or cfg.resume, argv=argv)
    recipe.setup()
    recipe.train()
    metrics = recipe.evaluate()
    recipe._append_metrics({"step": recipe.step, **metrics})
    recipe.save_heads(metrics)
    recipe.cleanup()
    return {**metrics, "history": recipe.history}


if __name__ == "__main__":
    main()
