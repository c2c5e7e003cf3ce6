"""Train an EAGLE-3 feature drafter on a frozen base model, with training-time test.

    accelerate launch train/eagle.py --config configs/eagle/smollm2-135m.yaml [key=value ...] [--resume]
    python train/eagle.py --config configs/eagle/tiny.yaml optim.max_steps=2
    selfspec train eagle --config configs/eagle/smollm2-135m.yaml optim.max_minutes=60

The base runs once per batch (or once in all, ``cache_hidden_states``) to give the hidden states of the fused layers
and its own next-token distribution. The draft is unrolled ``ttt_steps`` times over every sequence (step ``j``
drafts the token ``j + 2`` ahead, reading its own step ``j - 1`` output: ``eagle.model``), and step ``j``'s loss,
weighted ``step_decay ** j``, is the cross-entropy between the base's distribution (restricted to the draft
vocabulary) and the draft's: self-distillation against the teacher-forced base, not the text. The drafter
(config.json + model.safetensors + README with held-out acceptance per depth) goes to ``heads_dir``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from tqdm.auto import tqdm

from eagle.model import EagleConfig, EagleDraftModel, check_size, default_aux_layers, from_pretrained, save_pretrained
from selfspec import training as T
from selfspec.runtime.identity import base_model_identity
from selfspec.runtime.layers import num_decoder_layers
from selfspec.training.data import collate, frequent_tokens, token_columns


@dataclasses.dataclass
class DraftConfig:
    aux_layers: list[int] | None = None  # base layers fused (output_hidden_states indices); None: EAGLE-3's low/mid/high
    draft_vocab_size: int | None = None  # the N most frequent trained tokens (None: the whole vocabulary); with
    # init_from, a larger N than the saved one extends it (extended_vocab), anything else keeps it
    share_lm_head: bool = True  # base LM-head rows (frozen, not saved); False: a trained draft head (EAGLE-3)
    # the draft layer's MLP width (None: the base's); with init_from, a wider one than the saved drafter's grows it
    # (grow_mlp: the new units start silent, so training starts from exactly what was saved)
    intermediate_size: int | None = None

    def __post_init__(self):
        check_size(self.intermediate_size, "draft.intermediate_size", " (the base's)")
        check_size(self.draft_vocab_size, "draft.draft_vocab_size")


@dataclasses.dataclass
class DecodingDefaults:
    """The drafting policy saved with the drafter (``selfspec generate`` uses it unless told otherwise)."""

    depth: int = 6  # draft steps per verification
    nodes: int = 16  # draft nodes kept per tree
    top_k: int = 4  # children per expanded node
    width: int = 4  # nodes expanded per depth


#: what ``hidden_cache_dtype`` accepts
CACHE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class EagleRecipeConfig:
    model: str = "smollm2-135m-instruct"  # alias, hub id or local path; tiny:<arch> for a tiny random test model
    output_dir: str = "runs/eagle"  # checkpoints, data, metrics.jsonl, logs
    heads_dir: str | None = None  # the final drafter (None: <output_dir>/heads)
    seed: int = 0  # data order and initialisation
    num_threads: int | None = None  # torch CPU threads per process (None: torch's default)
    resume: bool = False  # continue from the latest complete checkpoint (same as --resume)
    ttt_steps: int = 7  # draft steps unrolled in training (training-time test); EAGLE-3 uses 7
    step_decay: float = 0.8  # step j's loss weight is step_decay ** j
    loss: str = "soft"  # soft: cross-entropy to the base's distribution | hard: to the base's argmax
    cache_hidden_states: bool = False  # run the base once over all data and keep its states on disk (else per batch)
    hidden_cache_dir: str | None = None  # where cached states go (None: <output_dir>/data)
    # the dtype the fused layers' cached states are held in memory in (the files stay float32; the teacher's last
    # state stays float32). bfloat16 or float16 save 3/8 of a large cache (4 layers x hidden x 4 bytes a token in
    # float32: ~2.9 GB per 1,000 SmolLM2 conversations). bfloat16 keeps float32's range (SmolLM2's layer-15 residual
    # stream reaches 24,891; float16 ends at 65,504, and an overflow is refused) and, under
    # optim.mixed_precision=bf16, changes nothing: the fc's autocast rounds exactly these inputs to bfloat16 anyway
    hidden_cache_dtype: str = "float32"
    teacher_chunk_size: int = 1024  # positions per full-vocabulary teacher softmax
    # A saved drafter to start from: its fused layers, draft vocabulary and weights are kept (of draft.*, only a
    # draft_vocab_size larger than the saved one extends the vocabulary, and an intermediate_size larger than the
    # saved one widens the MLP); e.g. to go on training a drafter on more data, or with more capacity.
    init_from: str | None = None
    draft: DraftConfig = dataclasses.field(default_factory=DraftConfig)
    decoding: DecodingDefaults = dataclasses.field(default_factory=DecodingDefaults)
    data: T.DataConfig = dataclasses.field(default_factory=T.DataConfig)
    optim: T.OptimConfig = dataclasses.field(default_factory=T.OptimConfig)
    logging: T.LoggingConfig = dataclasses.field(default_factory=lambda: T.LoggingConfig(project="selfspec-eagle"))

    def __post_init__(self):
        if isinstance(self.ttt_steps, bool) or not isinstance(self.ttt_steps, int) or self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be an integer >= 1, got {self.ttt_steps!r}")
        if not 0.0 < self.step_decay <= 1.0:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay!r}")
        if self.loss not in ("soft", "hard"):
            raise ValueError(f"loss must be soft or hard, got {self.loss!r}")
        if self.hidden_cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"hidden_cache_dtype must be one of {', '.join(CACHE_DTYPES)}, "
                             f"got {self.hidden_cache_dtype!r}")
        T.check_init_from(self.init_from, self.heads_dir, self.output_dir)
        if self.teacher_chunk_size < 1:
            raise ValueError(f"teacher_chunk_size must be >= 1, got {self.teacher_chunk_size!r}")


RecipeConfig = EagleRecipeConfig  # the name the config tests look for in every recipe


def extended_vocab(saved: torch.Tensor, examples: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary of ``size`` ids (sorted) that keeps every id of ``saved`` and adds the most frequent trained
    tokens of ``examples`` it lacks: a drafter trained further on data of another kind (code after chat) can then
    propose that data's tokens, and proposes everything it did before."""
    saved = saved.cpu()
    if size == len(saved):
        return saved
    have = set(saved.tolist())
    ranked = [t for t in frequent_tokens(examples, vocab_size, vocab_size).tolist() if t not in have]
    return torch.cat([saved, torch.tensor(ranked[:size - len(saved)], dtype=torch.long)]).sort().values


def grow_mlp(draft: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` (a saved drafter's) with its draft layer's MLP widened to ``draft``'s: every MLP weight whose
    intermediate dimension grew keeps the saved entries first; the new units' input rows (and biases) are ``draft``'s
    fresh initialisation, and their output columns are zero, so the widened layer computes exactly what the saved one
    did and training grows the new units from there (a function-preserving widening, Chen et al.'s Net2Net with
    silent units). Any MLP whose hidden activation is elementwise (SwiGLU, GeGLU, plain) is widened this way.

    Raises:
        ValueError: ``draft``'s MLP is narrower than the saved one (a width can grow, not shrink).
    """
    current = draft.state_dict()
    grown = dict(state)
    for name, saved in state.items():
        if not name.startswith("layer.mlp.") or name not in current or current[name].shape == saved.shape:
            continue
        target = current[name].detach().clone()
        if any(s > t for s, t in zip(saved.shape, target.shape)):
            raise ValueError(f"init_from's {name} is {tuple(saved.shape)}, wider than this drafter's "
                             f"{tuple(target.shape)}: draft.intermediate_size can grow a saved drafter's MLP, not "
                             "shrink it")
        if saved.dim() == 2 and saved.shape[1] < target.shape[1]:  # the output projection: new columns silent
            target[:, saved.shape[1]:] = 0
        target[tuple(slice(0, n) for n in saved.shape)] = saved.to(target.dtype)
        grown[name] = target
    return grown


def load_extended(draft: nn.Module, saved: nn.Module) -> None:
    """Load ``saved``'s weights into ``draft``, whose draft vocabulary may extend the saved one
    (``extended_vocab``) and whose MLP may be wider (``grow_mlp``): a trained draft head keeps the saved rows of
    the ids both have, and the new ids start from the base LM-head rows as a fresh drafter's do."""
    state = grow_mlp(draft, saved.state_dict())
    new_ids = draft.draft_vocab
    if torch.equal(state["draft_vocab"].cpu(), new_ids.cpu()):
        draft.load_state_dict(state)
        return
    old_ids = state.pop("draft_vocab")
    head = state.pop("lm_head.weight", None)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if unexpected or not set(missing) <= {"draft_vocab", "lm_head.weight"}:
        raise ValueError(f"init_from's weights do not fit this drafter: missing {missing}, unexpected {unexpected}")
    if head is not None and draft.lm_head is not None:
        source = token_columns(old_ids, int(max(old_ids.max(), new_ids.max())) + 1)[new_ids.cpu()]
        kept = (source >= 0).nonzero().flatten()
        with torch.no_grad():
            draft.lm_head.weight[kept.to(draft.lm_head.weight.device)] = head[source[kept]].to(draft.lm_head.weight)


def step_positions(batch: dict, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, cols)`` where draft step ``j`` is trained: position ``t`` whose token ``t + j + 2`` is a trained
    (assistant) token; its teacher is the base's prediction at ``t + j + 1``."""
    shift = j + 2
    valid = batch["loss_mask"][:, shift:].bool() & batch["attention_mask"][:, :-shift].bool()
    return valid.nonzero(as_tuple=True)


class EagleRecipe(T.Recipe):
    """The feature drafter on a frozen base; the loop is ``T.Recipe``'s."""

    config_class = EagleRecipeConfig
    script = "train/eagle.py"
    progress_desc = "eagle"

    # ------------------------------------------------------------ setup
    def setup(self):
        cfg = self.cfg
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        self.setup_data()
        base_config = self.base.config
        vocab = base_config.vocab_size
        aux = list(cfg.draft.aux_layers or default_aux_layers(num_decoder_layers(self.base)))
        config = EagleConfig(hidden_size=base_config.hidden_size, vocab_size=vocab,
                             draft_vocab_size=cfg.draft.draft_vocab_size or vocab, aux_layers=aux,
                             share_lm_head=cfg.draft.share_lm_head, base_model=base_model_identity(self.base),
                             decoding=dataclasses.asdict(cfg.decoding),
                             intermediate_size=cfg.draft.intermediate_size)
        torch.manual_seed(cfg.seed)
        draft_vocab = None
        if cfg.init_from is not None:
            saved = from_pretrained(cfg.init_from, self.base, dtype=torch.float32)
            size = max(cfg.draft.draft_vocab_size or 0, saved.config.draft_vocab_size)  # kept, or extended
            if cfg.draft.draft_vocab_size is not None and cfg.draft.draft_vocab_size < size:
                self.accelerator.print(f"eagle: init_from's draft vocabulary of {size} is kept (draft.draft_vocab_size="
                                       f"{cfg.draft.draft_vocab_size}): a vocabulary can be extended, not cut")
            if saved.config.decoding_by_machine:  # trees tuned for the old weights: recalibrate the new ones
                self.accelerator.print(f"eagle: init_from's trees calibrated per kind of machine "
                                       f"({', '.join(sorted(saved.config.decoding_by_machine))}) are dropped: they "
                                       "were chosen for its weights; `selfspec calibrate` the new drafter")
            # a wider MLP than the saved one is grown by load_extended (grow_mlp); a narrower one is refused there
            width = cfg.draft.intermediate_size or saved.config.intermediate_size
            config = dataclasses.replace(saved.config, decoding=config.decoding, base_model=config.base_model,
                                         draft_vocab_size=size, decoding_by_machine={}, intermediate_size=width)
            aux = list(config.aux_layers)
            draft_vocab = extended_vocab(saved.draft_vocab, self.train_examples, size, vocab) if size < vocab else None
        elif config.draft_vocab_size < vocab:
            draft_vocab = frequent_tokens(self.train_examples, config.draft_vocab_size, vocab).sort().values
        draft = EagleDraftModel(config, self.base, draft_vocab).float()
        if cfg.init_from is not None:
            load_extended(draft, saved)
        self.aux_layers = aux
        self.hidden_cache = self._hidden_cache() if cfg.cache_hidden_states else None
        self.teacher_stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # see batch_teacher
        self._use_draft_vocab(draft)
        self.setup_optimizer(draft)
        self.setup_run()
        trainable, total = T.count_parameters(draft)
        tokens = sum(len(e["input_ids"]) for e in self.train_examples)
        self.accelerator.print(f"eagle: {len(self.train_examples)} train / {len(self.eval_examples)} eval examples "
                               f"({tokens:,} tokens), {self.total_steps} steps, {self.accelerator.num_processes} "
                               f"processes, {trainable:,} trainable parameters, layers {aux}, "
                               f"{cfg.ttt_steps} TTT steps")

    def _use_draft_vocab(self, draft: EagleDraftModel) -> None:
        """Everything derived from ``draft.draft_vocab``: the shared LM-head rows, the token -> draft column map
        and the teacher's draft rows. Again after a checkpoint is loaded, whose vocabulary wins over the one just
        counted on (possibly changed, ``--allow-changed data.*``) data."""
        draft.refresh_shared()
        self.to_draft = token_columns(draft.draft_vocab, draft.config.vocab_size)
        self._draft_head = None

    def after_resume(self):
        self._use_draft_vocab(self.accelerator.unwrap_model(self.model))

    def _hidden_cache(self) -> dict[int, list[torch.Tensor]]:
        directory = self.cfg.hidden_cache_dir or self.output_dir / "data"
        return T.cached_hidden_states(self.base, self.train_examples, self.aux_layers + [-1], directory,
                                      pad_id=self.pad_id, accelerator=self.accelerator,
                                      dtype={layer: CACHE_DTYPES[self.cfg.hidden_cache_dtype]
                                             for layer in self.aux_layers},
                                      progress=lambda it: tqdm(it, desc="caching hidden states"))

    # ------------------------------------------------------------ batches and loss
    def features(self, batch: dict, indices: list[int] | None = None) -> dict[int, torch.Tensor]:
        """``{layer: [b, s, hidden]}`` for the fused layers and ``-1`` (the teacher's last hidden state)."""
        layers = self.aux_layers + [-1]
        if self.hidden_cache is not None and indices is not None:
            b, s = batch["input_ids"].shape
            out = {}
            for layer in layers:
                states = torch.zeros(b, s, self.base.config.hidden_size)
                for row, i in enumerate(indices):
                    stored = self.hidden_cache[layer][i]
                    states[row, :len(stored)] = stored
                out[layer] = states.to(batch["input_ids"].device)
            return out
        return {k: v.float() for k, v in T.hidden_states(self.base, batch["input_ids"], batch["attention_mask"],
                                                        layers).items()}

    def make_batch(self, indices: list[int]) -> dict:
        device = self.accelerator.device
        batch = {k: v.to(device) for k, v in super().make_batch(indices).items()}
        batch["features"] = self.features(batch, indices)
        batch["teacher_probs"], batch["teacher_argmax"] = self.batch_teacher(batch, indices)
        return batch

    def batch_teacher(self, batch: dict, indices: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The base's distribution at every position a step is trained against, computed once per batch:
        ``(probabilities over the draft columns [b, s, draft_vocab], argmax token id [b, s])`` (zero elsewhere).

        With ``indices`` (training examples) and a reduced draft vocabulary, each example's per-position
        log-normaliser and argmax over the full vocabulary are kept after the first batch it is in
        (``self.teacher_stats``, 8 bytes a token, per process): for an example seen before, the teacher multiplies
        the draft vocabulary's rows of the LM head only, ``exp(logit - logsumexp)``, the same probabilities at a
        sixth of the cost here (8,192 of 49,152 rows); the other rows of the batch take the full softmax."""
        b, s = batch["input_ids"].shape
        device = batch["input_ids"].device
        wanted = torch.zeros(b, s, dtype=torch.bool, device=device)
        wanted[:, 1:] = batch["loss_mask"][:, 1:].bool() & batch["attention_mask"][:, :-1].bool()
        wanted = torch.roll(wanted, -1, dims=1)  # position t predicts token t + 1
        wanted[:, -1] = False
        draft = self.accelerator.unwrap_model(self.model)
        probs = torch.zeros(b, s, draft.config.draft_vocab_size, device=device)
        argmax = torch.zeros(b, s, dtype=torch.long, device=device)
        stats = self.teacher_stats
        keep = indices is not None and draft.config.draft_vocab_size < draft.config.vocab_size
        known = torch.tensor([keep and i in stats for i in (indices or [None] * b)], dtype=torch.bool, device=device)
        if known.any():
            lse = torch.zeros(b, s, device=device)
            for row in known.nonzero().flatten().tolist():
                lse_i, argmax_i = stats[indices[row]]
                lse[row, :len(lse_i)], argmax[row, :len(argmax_i)] = lse_i.to(device), argmax_i.to(device)
            rows, cols = (wanted & known[:, None]).nonzero(as_tuple=True)
            probs[rows, cols] = self.draft_teacher(batch["features"][-1][rows, cols], lse[rows, cols])
        if (~known).any():
            rows, cols = (wanted & ~known[:, None]).nonzero(as_tuple=True)
            p, a, norm = self.teacher(batch["features"][-1][rows, cols], with_lse=True)
            probs[rows, cols], argmax[rows, cols] = p, a
            if keep:
                lse = torch.zeros(b, s, device=device)
                lse[rows, cols] = norm
                for row in (~known).nonzero().flatten().tolist():
                    n = len(self.train_examples[indices[row]]["input_ids"])
                    stats[indices[row]] = (lse[row, :n].cpu().clone(), argmax[row, :n].to(torch.int32).cpu())
        return probs, argmax

    def counts(self, batch: dict) -> torch.Tensor:
        return torch.tensor([float(len(step_positions(batch, j)[0])) for j in range(self.cfg.ttt_steps)])

    @torch.no_grad()
    def teacher(self, last: torch.Tensor, with_lse: bool = False) -> tuple[torch.Tensor, ...]:
        """The base's distribution for last hidden states ``[n, hidden]``: ``(probabilities over the draft columns
        [n, draft_vocab], argmax token id [n])`` and, ``with_lse``, the log-normaliser over the full vocabulary [n];
        in chunks of ``teacher_chunk_size`` rows."""
        head = self.base.get_output_embeddings()
        draft = self.accelerator.unwrap_model(self.model)
        probs, argmax, lse = [], [], []
        for start in range(0, last.shape[0], self.cfg.teacher_chunk_size):
            logits = head(last[start:start + self.cfg.teacher_chunk_size].to(head.weight.dtype)).float()
            argmax.append(logits.argmax(-1))
            norm = torch.logsumexp(logits, dim=-1)
            lse.append(norm)
            probs.append(torch.exp(logits[:, draft.draft_vocab] - norm[:, None]))
        if not probs:
            empty = (torch.zeros(0, draft.config.draft_vocab_size, device=last.device),
                     torch.zeros(0, dtype=torch.long, device=last.device), torch.zeros(0, device=last.device))
            return empty if with_lse else empty[:2]
        out = (torch.cat(probs), torch.cat(argmax), torch.cat(lse))
        return out if with_lse else out[:2]

    @torch.no_grad()
    def draft_teacher(self, last: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """The base's probabilities over the draft columns ``[n, draft_vocab]`` given each row's full-vocabulary
        log-normaliser ``lse [n]``: only the draft vocabulary's rows of the LM head are multiplied."""
        head = self.base.get_output_embeddings()
        draft = self.accelerator.unwrap_model(self.model)
        if self._draft_head is None:
            self._draft_head = (head.weight[draft.draft_vocab].detach(),
                                None if head.bias is None else head.bias[draft.draft_vocab].detach())
        weight, bias = self._draft_head
        probs = []
        for start in range(0, last.shape[0], self.cfg.teacher_chunk_size):
            rows = slice(start, start + self.cfg.teacher_chunk_size)
            logits = torch.nn.functional.linear(last[rows].to(weight.dtype), weight, bias).float()
            probs.append(torch.exp(logits - lse[rows, None]))
        if not probs:
            return torch.zeros(0, draft.config.draft_vocab_size, device=last.device)
        return torch.cat(probs)

    def loss(self, batch: dict, denominators: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        draft = self.accelerator.unwrap_model(self.model)
        feats = batch["features"]
        outputs = self.model([feats[i] for i in self.aux_layers], batch["input_ids"], batch["attention_mask"],
                             cfg.ttt_steps)
        terms, total = [], torch.zeros(())
        for j, out in enumerate(outputs):
            rows, cols = step_positions(batch, j)
            log_q = torch.log_softmax(draft.logits(out[rows, cols]).float(), dim=-1)
            probs, argmax = batch["teacher_probs"][rows, cols + j + 1], batch["teacher_argmax"][rows, cols + j + 1]
            if cfg.loss == "soft":
                term = -(probs * log_q).sum()
            else:
                columns = self.to_draft.to(argmax.device)[argmax]
                keep = columns >= 0
                term = -log_q[keep].gather(1, columns[keep, None]).sum()
            term = term / denominators[j]
            terms.append(term.detach())
            total = total + cfg.step_decay ** j * term
        return total, torch.stack(terms)

    def step_record(self, terms: torch.Tensor) -> dict:
        return {f"step{j}_loss": terms[j].item() for j in range(len(terms))}

    # ------------------------------------------------------------ evaluate and save
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out, teacher-forced: per depth, how often the draft's top-1 is the base's own top-1, and the mean
        accepted length of a chain (consecutive depths right from the first)."""
        draft = self.accelerator.unwrap_model(self.model)
        draft.eval()
        steps = self.cfg.ttt_steps
        hits, totals = torch.zeros(steps), torch.zeros(steps)
        chain_sum, chain_n = 0.0, 0
        for start in range(0, len(self.eval_examples), self.cfg.optim.batch_size):
            batch = collate(self.eval_examples[start:start + self.cfg.optim.batch_size], self.pad_id)
            batch = {k: v.to(self.accelerator.device) for k, v in batch.items()}
            feats = self.features(batch)
            outputs = draft([feats[i] for i in self.aux_layers], batch["input_ids"], batch["attention_mask"], steps)
            b, s = batch["input_ids"].shape
            right = torch.zeros(steps, b, s, dtype=torch.bool, device=self.accelerator.device)
            counted = torch.zeros_like(right)
            for j, out in enumerate(outputs):
                rows, cols = step_positions(batch, j)
                guess = draft.draft_vocab[draft.logits(out[rows, cols]).argmax(-1)]
                _, argmax = self.teacher(feats[-1][rows, cols + j + 1])
                ok = guess == argmax
                hits[j] += ok.sum().cpu()
                totals[j] += len(ok)
                right[j, rows, cols] = ok
                counted[j, rows, cols] = True
            # Chains from positions where the first step is trained: accepted length = leading run of right steps.
            start_rows, start_cols = step_positions(batch, 0)
            run = torch.ones(len(start_rows), dtype=torch.bool, device=right.device)
            length = torch.zeros(len(start_rows), device=right.device)
            for j in range(steps):
                run &= right[j, start_rows, start_cols] & counted[j, start_rows, start_cols]
                length += run.float()
            chain_sum += float(length.sum())
            chain_n += len(start_rows)
        accuracy = (hits / totals.clamp(min=1)).tolist()
        return {"accuracy": accuracy, "chain_accept_length": chain_sum / max(1, chain_n),
                "eval_targets": totals.long().tolist()}

    def save_heads(self, metrics: dict):
        cfg, acc = self.cfg, self.accelerator
        if not acc.is_main_process:
            return
        draft = acc.unwrap_model(self.model)
        draft.config.accuracy = metrics["accuracy"]
        draft.config.training = {
            "command": self.command(),
            "recipe": T.config_to_dict(cfg),
            "metrics": {"accuracy": metrics["accuracy"], "chain_accept_length": metrics["chain_accept_length"],
                        "eval_targets": metrics["eval_targets"], "train_examples": len(self.train_examples),
                        "train_tokens": sum(len(e["input_ids"]) for e in self.train_examples),
                        "steps": self.step, "total_steps": self.total_steps, "processes": acc.num_processes,
                        "stopped_by_time_budget": self.stop_reason == T.TIME_BUDGET,
                        "stopped_by": self.stop_reason,  # "time budget", "SIGTERM"... or None (finished)
                        "final_loss": self.history[-1]["loss"] if self.history else None},
        }
        save_pretrained(draft, self.heads_dir)
        acc.print(f"drafter saved to {self.heads_dir}; held-out top-1 per depth: "
                  f"{[round(a, 3) for a in metrics['accuracy']]}, chain accept length "
                  f"{metrics['chain_accept_length']:.2f}")

    def tracked_eval(self, metrics: dict) -> dict:
        return {f"eval/top1_depth{j + 1}": a for j, a in enumerate(metrics["accuracy"])}


def main(argv: list[str] | None = None) -> dict:
    return EagleRecipe.from_command_line(argv, __doc__.splitlines()[0]).run()


if __name__ == "__main__":
    main()
