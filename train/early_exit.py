"""Train an early-exit classifier: distilled on a frozen base, or LayerSkip-style by fine-tuning the base with LoRA.

    accelerate launch train/early_exit.py --config configs/early_exit/smollm2-135m.yaml [key=value ...] [--resume]
    accelerate launch train/early_exit.py --config configs/early_exit/smollm2-135m-layerskip.yaml
    python train/early_exit.py --config configs/early_exit/tiny.yaml optim.max_steps=2

``method: distill`` (default): the classifier (ResBlock or attention adapter and/or its own norm, before the shared
LM head) reads the base hidden state after ``layers[:exit_layer]`` and learns the full model's next-token
distribution at every trained position. Only the classifier is trained and checkpointed; the base stays frozen, so
drafts keep sharing its KV cache.

``method: layerskip``: LoRA on the backbone (``peft``), trained with the early-exit loss of
``early_exit.exit_loss`` (next-token cross entropy on the data at several layers through the base final norm and
LM head); only the LoRA parameters train, and the classifier is the training-free one at ``exit_layer`` of the
adapted model. The adapter is saved with it in ``backbone_adapter/``; it decodes the adapted model.

The result (config.json + model.safetensors + README with top-1 agreement before/after) goes to ``heads_dir``.
"""

from __future__ import annotations

import contextlib
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

from early_exit.classifier import ExitClassifier, check_adapter, new_classifier  # noqa: E402
from early_exit.exit_loss import (WEIGHT_RULES, EarlyExitBackbone, early_exit_losses,  # noqa: E402
                                  resolve_loss_layers)
from early_exit.layers import num_layers  # noqa: E402
from selfspec import training as T  # noqa: E402
from selfspec.data import collate, frequent_tokens  # noqa: E402
from selfspec.identity import base_model_identity  # noqa: E402

METHODS = ("distill", "layerskip")


@dataclasses.dataclass
class ClassifierConfig:
    exit_layer: int = 15  # E: decoder layers the draft runs (1..L-1)
    adapter_layers: int = 1  # zero-initialised adapter blocks before the norm (0 = none; attention: exactly 1)
    adapter: str = "resblock"  # resblock (position-wise) | attention (one causal attention-only block, Kangaroo)
    adapter_heads: int | None = None  # attention adapter heads (None: the base model's head count)
    own_norm: bool = True  # train a copy of the base final norm (False: reuse the base norm)
    draft_vocab_size: int | None = None  # score only the N most frequent training tokens when drafting (None: all)

    def __post_init__(self):
        check_adapter(self.adapter, self.adapter_layers, self.adapter_heads)


@dataclasses.dataclass
class EarlyExitLossConfig:
    """method: layerskip. Loss layers l (1..L, L = the final layer) and their weights (see early_exit.exit_loss)."""

    loss_layers: list[int] | None = None  # explicit layers (must contain exit_layer); None: the loss_every rule
    loss_every: int = 4  # rule: every k-th layer, plus the exit layer and the final layer
    layer_weights: list[float] | None = None  # one weight per loss layer, in order (None: weight_rule)
    weight_rule: str = "linear"  # linear: layer l weighs l / L (the final 1) | uniform: every layer 1

    def __post_init__(self):
        if self.weight_rule not in WEIGHT_RULES:
            raise ValueError(f"layerskip.weight_rule must be one of {', '.join(WEIGHT_RULES)}, got {self.weight_rule!r}")
        if isinstance(self.loss_every, bool) or not isinstance(self.loss_every, int) or self.loss_every < 1:
            raise ValueError(f"layerskip.loss_every must be an integer >= 1, got {self.loss_every!r}")
        if self.layer_weights is not None and (self.loss_layers is None
                                               or len(self.layer_weights) != len(self.loss_layers)):
            raise ValueError("layerskip.layer_weights needs an explicit layerskip.loss_layers of the same length")


@dataclasses.dataclass
class LoraConfig:
    r: int = 8  # LoRA rank
    alpha: int = 16  # LoRA scaling numerator
    dropout: float = 0.0  # LoRA dropout
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["q_proj", "v_proj"])  # adapted layers


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
    method: str = "distill"  # distill: frozen base, train the classifier | layerskip: LoRA backbone, early-exit loss
    classifier: ClassifierConfig = dataclasses.field(default_factory=ClassifierConfig)  # what is trained
    draft: DraftDefaults = dataclasses.field(default_factory=DraftDefaults)  # draft policy saved with it
    layerskip: EarlyExitLossConfig = dataclasses.field(default_factory=EarlyExitLossConfig)  # method: layerskip
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # method: layerskip backbone adapter
    data: T.DataConfig = dataclasses.field(default_factory=T.DataConfig)  # training data
    optim: T.OptimConfig = dataclasses.field(default_factory=T.OptimConfig)  # optimizer and schedule
    logging: T.LoggingConfig = dataclasses.field(default_factory=T.LoggingConfig)  # trackers, checkpoints

    def __post_init__(self):
        c = self.classifier
        if self.method not in METHODS:
            raise ValueError(f"method must be distill or layerskip, got {self.method!r}")
        if self.loss_vocab not in ("auto", "full", "draft"):
            raise ValueError(f"loss_vocab must be auto, full or draft, got {self.loss_vocab!r}")
        if self.loss_vocab == "draft" and c.draft_vocab_size is None:
            raise ValueError("loss_vocab: draft needs classifier.draft_vocab_size")
        if self.method == "layerskip":
            if c.adapter_layers or c.own_norm:
                raise ValueError("method layerskip trains only the backbone's LoRA for the base final norm + LM head "
                                 "(the training-free classifier of the adapted model): set classifier.adapter_layers: "
                                 "0 and classifier.own_norm: false")
            if self.loss_vocab == "draft":
                raise ValueError("method layerskip trains with cross entropy over the full vocabulary: loss_vocab "
                                 "must be auto or full")
            layers = self.layerskip.loss_layers
            if layers is not None and c.exit_layer not in layers:
                raise ValueError(f"the exit layer {c.exit_layer} must be one of layerskip.loss_layers {layers}")
        elif c.adapter_layers == 0 and not c.own_norm:
            raise ValueError("nothing to train: set classifier.adapter_layers >= 1 or classifier.own_norm: true "
                             "(the training-free classifier needs no recipe: --draft early-exit exit_layer=E)")


def trained_positions(batch: dict) -> torch.Tensor:
    """``[b, s - 1]`` bool: positions whose next token is a trained (assistant) token."""
    return batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()


class EarlyExitRecipe:
    def __init__(self, cfg: EarlyExitRecipeConfig, resume: bool = False, argv: list[str] | None = None):
        self.cfg, self.resume = cfg, resume
        self.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with the classifier
        self.output_dir = Path(cfg.output_dir)
        self.heads_dir = Path(cfg.heads_dir or self.output_dir / "heads")
        self.layerskip = cfg.method == "layerskip"

    # ------------------------------------------------------------ setup
    def setup(self):
        cfg, c = self.cfg, self.cfg.classifier
        self.accelerator = acc = T.make_accelerator(self.output_dir, cfg.logging.report_to,
                                                    cfg.optim.gradient_accumulation_steps, cfg.seed)
        self.base, self.tokenizer = T.load_base_model(cfg.model)
        self.base.requires_grad_(False).eval()
        self.base_identity = base_model_identity(self.base)  # before any adapter: what the classifier records
        self.train_examples, self.eval_examples = T.prepare_examples(
            cfg.data, self.base, self.tokenizer, self.output_dir / "data", acc, cfg.seed)
        vocab = self.base.get_output_embeddings().weight.shape[0]
        draft_vocab = None if c.draft_vocab_size is None else frequent_tokens(self.train_examples, c.draft_vocab_size, vocab)
        self.classifier = new_classifier(self.base, c.exit_layer, adapter_layers=c.adapter_layers, adapter=c.adapter,
                                         adapter_heads=c.adapter_heads, own_norm=c.own_norm, draft_vocab=draft_vocab)
        self.classifier.config.policy = dataclasses.asdict(cfg.draft)
        if self.layerskip:
            from peft import LoraConfig as PeftLoraConfig, get_peft_model

            ls = cfg.layerskip
            self.loss_layers = resolve_loss_layers(c.exit_layer, num_layers(self.base), loss_layers=ls.loss_layers,
                                                   loss_every=ls.loss_every, layer_weights=ls.layer_weights,
                                                   weight_rule=ls.weight_rule)
            decoder = self.base.get_decoder()
            lora = PeftLoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                  target_modules=list(cfg.lora.target_modules))
            self.peft = get_peft_model(self.base, lora)  # injects adapters in place: the decoder now runs them
            trained = EarlyExitBackbone(decoder)
        else:
            trained = self.classifier
        self._check_trainable(trained)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        global_batch = cfg.optim.batch_size * acc.num_processes
        self.steps_per_epoch = max(1, len(self.train_examples) // (global_batch * cfg.optim.gradient_accumulation_steps))
        self.total_steps = min(cfg.optim.max_steps or 10**12, self.steps_per_epoch * cfg.optim.epochs)
        params = [p for p in trained.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, T.lr_lambda(cfg.optim, self.total_steps))
        # Only what trains is prepared (and checkpointed): the classifier, or (layerskip) the LoRA-adapted decoder.
        self.model, self.optimizer, self.scheduler = acc.prepare(trained, optimizer, scheduler)
        use_draft = cfg.loss_vocab == "draft" or (cfg.loss_vocab == "auto" and draft_vocab is not None)
        self.loss_rows = self.classifier.draft_vocab.clone() if use_draft and not self.layerskip else None
        self.hidden_cache = self._hidden_cache() if cfg.cache_hidden_states and not self.layerskip else None
        self.step = 0
        if self.resume and (ckpt := T.latest_checkpoint(self.output_dir)) is not None:
            self.step = T.load_checkpoint(acc, ckpt)["step"]
            acc.print(f"resumed from {ckpt} (step {self.step})")
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.json").write_text(json.dumps(T.config_to_dict(cfg), indent=2))
        acc.init_trackers(cfg.logging.project, config=T.flat_config(cfg))
        trainable, _ = T.count_parameters(self.model)
        what = f"layerskip, loss layers {self.loss_layers}" if self.layerskip else "distill"
        acc.print(f"early-exit at layer {c.exit_layer} ({what}): {len(self.train_examples)} train / "
                  f"{len(self.eval_examples)} eval examples, {self.total_steps} steps, {trainable:,} trainable parameters")

    def _check_trainable(self, trained: torch.nn.Module):
        """distill: exactly the classifier's parameters train. layerskip: exactly the LoRA parameters (the
        classifier is the training-free one and has none; the base norm and LM head stay frozen)."""
        if self.layerskip:
            assert not list(self.classifier.parameters()), "layerskip trains no classifier parameters"
            for name, p in self.base.named_parameters():
                assert p.requires_grad == ("lora_" in name), f"layerskip trains LoRA only; {name} disagrees"
            assert any("lora_" in name for name, _ in trained.named_parameters()), "no LoRA parameters injected"
        else:
            assert not any(p.requires_grad for p in self.base.parameters()), "distill keeps the base frozen"
            params = list(trained.parameters())
            assert params and all(p.requires_grad for p in params), "every classifier parameter must train"

    # ------------------------------------------------------------ loss
    @torch.no_grad()
    def base_states(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden after layers[:E], final hidden after the norm)``, both ``[b, s, hidden]``, of the base (with
        layerskip: as adapted so far)."""
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

    def loss(self, batch: dict, denominator: torch.Tensor, indices: list[int] | None = None):
        """``(loss, per-term losses)``: summed over this process's trained positions, over the global
        per-process count. distill: KL(full || exit) (with a draft vocabulary as ``loss_vocab`` both distributions
        are renormalised over those rows). layerskip: the weighted early-exit cross entropy of every loss layer."""
        valid = trained_positions(batch)
        if self.layerskip:
            hidden_states = self.model(batch["input_ids"], batch["attention_mask"])
            terms = early_exit_losses(hidden_states, self.base, valid, batch["input_ids"][:, 1:][valid],
                                      self.loss_layers, self.cfg.loss_chunk_size)
            terms = [t / denominator for t in terms]
            total = sum(w * t for (_, w), t in zip(self.loss_layers, terms))
            return total, {f"layer{layer}_loss": t.detach().item() for (layer, _), t in zip(self.loss_layers, terms)}
        if self.hidden_cache is not None and indices is not None:
            exit_hidden, final_hidden = self._cached_states(indices, batch["input_ids"].shape[1])
        else:
            exit_hidden, final_hidden = self.base_states(batch)
        # The whole (shifted) sequence goes in: an attention adapter attends causally over earlier positions.
        features = self.model(exit_hidden[:, :-1], self.base, features_only=True,
                              attention_mask=batch["attention_mask"][:, :-1])[valid]  # [n, hidden]
        head = self.base.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if self.loss_rows is not None:
            weight = weight[self.loss_rows]
            bias = None if bias is None else bias[self.loss_rows]
        kl = T.chunked_kl(features, final_hidden[:, :-1][valid], weight, self.cfg.loss_chunk_size, bias)
        return kl / denominator, {}

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
            loss_sum, term_sums = 0.0, Counter()
            for m, batch in enumerate(batches):
                with acc.no_sync(self.model) if m < len(batches) - 1 else contextlib.nullcontext():
                    loss, terms = self.loss(batch, denominator, step_indices[m])
                    acc.backward(loss)
                loss_sum += loss.detach().item()
                term_sums.update(terms)
            if cfg.optim.max_grad_norm:
                acc.clip_grad_norm_(self.model.parameters(), cfg.optim.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            record = {"step": self.step, "loss": acc.reduce(torch.tensor(loss_sum), reduction="mean").item(),
                      "lr": self.scheduler.get_last_lr()[0],
                      **{k: acc.reduce(torch.tensor(v), reduction="mean").item() for k, v in term_sums.items()}}
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
        one (base norm + LM head at the same layer) for comparison. layerskip: the exit of the adapted model
        against the adapted model, and of the plain base (adapter off) against the plain base."""
        unwrapped = self.accelerator.unwrap_model(self.model).eval()
        trained = self.classifier.eval() if self.layerskip else unwrapped
        untrained = new_classifier(self.base, self.cfg.classifier.exit_layer)
        head = self.base.get_output_embeddings()
        hits = {"top1_agreement": 0, "untrained_top1_agreement": 0}
        total = 0
        for start in range(0, len(self.eval_examples), self.cfg.optim.batch_size):
            batch = collate(self.eval_examples[start:start + self.cfg.optim.batch_size], self.pad_id)
            valid, mask = trained_positions(batch), batch["attention_mask"][:, :-1]
            states = self.base_states(batch)
            for name, classifier in (("top1_agreement", trained), ("untrained_top1_agreement", untrained)):
                if self.layerskip and classifier is untrained:
                    with self.peft.disable_adapter():
                        states = self.base_states(batch)
                exit_hidden, final_hidden = states
                targets = head(final_hidden[:, :-1][valid]).argmax(-1)
                features = classifier(exit_hidden[:, :-1], self.base, features_only=True, attention_mask=mask)[valid]
                hits[name] += int(T.chunked_rank_counts(features, head.weight, targets, 1, self.cfg.loss_chunk_size,
                                                        head.bias)[0])
            total += int(valid.sum())
        return {name: h / max(total, 1) for name, h in hits.items()} | {"eval_positions": total}

    def save_heads(self, metrics: dict):
        cfg, acc = self.cfg, self.accelerator
        if not acc.is_main_process:
            return
        classifier: ExitClassifier = self.classifier if self.layerskip else acc.unwrap_model(self.model)
        launcher = "accelerate launch" if "LOCAL_RANK" in os.environ else "python"
        command = f"{launcher} train/early_exit.py {' '.join(shlex.quote(a) for a in self.argv)}"
        classifier.config.metrics = {
            **metrics, "command": command, "recipe": T.config_to_dict(cfg), "steps": self.step,
            "train_examples": len(self.train_examples),
            "train_tokens": sum(len(e["input_ids"]) for e in self.train_examples),
            "final_loss": self.history[-1]["loss"] if self.history else None,
        }
        notes = f"\nTrained with:\n\n```\n{command}\n```\n"
        if not self.layerskip:
            classifier.save_pretrained(self.heads_dir, self.base, notes=notes)
        else:  # the adapter is merged into the base and saved with the classifier, in one atomic write
            import tempfile

            from selfspec.adapters import export_backbone_adapter

            with tempfile.TemporaryDirectory(dir=self.output_dir) as staging:
                classifier.config.backbone_adapter, self.base = export_backbone_adapter(self.peft, staging)
                classifier.save_pretrained(self.heads_dir, self.base, notes=notes, base_identity=self.base_identity,
                                           backbone_adapter=staging)
        acc.print(f"classifier saved to {self.heads_dir}; top-1 agreement {metrics['top1_agreement']:.3f} "
                  f"(untrained {metrics['untrained_top1_agreement']:.3f})")

    def _append_metrics(self, record: dict):
        if self.accelerator.is_main_process:
            with open(self.output_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def cleanup(self):
        self.accelerator.end_training()


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
