"""Drafting with the EAGLE-3 feature drafter: EAGLE-2 dynamic trees (or a static tree) grown on the draft's own KV.

After every verification the decode loop hands over the base hidden states of the accepted tokens (the layers the
drafter lists in ``hidden_layers``); the drafter appends their entries to its own KV cache (each verified position
with the token that follows it, which is known by then) and keeps the last position's output ``o_{c-1}``, whose
logits rank the candidates for the first draft token.

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

from decoding.drafter import DecodeState, DrafterBase
from decoding.tree import DraftTree, TreeTemplate
from eagle.export import load_drafter
from eagle.model import DraftCache, EagleDraftModel
from selfspec.runtime.attention import follow_attention
from selfspec.runtime.kernels import follow_backend

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
    """

    depth: int = 6
    nodes: int = 16
    top_k: int = 4
    width: int = 4
    tree: tuple[tuple[int, ...], ...] | None = None
    threshold: float = 0.0

    def __post_init__(self):
        for name in ("depth", "nodes", "top_k", "width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"eagle drafter: {name} must be an integer >= 1, got {value!r}")
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"eagle drafter: threshold must be in [0, 1), got {self.threshold!r}")


class EagleDrafter(DrafterBase):
    """Proposes trees from an :class:`EagleDraftModel` (see the module docstring)."""

    def __init__(self, model, draft: EagleDraftModel, policy: EaglePolicy = EaglePolicy()):
        self.model, self.draft, self.policy = model, draft, policy
        self.hidden_layers = tuple(draft.config.aux_layers)
        self.cache = DraftCache()
        self.last: torch.Tensor | None = None  # [1, 1, hidden]: the draft output at the last verified position
        self.template = TreeTemplate(policy.tree) if policy.tree is not None else None
        self._backend = "stock"

    # ------------------------------------------------------------ context
    def begin(self, state: DecodeState) -> None:
        # Draft on the kernels the base model was given (selfspec.runtime.kernels), with the attention it was given:
        # the draft layer's config is a copy of the base's from when the drafter was built, which may predate
        # set_linear_backend (the skinny attention kernel is also what lets a draft step run as one call).
        self._backend = follow_backend(self.model, self.draft.linear_layers, self._backend)
        follow_attention(self.model, self.draft.layer.self_attn.config)
        self.cache.reset()
        self.last = None
        self._extend(state)

    def observe(self, state: DecodeState) -> None:
        self._extend(state)

    @torch.no_grad()
    def _extend(self, state: DecodeState) -> None:
        """Raises: RuntimeError: hidden states missing, or the draft cache out of step with the base cache."""
        missing = [layer for layer in self.hidden_layers if layer not in state.hidden]
        if missing:
            raise RuntimeError(f"eagle drafter needs the base hidden states of layers {missing} (DecodeState.hidden); "
                               "run it through decoding.generate")
        aux = [state.hidden[layer] for layer in self.hidden_layers]
        start, new = self.cache.length, aux[0].shape[1]
        if start + new != state.cache_length:
            raise RuntimeError(f"eagle drafter cache out of step: {start} + {new} new positions, but the base cache "
                               f"holds {state.cache_length}; call begin(state) after the prefill")
        if new == 0:
            return
        device = aux[0].device
        next_ids = state.sequence[:, start + 1:start + new + 1].to(device)  # each position's next token
        positions = torch.arange(start, start + new, device=device)[None]
        mask = None
        if new > 1:  # query i sees the earlier positions and itself
            keys = torch.arange(start + new, device=device)
            mask = (keys[None, :] <= positions[0, :, None])[None, None]
        dtype = next(self.draft.parameters()).dtype
        out = self.draft.step(self.draft.fuse([a.to(dtype) for a in aux]), next_ids, positions, mask, self.cache)
        self.last = out[:, -1:]

    # ------------------------------------------------------------ drafting
    @torch.no_grad()
    def propose(self, state: DecodeState) -> DraftTree | None:
        prefix = state.cache_length
        if self.last is None or self.cache.length != prefix:
            raise RuntimeError(f"eagle drafter cache holds {self.cache.length} positions, the base cache {prefix}: "
                               "call begin(state) after the prefill (decoding.generate does)")
        try:
            return self._grow(prefix)
        finally:
            self.cache.crop(prefix)

    def _log_probs(self, out: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.draft.logits(out).float(), dim=-1)

    def _grow(self, prefix: int) -> DraftTree:
        policy, device = self.policy, self.last.device
        vocab = self.draft.draft_vocab
        if self.template is not None:
            return self._grow_static(prefix)
        depth, nodes, top_k, width = policy.depth, policy.nodes, policy.top_k, policy.width
        k0 = min(top_k if depth > 1 else nodes, nodes, vocab.numel())
        top = self._log_probs(self.last[0]).topk(k0, dim=-1)  # [1, k0]
        scores = [top.values[0].double().cpu()]
        columns = [top.indices[0]]
        parents = [torch.full((k0,), -1, dtype=torch.long)]
        frontier = torch.arange(k0)  # global node ids of the last level
        frontier_scores = scores[0]
        count = k0
        slot_of: dict[int, int] = {}
        states_of: dict[int, torch.Tensor] = {}
        ancestors = torch.zeros(depth * width, depth * width, dtype=torch.bool, device=device)
        written = 0
        log_threshold = math.log(policy.threshold) if policy.threshold > 0 else -math.inf
        for level in range(1, depth):
            if float(frontier_scores.max()) < log_threshold:
                break
            keep = frontier_scores.topk(min(width, len(frontier))).indices
            expand = frontier[keep]  # global ids
            rows = len(expand)
            tokens = vocab[torch.cat(columns)[expand.to(device)]]
            out, written = self._expand(prefix, level, expand.tolist(), torch.cat(parents)[expand].tolist(), tokens,
                                        slot_of, states_of, ancestors, written)
            top = self._log_probs(out[0]).topk(min(top_k, vocab.numel()), dim=-1)  # [rows, k]
            child_scores = (torch.cat(scores)[expand][:, None] + top.values.double().cpu()).reshape(-1)
            k = top.values.shape[1]
            scores.append(child_scores)
            columns.append(top.indices.reshape(-1))
            parents.append(expand.repeat_interleave(k))
            frontier = torch.arange(count, count + rows * k)
            frontier_scores = child_scores
            count += rows * k
        level_of = torch.cat([torch.full((len(s),), d + 1) for d, s in enumerate(scores)])
        score = torch.cat(scores).clamp_min(_MIN_LOG_PROB) - level_of.double() * _DEPTH_TIE_BREAK
        keep = score.topk(min(nodes, count)).indices.sort().values  # parents before children
        new_index = torch.full((count,), -1, dtype=torch.long)
        new_index[keep] = torch.arange(len(keep))
        old_parents = torch.cat(parents)[keep]
        tree_parents = torch.where(old_parents >= 0, new_index[old_parents.clamp_min(0)], old_parents)
        ids = vocab[torch.cat(columns)[keep.to(device)]]
        return DraftTree(ids.cpu(), tree_parents)

    def _expand(self, prefix: int, level: int, nodes: list[int], parents: list[int], tokens: torch.Tensor,
                slot_of: dict[int, int], states_of: dict[int, torch.Tensor], ancestors: torch.Tensor,
                written: int) -> tuple[torch.Tensor, int]:
        """One draft step over ``nodes`` (their ``tokens``, children of ``parents``, -1 = the root) at depth
        ``level``: each reads its parent's output and sees the verified prefix plus its own ancestors' entries.
        Records each node's KV slot and output; returns the outputs ``[1, rows, hidden]`` and the slots written."""
        device, rows = self.last.device, len(nodes)
        for r, (node, parent) in enumerate(zip(nodes, parents)):
            slot = written + r
            if parent >= 0:
                ancestors[slot] = ancestors[slot_of[parent]]
            ancestors[slot, slot] = True
            slot_of[node] = slot
        written += rows
        mask = torch.cat([torch.ones(rows, prefix, dtype=torch.bool, device=device),
                          ancestors[written - rows:written, :written]], dim=1)
        hidden = torch.cat([self.last[0] if p < 0 else states_of[p] for p in parents])[None]
        positions = torch.full((1, rows), prefix + level - 1, dtype=torch.long, device=device)
        out = self.draft.step(hidden, tokens[None], positions, mask[None, None], self.cache)
        for r, node in enumerate(nodes):
            states_of[node] = out[0, r:r + 1]
        return out, written

    def _grow_static(self, prefix: int) -> DraftTree:
        """A static tree: node ``i`` holds the rank-``template.rank[i]`` child of its parent."""
        template, device = self.template, self.last.device
        vocab = self.draft.draft_vocab
        n = len(template)
        parents = template.parents.tolist()
        ranks = template.rank.tolist()
        depths = template.depth.tolist()
        tokens = torch.zeros(n, dtype=torch.long)
        # ranked[i + 1]: the ranked candidate columns below node i (0: below the root)
        ranked: dict[int, torch.Tensor] = {0: self._log_probs(self.last[0])[0].topk(template.max_rank).indices}
        has_children = {p for p in parents if p >= 0}
        slot_of: dict[int, int] = {}
        states_of: dict[int, torch.Tensor] = {}
        written = 0
        ancestors = torch.zeros(n, n, dtype=torch.bool, device=device)
        for level in range(1, template.max_depth + 1):
            level_nodes = [i for i in range(n) if depths[i] == level]
            for i in level_nodes:
                tokens[i] = vocab[ranked[parents[i] + 1][ranks[i]]]
            expand = [i for i in level_nodes if i in has_children]
            if not expand:
                break
            out, written = self._expand(prefix, level, expand, [parents[i] for i in expand], tokens[expand].to(device),
                                        slot_of, states_of, ancestors, written)
            top = self._log_probs(out[0]).topk(template.max_rank, dim=-1).indices
            for r, i in enumerate(expand):
                ranked[i + 1] = top[r]
        return template.with_tokens(tokens)


def load(model, heads_dir: str | Path, *, policy: EaglePolicy | None = None, **options) -> EagleDrafter:
    """The drafter saved in ``heads_dir`` on ``model``; ``options`` override the saved default policy."""
    draft = load_drafter(heads_dir, model)  # selfspec's own directory, or a speculators / SGLang export
    settings = {**(draft.config.decoding or {}), **options}
    if "tree" in settings and settings["tree"] is not None:
        settings["tree"] = tuple(tuple(int(r) for r in c) for c in settings["tree"])
    return EagleDrafter(model, draft, policy or EaglePolicy(**settings))


def make_eagle_drafter(model, heads_dir: str | Path | None = None, **options) -> EagleDrafter:
    """Registry factory: ``selfspec generate --draft eagle --heads DIR`` (options: ``depth``, ``nodes``,
    ``top_k``, ``width``, ``tree``, ``threshold``).

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


__all__ = ["EagleDrafter", "EaglePolicy", "load", "make_eagle_drafter"]
