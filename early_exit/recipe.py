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

import dataclasses

import torch
from tqdm.auto import tqdm

from early_exit.classifier import ExitClassifier, check_adapter, new_classifier
from early_exit.exit_loss import WEIGHT_RULES, EarlyExitBackbone, early_exit_losses, resolve_loss_layers
from early_exit.layer_dropout import LayerDropout, dropout_rates
from selfspec import training as T
from selfspec.runtime.identity import base_model_identity
from selfspec.runtime.layers import num_decoder_layers
from selfspec.training.data import collate, frequent_tokens

METHODS = ("distill", "layerskip")


@dataclasses.dataclass
class ClassifierConfig:
    exit_layer: int = 15  # E: decoder layers the draft runs (1..L-1)
    adapter_layers: int = 1  # zero-initialised adapter blocks before the norm (0 = none; attention: exactly 1)
    adapter: str = "resblock"  # resblock (position-wise) | attention (one causal attention-only block, Kangaroo)
    adapter_heads: int | None = None  # attention adapter heads (None: the base model's head count)
    adapter_mlp_size: int = 0  # SwiGLU MLP after the attention adapter's attention (0: attention only)
    own_norm: bool = True  # train a copy of the base final norm (False: reuse the base norm)
    draft_vocab_size: int | None = None  # score only the N most frequent training tokens when drafting (None: all)

    def __post_init__(self):
        check_adapter(self.adapter, self.adapter_layers, self.adapter_heads, self.adapter_mlp_size)


@dataclasses.dataclass
class EarlyExitLossConfig:
    """method: layerskip. Loss layers l (1..L, L = the final layer) and their weights (see early_exit.exit_loss)."""

    loss_layers: list[int] | None = None  # explicit layers (must contain exit_layer); None: the loss_every rule
    loss_every: int = 4  # rule: every k-th layer, plus the exit layer and the final layer
    layer_weights: list[float] | None = None  # one weight per loss layer, in order (None: weight_rule)
    weight_rule: str = "linear"  # linear: layer l weighs l / L (the final 1) | uniform: every layer 1
    layer_dropout: float = 0.0  # LayerSkip's p_max: the deepest layer is skipped for this share of the rows
    dropout_scale: str = "exp"  # how the skip rate grows with depth: exp (LayerSkip) | linear | uniform

    def __post_init__(self):
        dropout_rates(2, self.layer_dropout, self.dropout_scale)  # raises on a bad rate or scale
        if self.weight_rule not in WEIGHT_RULES:
            raise ValueError(f"layerskip.weight_rule must be one of {', '.join(WEIGHT_RULES)}, got {self.weight_rule!r}")
        if isinstance(self.loss_every, bool) or not isinstance(self.loss_every, int) or self.loss_every < 1:
            raise ValueError(f"layerskip.loss_every must be an integer >= 1, got {self.loss_every!r}")
        if self.layer_weights is not None and (self.loss_layers is None
                                               or len(self.layer_weights) != len(self.loss_layers)):
            raise ValueError("layerskip.layer_weights needs an explicit layerskip.loss_layers of the same length")


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
    cache_hidden_states: bool = True  # run the frozen base once over the training data, keep its states on disk
    hidden_cache_dir: str | None = None  # where (None: <output_dir>/data); recipes on the same data can share it
    hidden_cache_layers: list[int] = dataclasses.field(default_factory=list)  # more layers stored in the same pass (an exit-layer sweep)
    loss_vocab: str = "auto"  # full | draft (KL over the draft vocabulary only: cheaper) | auto (draft if it is set)
    method: str = "distill"  # distill: frozen base, train the classifier | layerskip: LoRA backbone, early-exit loss
    # A saved classifier to start from (method distill): its exit layer, adapter and draft vocabulary are kept, so
    # ``classifier.*`` must agree on the exit layer; e.g. to go on training the committed one on more data. The run
    # saves a new classifier (with the policy of ``draft``) to heads_dir, which must be another directory.
    init_from: str | None = None
    classifier: ClassifierConfig = dataclasses.field(default_factory=ClassifierConfig)  # what is trained
    draft: DraftDefaults = dataclasses.field(default_factory=DraftDefaults)  # draft policy saved with it
    layerskip: EarlyExitLossConfig = dataclasses.field(default_factory=EarlyExitLossConfig)  # method: layerskip
    lora: T.LoraConfig = dataclasses.field(default_factory=T.LoraConfig)  # method: layerskip backbone adapter
    data: T.DataConfig = dataclasses.field(default_factory=T.DataConfig)  # training data
    optim: T.OptimConfig = dataclasses.field(default_factory=T.OptimConfig)  # optimizer and schedule
    logging: T.LoggingConfig = dataclasses.field(default_factory=T.LoggingConfig)  # trackers, checkpoints

    def __post_init__(self):
        c = self.classifier
        if self.method not in METHODS:
            raise ValueError(f"method must be distill or layerskip, got {self.method!r}")
        if self.loss_vocab not in ("auto", "full", "draft"):
            raise ValueError(f"loss_vocab must be auto, full or draft, got {self.loss_vocab!r}")
        if self.loss_vocab == "draft" and c.draft_vocab_size is None and self.init_from is None:
            raise ValueError("loss_vocab: draft needs classifier.draft_vocab_size")
        T.check_init_from(self.init_from, self.heads_dir, self.output_dir)
        if self.init_from is not None and self.method != "distill":
            raise ValueError("init_from starts a distilled classifier from a saved one; method layerskip trains the "
                             "backbone instead: remove init_from")
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


class EarlyExitRecipe(T.Recipe):
    """An early-exit classifier, distilled (frozen base) or LayerSkip (LoRA backbone); the loop is ``T.Recipe``'s."""

    config_class = EarlyExitRecipeConfig
    script = "train/early_exit.py"
    progress_desc = "early-exit"
    loss_digits = 4
    final_checkpoint = True  # a later run with more steps can --resume from the final state

    def __init__(self, cfg: EarlyExitRecipeConfig, resume: bool = False, argv: list[str] | None = None,
                 allow_changed: tuple[str, ...] = ()):
        super().__init__(cfg, resume, argv, allow_changed)
        self.layerskip = cfg.method == "layerskip"
        self.layer_dropout: LayerDropout | None = None

    # ------------------------------------------------------------ setup
    def setup(self):
        cfg, c = self.cfg, self.cfg.classifier
        self.setup_data()
        self.base_identity = base_model_identity(self.base)  # before any adapter: what the classifier records
        vocab = self.base.get_output_embeddings().weight.shape[0]
        if cfg.init_from is not None:
            self.classifier = ExitClassifier.from_pretrained(cfg.init_from, self.base).float().train()
            if self.classifier.exit_layer != c.exit_layer:
                raise ValueError(f"init_from {cfg.init_from} exits at layer {self.classifier.exit_layer}, but "
                                 f"classifier.exit_layer is {c.exit_layer}: set classifier.exit_layer="
                                 f"{self.classifier.exit_layer}")
            draft_vocab = self.classifier.draft_vocab if self.classifier.draft_vocab.numel() else None
            if self.classifier.config.policy_by_machine:  # chosen for the old weights: recalibrate the new ones
                print(f"early-exit: init_from's policies calibrated per kind of machine "
                      f"({', '.join(sorted(self.classifier.config.policy_by_machine))}) are dropped: they were chosen "
                      "for its weights; `selfspec calibrate` the new classifier", flush=True)
                self.classifier.config.policy_by_machine = {}
            if draft_vocab is None and cfg.loss_vocab == "draft":
                raise ValueError(f"loss_vocab: draft, but the classifier in init_from {cfg.init_from} has no draft "
                                 "vocabulary: set loss_vocab=full (or auto)")
        else:
            draft_vocab = None if c.draft_vocab_size is None else frequent_tokens(self.train_examples,
                                                                                 c.draft_vocab_size, vocab)
            self.classifier = new_classifier(self.base, c.exit_layer, adapter_layers=c.adapter_layers,
                                             adapter=c.adapter, adapter_heads=c.adapter_heads,
                                             adapter_mlp_size=c.adapter_mlp_size, own_norm=c.own_norm,
                                             draft_vocab=draft_vocab)
        self.classifier.config.policy = dataclasses.asdict(cfg.draft)
        if self.layerskip:
            ls = cfg.layerskip
            self.loss_layers = resolve_loss_layers(c.exit_layer, num_decoder_layers(self.base), loss_layers=ls.loss_layers,
                                                   loss_every=ls.loss_every, layer_weights=ls.layer_weights,
                                                   weight_rule=ls.weight_rule)
            decoder = self.base.get_decoder()
            self.add_lora()  # the decoder now runs the adapters
            trained = EarlyExitBackbone(decoder)
            if ls.layer_dropout:
                rates = dropout_rates(num_decoder_layers(self.base), ls.layer_dropout, ls.dropout_scale)
                self.layer_dropout = LayerDropout(decoder.layers, rates, seed=cfg.seed,
                                                  process_index=self.accelerator.process_index)
        else:
            trained = self.classifier
        self._check_trainable(trained)
        # Only what trains is prepared (and checkpointed): the classifier, or (layerskip) the LoRA-adapted decoder.
        self.setup_optimizer(trained)
        use_draft = draft_vocab is not None and cfg.loss_vocab in ("draft", "auto")
        self.loss_rows = self.classifier.draft_vocab.clone() if use_draft and not self.layerskip else None
        self.hidden_cache = self._hidden_cache() if cfg.cache_hidden_states and not self.layerskip else None
        self.setup_run()
        trainable, _ = T.count_parameters(self.model)
        what = f"layerskip, loss layers {self.loss_layers}" if self.layerskip else "distill"
        self.accelerator.print(f"early-exit at layer {c.exit_layer} ({what}): {len(self.train_examples)} train / "
                               f"{len(self.eval_examples)} eval examples, {self.total_steps} steps, "
                               f"{trainable:,} trainable parameters")

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

    def _hidden_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The frozen base's two states for every training example, computed once (and shared through
        ``hidden_cache_dir`` with other recipes on the same data): every epoch reuses them."""
        directory = self.cfg.hidden_cache_dir or self.output_dir / "data"
        exit_layer = self.cfg.classifier.exit_layer
        states = T.cached_hidden_states(self.base, self.train_examples, [exit_layer, -1], directory,
                                        pad_id=self.pad_id, batch_size=self.cfg.optim.batch_size,
                                        accelerator=self.accelerator, also=self.cfg.hidden_cache_layers,
                                        progress=lambda it: tqdm(it, desc="base hidden states",
                                                                 disable=not self.accelerator.is_local_main_process))
        return list(zip(states[exit_layer], states[-1]))

    def make_batch(self, indices: list[int]) -> dict:
        """The micro-batch, with the frozen base's cached ``exit_hidden`` and ``final_hidden`` when there is a
        cache."""
        batch = super().make_batch(indices)
        if self.hidden_cache is not None:
            width = batch["input_ids"].shape[1]
            states = [torch.zeros(len(indices), width, self.base.config.hidden_size) for _ in range(2)]
            for row, i in enumerate(indices):
                for which in range(2):
                    part = self.hidden_cache[i][which]
                    states[which][row, :len(part)] = part
            batch["exit_hidden"], batch["final_hidden"] = states
        return batch

    def counts(self, batch: dict) -> torch.Tensor:
        """Trained positions: every term of the loss averages over them."""
        return trained_positions(batch).sum()

    def loss(self, batch: dict, denominator: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, per-term losses)``: summed over this process's trained positions, over the global
        per-process count. distill: KL(full || exit) (with a draft vocabulary as ``loss_vocab`` both distributions
        are renormalised over those rows), no separate terms. layerskip: the weighted early-exit cross entropy of
        every loss layer, one term per layer."""
        valid = trained_positions(batch)
        if self.layerskip:
            if self.layer_dropout is not None and self.layer_dropout.step != self.step:
                self.layer_dropout.set_step(self.step)  # rows dropped: a function of the step (resume-exact)
            hidden_states = self.model(batch["input_ids"], batch["attention_mask"])
            terms = early_exit_losses(hidden_states, self.base, valid, batch["input_ids"][:, 1:][valid],
                                      self.loss_layers, self.cfg.loss_chunk_size)
            terms = [t / denominator for t in terms]
            total = sum(w * t for (_, w), t in zip(self.loss_layers, terms))
            return total, torch.stack([t.detach() for t in terms])
        if "exit_hidden" in batch:
            exit_hidden, final_hidden = batch["exit_hidden"], batch["final_hidden"]
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
        return kl / denominator, torch.zeros(0)

    def step_record(self, terms: torch.Tensor) -> dict:
        if not self.layerskip:
            return {}
        return {f"layer{layer}_loss": t.item() for (layer, _), t in zip(self.loss_layers, terms)}

    # ------------------------------------------------------------ evaluate and save
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Top-1 agreement with the full model on the held-out split, ranked as drafting ranks (over the draft
        vocabulary when the classifier has one: the loss shapes only those rows, and rows outside it drift, so a
        full-vocabulary argmax would score tokens the draft never proposes): the trained classifier, and the
        training-free one (base norm + LM head at the same layer, over the same rows) for comparison; with a draft
        vocabulary also the trained one over every row (``full_vocab_top1_agreement``). layerskip: the exit of the
        adapted model against the adapted model, and of the plain base (adapter off) against the plain base."""
        unwrapped = self.accelerator.unwrap_model(self.model).eval()
        trained = self.classifier.eval() if self.layerskip else unwrapped
        untrained = new_classifier(self.base, self.cfg.classifier.exit_layer)
        head = self.base.get_output_embeddings()
        vocab = trained.draft_vocab if trained.draft_vocab.numel() else None
        weight, bias, column = head.weight, head.bias, None
        if vocab is not None:  # targets outside the draft vocabulary map to column -1: never a hit
            weight, bias = head.weight[vocab], None if head.bias is None else head.bias[vocab]
            column = torch.full((head.weight.shape[0],), -1, dtype=torch.long, device=vocab.device)
            column[vocab] = torch.arange(vocab.numel(), device=vocab.device)
        hits = {"top1_agreement": 0, "untrained_top1_agreement": 0}
        if vocab is not None:
            hits["full_vocab_top1_agreement"] = 0
        total = 0
        chunk = self.cfg.loss_chunk_size
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
                drafted = targets if column is None else column[targets]
                hits[name] += int(T.chunked_rank_counts(features, weight, drafted, 1, chunk, bias)[0])
                if name == "top1_agreement" and vocab is not None:
                    hits["full_vocab_top1_agreement"] += int(
                        T.chunked_rank_counts(features, head.weight, targets, 1, chunk, head.bias)[0])
            total += int(valid.sum())
        return {name: h / max(total, 1) for name, h in hits.items()} | {"eval_positions": total}

    def save_heads(self, metrics: dict):
        cfg, acc = self.cfg, self.accelerator
        if not acc.is_main_process:
            return
        classifier: ExitClassifier = self.classifier if self.layerskip else acc.unwrap_model(self.model)
        command = self.command()
        classifier.config.metrics = {
            **metrics, "command": command, "recipe": T.config_to_dict(cfg), "steps": self.step,
            "stopped_by": self.stop_reason,  # "time budget", "SIGTERM"... or None (finished)
            "train_examples": len(self.train_examples),
            "train_tokens": sum(len(e["input_ids"]) for e in self.train_examples),
            "final_loss": self.history[-1]["loss"] if self.history else None,
        }
        notes = f"\nTrained with:\n\n```\n{command}\n```\n"
        if not self.layerskip:
            classifier.save_pretrained(self.heads_dir, self.base, notes=notes)
        else:  # the adapter is merged into the base and saved with the classifier, in one atomic write
            with self.exported_backbone_adapter() as (staging, adapter, merged):
                classifier.config.backbone_adapter, self.base = adapter, merged
                classifier.save_pretrained(self.heads_dir, self.base, notes=notes, base_identity=self.base_identity,
                                           backbone_adapter=staging)
        acc.print(f"classifier saved to {self.heads_dir}; top-1 agreement {metrics['top1_agreement']:.3f} "
                  f"(untrained {metrics['untrained_top1_agreement']:.3f})")


def main(argv: list[str] | None = None) -> dict:
    recipe = EarlyExitRecipe.from_command_line(argv, __doc__.splitlines()[0])
    metrics = recipe.run()
    return {**metrics, "history": recipe.history}


if __name__ == "__main__":
    main()
