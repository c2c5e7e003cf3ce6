"""Drafting with the EAGLE-3 feature drafter: EAGLE-2 dynamic trees (or a static tree) grown on the draft's own KV.

After every verification the decode loop hands over the base hidden states of the accepted tokens (the layers the
drafter lists in ``hidden_layers``); the drafter appends their entries to its own KV cache (each verified position
with the token that follows it, which is known by then) and keeps the last position's output ``o_{c-1}``, whose
logits rank the candidates for the first draft token. It does so lazily: ``observe`` only queues the accepted
positions, and the next ``propose`` runs them through the draft layer in one pass. Decoding alone, that is the same
work moved by a few microseconds; as the fallback of prompt lookup (``lookup|eagle``), the steps lookup drafts cost
the drafter nothing, and the positions they accepted are caught up together the next time it drafts.

A dynamic tree (Li et al., EAGLE-2) grows depth by depth: the ``width`` nodes with the highest path score (the sum
of the draft log-probabilities along the path) are expanded by one batched draft step, each into its ``top_k``
best children; after ``depth`` levels the ``nodes`` highest-scoring nodes of everything grown are kept. A child
never scores above its parent, so the kept nodes always form a tree. A static tree (Medusa's choices format) takes,
for every node, the child of the rank its path names. Draft nodes write their KV entries behind the verified ones
and are cropped before the tree is returned: verification sees the base cache untouched, and the draft cache holds
exactly the verified positions between steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from decoding import by_machine
from decoding.drafter import DecodeState, DrafterBase
from decoding.tree import DraftTree, TreeTemplate
from eagle.export import load_drafter
from eagle.model import DraftCache, EagleDraftModel
from selfspec.runtime.attention import follow_attention
from selfspec.runtime.kernels import check_draft_weights, follow_backend, using_draft_weights

_DEPTH_TIE_BREAK = 1e-6  # per-depth score penalty: orders exact ties parent-first
_MIN_LOG_PROB = -1e4


@dataclass(frozen=True)
class EaglePolicy:
    """How a draft tree is grown.

    Attributes:
        depth: longest path (draft steps per verification; the first comes free with the context update).
        nodes: draft nodes kept (the verified tree has ``nodes + 1`` tokens).
        top_k: children drafted per expanded node.
        width: nodes expanded per depth (the best path scores).
        tree: a static tree in Medusa's choices format instead of a dynamic one (``depth``, ``nodes``, ``top_k``
            and ``width`` are then ignored).
        threshold: stop growing once no frontier path is more likely than this (0: never).
        min_prob: keep only nodes whose path is at least this likely under the draft (the product of the draft
            probabilities from the root), at most ``nodes`` of them; a step where no node qualifies verifies the root
            alone (0: no cut, the ``nodes`` best). Nodes below it are not expanded, and growth stops once no
            frontier path reaches it. On a machine where every verified node costs time (a CPU: ``selfspec cost``),
            a node the draft itself doubts may cost more than it is expected to return, while a confident draft may
            still run ``depth`` deep: the tree's size follows the draft's confidence step by step (OPT-Tree's point,
            Wang et al. 2024). The draft's probabilities are calibrated enough for this (``scripts/
            draft_calibration.py``); on a 2-core Xeon it bought nothing over a fixed 4 nodes (docs/RESULTS.md).
            Dynamic trees only.
        draft_weights: what this drafter's own layers read on the skinny backend (``float16``, ``float32``,
            ``q8_0``, ``q4_1``; ``selfspec.runtime.kernels.set_draft_weights``), over the process-wide choice; None
            (default): the process-wide choice. Like the tree, a per-machine choice (``selfspec calibrate --grid
            "... draft_weights=float16,q4_1"``): it may change what is accepted, never what is output.
    """

    depth: int = 6
    nodes: int = 16
    top_k: int = 4
    width: int = 4
    tree: tuple[tuple[int, ...], ...] | None = None
    threshold: float = 0.0
    min_prob: float = 0.0
    draft_weights: str | None = None

    def __post_init__(self):
        check_draft_weights(self.draft_weights, "eagle drafter")
        for name in ("depth", "nodes", "top_k", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"eagle drafter: {name} must be an integer >= 1, got {value!r}")
        for name in ("threshold", "min_prob"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"eagle drafter: {name} must be a number in [0, 1), got {value!r}")
        if self.tree is not None and self.min_prob > 0:
            raise ValueError("eagle drafter: min_prob prunes a dynamic tree, but a static tree is set (tree=..., "
                             "given or saved with the drafter): a static tree keeps its shape. Drop min_prob, or "
                             "pass tree=null to grow a dynamic tree instead.")


class EagleDrafter(DrafterBase):
    """Proposes trees from an :class:`EagleDraftModel` (see the module docstring)."""

    def __init__(self, model, draft: EagleDraftModel, policy: EaglePolicy = EaglePolicy()):
        self.model, self.draft, self.policy = model, draft, policy
        self.hidden_layers = tuple(draft.config.aux_layers)
        self.cache = DraftCache()
        self.last: torch.Tensor | None = None  # [1, 1, hidden]: the draft output at the last verified position
        self.pending: list[list[torch.Tensor]] = []  # per observed step, its hidden_layers states not yet drafted on
        self.template = TreeTemplate(policy.tree) if policy.tree is not None else None
        #: where ``policy`` came from: "given", or (``load``) "default" / "calibrated for <machine class>", with
        #: " + options" where options overrode part of it
        self.policy_source = "given"
        self._backend = "stock"
        #: the last proposed tree's path log-probabilities under the draft, in node order (None: a static tree, or
        #: nothing proposed yet); ``scripts/draft_calibration.py`` compares them with what verification accepted
        self.path_log_probs: list[float] | None = None

    # ------------------------------------------------------------ context
    def begin(self, state: DecodeState) -> None:
        with using_draft_weights(self.policy.draft_weights):
            self._begin(state)

    def _begin(self, state: DecodeState) -> None:
        # Draft on the kernels the base model was given (selfspec.runtime.kernels), with the attention it was given:
        # the draft layer's config is a copy of the base's from when the drafter was built, which may predate
        # set_linear_backend (the skinny attention kernel is also what lets a draft step run as one call).
        self._backend = follow_backend(self.model, self.draft.linear_layers, self._backend)
        follow_attention(self.model, self.draft.layer.self_attn.config)
        self.cache.reset()
        self.last = None
        self.pending = []
        self.path_log_probs = None
        self._queue(state)

    def observe(self, state: DecodeState) -> None:
        self._queue(state)

    def _queue(self, state: DecodeState) -> None:
        """Raises: RuntimeError: hidden states missing, or the draft cache out of step with the base cache."""
        missing = [layer for layer in self.hidden_layers if layer not in state.hidden]
        if missing:
            raise RuntimeError(f"eagle drafter needs the base hidden states of layers {missing} (DecodeState.hidden); "
                               "run it through decoding.generate")
        aux = [state.hidden[layer] for layer in self.hidden_layers]
        known = self.cache.length + sum(queued[0].shape[1] for queued in self.pending)
        if known + aux[0].shape[1] != state.cache_length:
            raise RuntimeError(f"eagle drafter cache out of step: {known} + {aux[0].shape[1]} new positions, but the "
                               f"base cache holds {state.cache_length}; call begin(state) after the prefill")
        if aux[0].shape[1]:
            self.pending.append(aux)

    @torch.no_grad()
    def _extend(self, state: DecodeState) -> None:
        """Run the queued positions through the draft layer (one pass), appending their entries to the draft cache."""
        if not self.pending:
            return
        queued, self.pending = self.pending, []
        aux = queued[0] if len(queued) == 1 else [torch.cat(parts, dim=1) for parts in zip(*queued)]
        start, new = self.cache.length, aux[0].shape[1]
        device = aux[0].device
        next_ids = state.sequence[:, start + 1:start + new + 1].to(device)  # each position's next token
        positions = torch.arange(start, start + new, device=device)[None]
        mask = None
        if new > 1:  # query i sees the earlier positions and itself
            keys = torch.arange(start + new, device=device)
            mask = (keys[None, :] <= positions[0, :, None])[None, None]
        dtype = self.draft.fc.weight.dtype
        out = self.draft.step(self.draft.fuse([a.to(dtype) for a in aux]), next_ids, positions, mask, self.cache)
        self.last = out[:, -1:]

    # ------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, state: DecodeState) -> DraftTree | None:
        with using_draft_weights(self.policy.draft_weights):
            return self._propose(state)

    def _propose(self, state: DecodeState) -> DraftTree | None:
        prefix = state.cache_length
        self._extend(state)
        if self.last is None or self.cache.length != prefix:
            raise RuntimeError(f"eagle drafter cache holds {self.cache.length} positions, the base cache {prefix}: "
                               "call begin(state) after the prefill (decoding.generate does)")
        try:
            return self._grow(prefix)
        finally:
            self.cache.crop(prefix)

    def _top(self, out: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
        """The ``k`` best draft columns below each output row ``out`` ``[rows, hidden]`` and their log-probabilities,
        as Python lists (the tree is grown on a few dozen numbers: list arithmetic costs less than tensor ops)."""
        values, columns = self.draft.top(out, k)
        return values.tolist(), columns.tolist()

    def _grow(self, prefix: int) -> DraftTree:
        policy = self.policy
        if self.template is not None:
            return self._grow_static(prefix)
        depth, nodes, top_k, width = policy.depth, policy.nodes, policy.top_k, policy.width
        k0 = min(top_k if depth > 1 else nodes, nodes, self.draft.draft_vocab.numel())
        values, columns = self._top(self.last[0], k0)
        # every grown node: its path score (summed draft log-probabilities), draft column, parent (-1: the root)
        # and depth; node ids are list positions, parents before children
        scores, columns = values[0], columns[0]
        parents, levels = [-1] * len(scores), [1] * len(scores)
        frontier = list(range(len(scores)))  # the last level's nodes
        grown = _Grown()
        log_keep = math.log(policy.min_prob) if policy.min_prob > 0 else -math.inf
        # below min_prob nothing is kept, so nothing below it is worth growing either
        log_threshold = max(math.log(policy.threshold) if policy.threshold > 0 else -math.inf, log_keep)
        out = None
        for level in range(1, depth):
            frontier_scores = [scores[i] for i in frontier]
            if max(frontier_scores) < log_threshold:
                break
            # the ``width`` best paths, best first (ties: the earlier node)
            best = sorted(range(len(frontier)), key=frontier_scores.__getitem__, reverse=True)[:width]
            best = [j for j in best if frontier_scores[j] >= log_keep]
            expand = [frontier[j] for j in best]
            out = self._expand(prefix, level, expand, [parents[i] for i in expand], [columns[i] for i in expand],
                               grown, out)
            values, children = self._top(out[0], top_k)
            frontier = []
            for node, row_values, row_columns in zip(expand, values, children):
                base = scores[node]
                for value, column in zip(row_values, row_columns):
                    frontier.append(len(scores))
                    scores.append(base + value)
                    columns.append(column)
                    parents.append(node)
                    levels.append(level + 1)
        ranked = [max(score, _MIN_LOG_PROB) - level * _DEPTH_TIE_BREAK for score, level in zip(scores, levels)]
        # a child never scores above its parent: the kept nodes (the best ``nodes``, then those likely enough) are
        # a tree whatever the cut
        top = sorted(range(len(ranked)), key=ranked.__getitem__, reverse=True)[:nodes]
        keep = sorted(i for i in top if scores[i] >= log_keep)  # parents first
        self.path_log_probs = [scores[i] for i in keep]
        if not keep:
            return DraftTree.empty()
        new_index = {old: new for new, old in enumerate(keep)}
        vocab = self.draft.draft_vocab
        ids = vocab[torch.tensor([columns[i] for i in keep], device=vocab.device)]
        # every kept node's parent is kept (see above): a missing one would be a bug, not a child of the root
        return DraftTree(ids.cpu(), torch.tensor([new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                                                 dtype=torch.long))

    def _expand(self, prefix: int, level: int, nodes: list[int], parents: list[int], columns: list[int],
                grown: "_Grown", previous: torch.Tensor | None) -> torch.Tensor:
        """One draft step over ``nodes`` (draft ``columns``, children of ``parents``; -1 = the root) at depth
        ``level``: each reads its parent's output (the root's: ``self.last``; any other: its row of the step that
        drafted it, ``previous`` ``[1, rows, hidden]``) and sees the verified prefix plus its own ancestors' entries.
        Returns the outputs ``[1, rows, hidden]``; ``grown`` records each node's KV slot, output row and ancestors."""
        device, rows = self.last.device, len(nodes)
        written = grown.written
        visible = []  # per node: which of the draft entries written so far (and its own) it sees
        for node, parent in zip(nodes, parents):
            seen = list(grown.sees[parent]) if parent >= 0 else []
            seen.append(written + len(visible))
            visible.append(seen)
            grown.sees[node] = seen
        grown.written = end = written + rows
        mask = torch.ones(1, 1, rows, prefix + end, dtype=torch.bool, device=device)
        draft_part = torch.zeros(rows, end, dtype=torch.bool)
        for r, seen in enumerate(visible):
            draft_part[r, seen] = True
        mask[0, 0, :, prefix:] = draft_part
        if parents[0] < 0:  # the first level: every parent is the root
            hidden = self.last[0].expand(rows, -1)[None]
        else:
            index = torch.tensor([grown.row[p] for p in parents], device=device)
            hidden = previous.index_select(1, index)
        for r, node in enumerate(nodes):
            grown.row[node] = r
        vocab = self.draft.draft_vocab
        tokens = vocab[torch.tensor(columns, device=vocab.device)].to(device)
        positions = torch.full((1, rows), prefix + level - 1, dtype=torch.long, device=device)
        return self.draft.step(hidden.contiguous(), tokens[None], positions, mask, self.cache)

    def _grow_static(self, prefix: int) -> DraftTree:
        """A static tree: node ``i`` holds the rank-``template.rank[i]`` child of its parent."""
        template = self.template
        vocab = self.draft.draft_vocab
        n = len(template)
        self.path_log_probs = None
        parents = template.parents.tolist()
        ranks = template.rank.tolist()
        depths = template.depth.tolist()
        columns = [0] * n
        # ranked[i + 1]: the ranked candidate columns below node i (0: below the root)
        ranked: dict[int, list[int]] = {0: self._top(self.last[0], template.max_rank)[1][0]}
        has_children = {p for p in parents if p >= 0}
        grown = _Grown()
        out = None
        for level in range(1, template.max_depth + 1):
            level_nodes = [i for i in range(n) if depths[i] == level]
            for i in level_nodes:
                columns[i] = ranked[parents[i] + 1][ranks[i]]
            expand = [i for i in level_nodes if i in has_children]
            if not expand:
                break
            out = self._expand(prefix, level, expand, [parents[i] for i in expand], [columns[i] for i in expand],
                               grown, out)
            below = self._top(out[0], template.max_rank)[1]
            for r, i in enumerate(expand):
                ranked[i + 1] = below[r]
        return template.with_tokens(vocab[torch.tensor(columns, device=vocab.device)].cpu())


class _Grown:
    """A growing tree's draft entries: how many are written behind the verified prefix, which of them each expanded
    node sees (its ancestors' and its own, by slot), and each node's row in the step that expanded it."""

    __slots__ = ("written", "sees", "row")

    def __init__(self):
        self.written = 0
        self.sees: dict[int, list[int]] = {}
        self.row: dict[int, int] = {}


def saved_policy(config, device: torch.device | str | None = None) -> tuple[dict, str]:
    """``(options, source)``: the drafting a saved drafter asks for on a machine like this one (``device``: where
    the base model runs): its ``decoding_by_machine`` entry for this machine's class where there is one
    (``selfspec.runtime.kernels.machine_class``), else its default ``decoding``; ``source`` says which."""
    options, where, source = by_machine.saved_for(config.policy_for, device)
    unknown = sorted(set(options) - set(EaglePolicy.__dataclass_fields__))
    if unknown:
        raise ValueError(f"eagle drafter config: {where} names unknown option(s) {unknown} (known: "
                         f"{sorted(EaglePolicy.__dataclass_fields__)}); fix the entry in config.json or recalibrate "
                         "with `selfspec calibrate`")
    return options, source


def load(model, heads_dir: str | Path, *, policy: EaglePolicy | None = None, **options) -> EagleDrafter:
    """The drafter saved in ``heads_dir`` on ``model``; ``options`` override the saved policy (``saved_policy``:
    the one calibrated for this kind of machine, else the default)."""
    draft = load_drafter(heads_dir, model)  # selfspec's own directory, or a speculators / SGLang export
    saved, source = saved_policy(draft.config, next(model.parameters()).device)
    settings = {**saved, **options}
    if "tree" in settings and settings["tree"] is not None:
        settings["tree"] = tuple(tuple(int(r) for r in c) for c in settings["tree"])
    drafter = EagleDrafter(model, draft, policy or EaglePolicy(**settings))
    if policy is None:
        drafter.policy_source = source + " + options" * bool(options)
    return drafter


def make_eagle_drafter(model, heads_dir: str | Path | None = None, **options) -> EagleDrafter:
    """Registry factory: ``selfspec generate --draft eagle --heads DIR`` (options: ``depth``, ``nodes``,
    ``top_k``, ``width``, ``tree``, ``threshold``, ``min_prob``, ``draft_weights``).

    Raises:
        ValueError: no heads directory, or an unknown option.
    """
    if heads_dir is None:
        raise ValueError("the eagle drafter needs a trained drafter directory (--heads DIR); train one with "
                         "`selfspec train eagle --config configs/eagle/smollm2-135m.yaml`")
    known = {f for f in EaglePolicy.__dataclass_fields__}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown eagle drafter option(s) {unknown}; known: {sorted(known)}")
    return load(model, heads_dir, **options)


__all__ = ["EagleDrafter", "EaglePolicy", "load", "make_eagle_drafter", "saved_policy"]
