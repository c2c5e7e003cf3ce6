"""Train Medusa heads on a base model: Medusa-1 (frozen backbone, heads only) or Medusa-2 (LoRA backbone + heads).

    accelerate launch train/medusa.py --config configs/medusa/smollm2-135m.yaml [key=value ...] [--resume]
    python train/medusa.py --config configs/medusa/tiny.yaml optim.max_steps=2
    accelerate launch --multi_gpu --num_processes 2 train/medusa.py --config ...   # 2 processes (DDP; CPU if no GPU)

(``accelerate launch --cpu --num_processes 2`` starts a single process in accelerate 1.x; see above for two.)

Head ``k`` at position ``t`` learns the token at ``t + k + 2``; its loss is weighted ``head_decay ** k``. The final
heads (config.json + model.safetensors + README with per-head accuracies) go to ``heads_dir``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from tqdm.auto import tqdm

from medusa.heads import MedusaHeads, path_tokens
from medusa.trees import default_tree
from selfspec import training as T
from selfspec.training.data import collate, frequent_tokens, token_columns

HEAD_ACCURACY_TOP_K = 10  # ranks measured per head; tree calibration reads them


@dataclasses.dataclass
class HeadsConfig:
    num_heads: int = 4  # heads; head k drafts the token k + 2 ahead
    num_layers: int = 1  # ResBlocks per head
    share_lm_head: bool = True  # reuse the base LM head (not saved); False: a private, trained head each
    draft_vocab_size: int | None = None  # draft from the N most frequent training tokens only (None: all)
    sequential: bool = False  # Hydra-style: head k also reads the path's token at depth k (teacher-forced here)
    prefix_attention: bool = False  # one causal attention block over the hidden states + next tokens first
    prefix_mlp_size: int = 0  # inner size of the prefix block's SwiGLU MLP (0: attention only)

    def __post_init__(self):
        if isinstance(self.num_heads, bool) or not isinstance(self.num_heads, int) or self.num_heads < 1:
            raise ValueError(f"heads.num_heads must be an integer >= 1, got {self.num_heads!r}")
        if not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"heads.num_layers must be an integer >= 1, got {self.num_layers!r}")


@dataclasses.dataclass
class MedusaRecipeConfig:
    model: str = "smollm2-135m-instruct"  # alias, hub id or local path; tiny:<arch> for a tiny random test model
    output_dir: str = "runs/medusa"  # checkpoints, data, metrics.jsonl, logs
    heads_dir: str | None = None  # final heads (None: <output_dir>/heads)
    seed: int = 0  # seeds data order, sampling and initialisation
    num_threads: int | None = None  # torch CPU threads per process (None: torch's default; 1 on a busy machine)
    resume: bool = False  # continue from the latest complete checkpoint in output_dir (same as --resume)
    method: str = "medusa1"  # medusa1: frozen backbone | medusa2: LoRA backbone + heads
    cache_hidden_states: bool = True  # medusa1: run the base once, keep its hidden states on disk for every epoch
    hidden_cache_dir: str | None = None  # where (None: <output_dir>/data); recipes on the same data can share it
    head_decay: float = 0.8  # weight of head k's loss is head_decay ** k
    loss_chunk_size: int = 1024  # positions per LM-head matmul in the loss (memory: chunk x vocab floats)
    base_loss: str = "lm"  # medusa2: lm (next-token loss on the data) | kl (KL to the frozen base) | none
    base_loss_weight: float = 1.0  # medusa2: weight of the base loss
    heads_loss_weight: float = 0.2  # medusa2: weight of the heads' loss after warm-up (medusa1: always 1)
    heads_warmup_steps: int = 0  # medusa2: steps over which the heads' weight ramps linearly from 0
    tree_size: int = 16  # nodes of the default tree saved with the heads (from the measured accuracies)
    loss_vocab: str = "auto"  # full | draft (cross entropy over the draft vocabulary only: its targets, its rows) | auto
    distill_weight: float = 0.0  # weight of KL(base || head) against the base's own distribution; CE gets 1 - this
    heads: HeadsConfig = dataclasses.field(default_factory=HeadsConfig)  # head shape
    lora: T.LoraConfig = dataclasses.field(default_factory=T.LoraConfig)  # medusa2 adapters
    data: T.DataConfig = dataclasses.field(default_factory=T.DataConfig)  # training data
    optim: T.OptimConfig = dataclasses.field(default_factory=T.OptimConfig)  # optimizer and schedule
    logging: T.LoggingConfig = dataclasses.field(default_factory=T.LoggingConfig)  # trackers, checkpoints

    def __post_init__(self):
        if self.method not in ("medusa1", "medusa2"):
            raise ValueError(f"method must be medusa1 or medusa2, got {self.method!r}")
        if self.base_loss not in ("lm", "kl", "none"):
            raise ValueError(f"base_loss must be lm, kl or none, got {self.base_loss!r}")
        if self.loss_vocab not in ("auto", "full", "draft"):
            raise ValueError(f"loss_vocab must be auto, full or draft, got {self.loss_vocab!r}")
        if self.loss_vocab == "draft" and self.heads.draft_vocab_size is None:
            raise ValueError("loss_vocab: draft needs heads.draft_vocab_size")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(f"distill_weight must be in [0, 1], got {self.distill_weight!r}")


class MedusaModel(nn.Module):
    """Backbone + heads as one module, so DDP/FSDP see (and synchronise) every trainable parameter."""

    def __init__(self, backbone: nn.Module, heads: MedusaHeads):
        super().__init__()
        self.backbone, self.heads = backbone, heads

    def forward(self, input_ids=None, attention_mask=None, hidden_states=None):
        if hidden_states is None:
            trainable = any(p.requires_grad for p in self.backbone.parameters())
            with torch.set_grad_enabled(torch.is_grad_enabled() and trainable):
                hidden_states = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        # Sequential heads read the data's own next tokens: on self-distilled data, exactly the path that greedy
        # verification accepts.
        config = self.heads.config
        tokens = path_tokens(input_ids, self.heads.num_heads) if config.sequential or config.prefix_attention else None
        return hidden_states, self.heads.features(hidden_states, tokens=tokens)  # [b, s, h], [heads, b, s, h]


def head_targets(batch: dict, k: int):
    """``(rows, cols, targets)`` of head ``k``: positions ``t`` whose token ``t + k + 2`` is a trained token."""
    shift = k + 2
    valid = batch["loss_mask"][:, shift:].bool() & batch["attention_mask"][:, :-shift].bool()
    rows, cols = valid.nonzero(as_tuple=True)
    return rows, cols, batch["input_ids"][:, shift:][rows, cols]


RecipeConfig = MedusaRecipeConfig  # the name tests/test_configs.py looks for in every recipe


class MedusaRecipe(T.Recipe):
    """Medusa heads on a frozen (medusa1) or LoRA-adapted (medusa2) backbone; the loop is ``T.Recipe``'s."""

    config_class = MedusaRecipeConfig
    script = "train/medusa.py"

    @property
    def progress_desc(self) -> str:
        return self.cfg.method

    # ------------------------------------------------------------ setup
    def _use_draft_vocab(self, heads: MedusaHeads) -> None:
        """The LM-head rows and token -> column map of ``heads.draft_vocab`` that the loss trains through. Again
        after a checkpoint is loaded: its vocabulary wins over the one counted on (possibly changed) data."""
        self.draft_rows = self.to_draft = None
        if heads.draft_vocab is not None and self.cfg.loss_vocab != "full":
            # The heads can only ever propose draft-vocabulary tokens: train them on those targets, through those
            # LM-head rows only (draft_vocab_size / vocab_size of the loss's cost; the LM head is frozen).
            self.draft_rows = heads.shared_lm_head.weight.detach()[heads.draft_vocab].contiguous()
            self.to_draft = token_columns(heads.draft_vocab, heads.config.vocab_size)

    def after_resume(self):
        self._use_draft_vocab(self.accelerator.unwrap_model(self.model).heads)

    def setup(self):
        cfg = self.cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.setup_data()
        heads = MedusaHeads.for_model(self.base, dtype=torch.float32, **dataclasses.asdict(cfg.heads))
        if heads.draft_vocab is not None:
            heads.set_draft_vocab(frequent_tokens(self.train_examples, heads.config.draft_vocab_size,
                                                  heads.config.vocab_size))
        self._use_draft_vocab(heads)
        backbone = self.base.get_decoder()
        if cfg.method == "medusa2":
            self.add_lora()  # the backbone now runs the adapters
        self.model = MedusaModel(backbone, heads)
        self._check_trainable()
        self.hidden_cache = self._hidden_cache() if cfg.method == "medusa1" and cfg.cache_hidden_states else None
        self.setup_optimizer(self.model)
        self.setup_run()
        acc = self.accelerator
        trainable, total = T.count_parameters(self.model)
        acc.print(f"{cfg.method}: {len(self.train_examples)} train / {len(self.eval_examples)} eval examples, "
                  f"{self.total_steps} steps, {acc.num_processes} processes, "
                  f"trainable {trainable:,} of {total:,} parameters")

    def _check_trainable(self):
        heads = {id(p) for p in self.model.heads.parameters()}
        for name, p in self.model.named_parameters():
            if name.startswith("heads."):
                assert p.requires_grad, f"head parameter {name} is frozen"
            elif self.cfg.method == "medusa1":
                assert not p.requires_grad, f"medusa1 trains only the heads, but {name} is trainable"
            else:
                assert p.requires_grad == ("lora_" in name), f"medusa2 trains LoRA + heads only; {name} disagrees"
        assert heads and all(p.requires_grad for p in self.model.heads.parameters())

    def _hidden_cache(self) -> list[torch.Tensor]:
        """Base hidden states of every training example, computed once (by the main process) and kept on disk."""
        directory = self.cfg.hidden_cache_dir or self.output_dir / "data"
        states = T.cached_hidden_states(self.base, self.train_examples, [-1], directory, pad_id=self.pad_id,
                                        accelerator=self.accelerator,
                                        progress=lambda it: tqdm(it, desc="caching hidden states"))
        return states[-1]

    # ------------------------------------------------------------ loss
    def make_batch(self, indices: list[int]) -> dict:
        batch = super().make_batch(indices)
        if self.hidden_cache is not None:
            hidden = torch.zeros(len(indices), batch["input_ids"].shape[1], self.hidden_cache[0].shape[-1])
            for row, i in enumerate(indices):
                hidden[row, :len(self.hidden_cache[i])] = self.hidden_cache[i]
            batch["hidden_states"] = hidden
        return batch

    def loss_targets(self, batch: dict, k: int):
        """``(rows, cols, targets, weight, bias)`` of head ``k``'s loss: every trained target through the full LM
        head, or (``loss_vocab`` draft) the targets in the draft vocabulary, as draft indices, through its rows."""
        rows, cols, targets = head_targets(batch, k)
        if self.draft_rows is None:
            return (rows, cols, targets, *_lm_head(self.accelerator.unwrap_model(self.model).heads, k))
        keep = self.to_draft[targets] >= 0
        return rows[keep], cols[keep], self.to_draft[targets[keep]], self.draft_rows, None

    def counts(self, batch: dict) -> torch.Tensor:
        """``[heads + 1]`` target counts: one per head, then the base next-token targets."""
        counts = [len(self.loss_targets(batch, k)[0]) for k in range(self.cfg.heads.num_heads)]
        counts.append(int((batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()).sum()))
        return torch.tensor(counts, dtype=torch.float32)

    def heads_weight(self) -> float:
        if self.cfg.method == "medusa1":
            return 1.0
        ramp = 1.0 if self.cfg.heads_warmup_steps <= 0 else min(1.0, self.step / self.cfg.heads_warmup_steps)
        return self.cfg.heads_loss_weight * ramp

    def loss(self, batch: dict, denominators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed losses over this process's batch divided by the global per-process denominators, so gradients
        averaged over processes equal the mean over all targets. Returns (total, per-term [heads + 1])."""
        cfg, unwrapped = self.cfg, self.accelerator.unwrap_model(self.model)
        hidden, features = self.model(batch["input_ids"], batch["attention_mask"], batch.get("hidden_states"))
        terms = []
        for k in range(cfg.heads.num_heads):
            rows, cols, targets, weight, bias = self.loss_targets(batch, k)
            term = torch.zeros(())
            if cfg.distill_weight < 1.0:
                term = (1.0 - cfg.distill_weight) * T.chunked_cross_entropy(
                    features[k, rows, cols], weight, targets, cfg.loss_chunk_size, bias)
            if cfg.distill_weight > 0.0:
                # The base's own distribution for the token head k drafts: its logits at position t + k + 1.
                teacher = hidden[rows, cols + k + 1].detach()
                term = term + cfg.distill_weight * T.chunked_kl(features[k, rows, cols], teacher, weight,
                                                                cfg.loss_chunk_size, bias)
            terms.append(term / denominators[k])
        total = self.heads_weight() * sum(cfg.head_decay ** k * t for k, t in enumerate(terms))
        base_term = torch.zeros(())
        if cfg.method == "medusa2" and cfg.base_loss != "none":
            valid = batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()
            lm_head = self.base.get_output_embeddings()
            positions = hidden[:, :-1][valid]  # [n, hidden]
            if cfg.base_loss == "lm":
                base_term = T.chunked_cross_entropy(positions, lm_head.weight, batch["input_ids"][:, 1:][valid],
                                                    cfg.loss_chunk_size, lm_head.bias)
            else:
                with torch.no_grad(), self.peft.disable_adapter():
                    frozen = unwrapped.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
                base_term = T.chunked_kl(positions, frozen.last_hidden_state[:, :-1][valid], lm_head.weight,
                                         cfg.loss_chunk_size, lm_head.bias)
            base_term = base_term / denominators[-1]
            total = total + cfg.base_loss_weight * base_term
        return total, torch.stack([t.detach() for t in terms] + [base_term.detach()])

    def step_record(self, terms: torch.Tensor) -> dict:
        record = {f"head{k}_loss": terms[k].item() for k in range(self.cfg.heads.num_heads)}
        if self.cfg.method == "medusa2":
            record.update(base_loss=terms[-1].item(), heads_weight=self.heads_weight())
        return record

    # ------------------------------------------------------------ evaluate and save
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per-head accuracy by rank on the held-out split (and the base model's own next-token top-1)."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        unwrapped.eval()
        k_heads, counts = self.cfg.heads.num_heads, torch.zeros(self.cfg.heads.num_heads, HEAD_ACCURACY_TOP_K)
        totals, base_hits, base_total = torch.zeros(k_heads), 0, 0
        heads = unwrapped.heads
        if heads.draft_vocab is not None:  # measure what the drafter proposes: ranks within the draft vocabulary
            to_draft = token_columns(heads.draft_vocab, heads.config.vocab_size)
        covered = 0
        for start in range(0, len(self.eval_examples), self.cfg.optim.batch_size):
            batch = collate(self.eval_examples[start:start + self.cfg.optim.batch_size], self.pad_id)
            hidden, features = unwrapped(batch["input_ids"], batch["attention_mask"])
            for k in range(k_heads):
                rows, cols, targets = head_targets(batch, k)
                weight, bias = _lm_head(heads, k)
                if heads.draft_vocab is not None:
                    weight, bias = weight[heads.draft_vocab], None if bias is None else bias[heads.draft_vocab]
                    targets = to_draft[targets]  # -1 (never a rank) outside the draft vocabulary
                    covered += int((targets >= 0).sum()) if k == 0 else 0
                counts[k] += T.chunked_rank_counts(features[k, rows, cols], weight, targets, HEAD_ACCURACY_TOP_K,
                                                   self.cfg.loss_chunk_size, bias)
                totals[k] += len(targets)
            valid = batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()
            lm_head = self.base.get_output_embeddings()
            base_hits += int(T.chunked_rank_counts(hidden[:, :-1][valid], lm_head.weight,
                                                   batch["input_ids"][:, 1:][valid], 1, self.cfg.loss_chunk_size,
                                                   lm_head.bias)[0])
            base_total += int(valid.sum())
        accuracy = (counts / totals.clamp(min=1)[:, None]).tolist()
        metrics = {"head_accuracy": accuracy, "top1": [row[0] for row in accuracy],
                   "top5": [sum(row[:5]) for row in accuracy], "base_top1": base_hits / max(1, base_total),
                   "eval_targets": totals.long().tolist()}
        if heads.draft_vocab is not None:
            metrics["draft_vocab_coverage"] = covered / max(1, int(totals[0]))  # head 0's targets in the draft vocab
        return metrics

    def save_heads(self, metrics: dict):
        cfg, acc = self.cfg, self.accelerator
        if not acc.is_main_process:
            return
        heads = acc.unwrap_model(self.model).heads
        heads.config.head_accuracy = metrics["head_accuracy"]
        heads.config.tree = default_tree(metrics["head_accuracy"], size=cfg.tree_size)
        heads.config.training = {
            "command": self.command(),
            "recipe": T.config_to_dict(cfg),
            "metrics": {"top1": metrics["top1"], "top5": metrics["top5"], "base_top1": metrics["base_top1"],
                        "eval_targets": metrics["eval_targets"], "train_examples": len(self.train_examples),
                        **({"draft_vocab_coverage": metrics["draft_vocab_coverage"]}
                           if "draft_vocab_coverage" in metrics else {}),
                        "train_tokens": sum(len(e["input_ids"]) for e in self.train_examples),
                        "steps": self.step, "processes": acc.num_processes,
                        "stopped_by": self.stop_reason,  # "time budget", "SIGTERM"... or None (finished)
                        "final_loss": self.history[-1]["loss"] if self.history else None},
        }
        if cfg.method == "medusa1":
            heads.save_pretrained(self.heads_dir)  # config.json carries the recipe, the command and the metrics
        else:  # the heads were trained on the adapted backbone: the adapter is saved with them, in one atomic write
            with self.exported_backbone_adapter() as (staging, adapter, _):
                heads.config.backbone_adapter = adapter
                heads.save_pretrained(self.heads_dir, backbone_adapter=staging)
        acc.print(f"heads saved to {self.heads_dir}; top-1 per head: {[round(a, 3) for a in metrics['top1']]}")

    def tracked_eval(self, metrics: dict) -> dict:
        return {f"eval/top1_head{k}": a for k, a in enumerate(metrics["top1"])}


def _lm_head(heads: MedusaHeads, k: int):
    """``(weight [vocab, hidden], bias or None)`` of head ``k``'s LM head (the shared base head or its own)."""
    if heads.shared_lm_head is not None:
        return heads.shared_lm_head.weight, getattr(heads.shared_lm_head, "bias", None)
    return heads.lm_head_weight[k], None if heads.lm_head_bias is None else heads.lm_head_bias[k]


def main(argv: list[str] | None = None) -> dict:
    return MedusaRecipe.from_command_line(argv, __doc__.splitlines()[0]).run()


if __name__ == "__main__":
    main()
