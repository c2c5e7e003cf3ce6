"""Self-drafting from a partial forward of the base model: a chain or a dynamic top-k tree, grown depth by depth.

Each depth is one partial forward (the layers the draft keeps) over the frontier nodes, with a tree mask over the
draft nodes already in the cache. Drafting stops early when the draft gets unsure: a node is only expanded while
the product of top-1/top-k probabilities along its path (its *path confidence*) stays above ``threshold``
(Kangaroo / Draft & Verify). The draft's KV goes into the base cache and is cropped back before returning, so
verification sees exactly the cache it was handed. A classifier with an attention adapter keeps its own one-layer
KV the same way: accepted positions from the decode loop's layer-E states, draft nodes appended and cropped back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from decoding.drafter import ContextDrafter, DecodeState
from decoding.tree import DraftTree
from early_exit.adapter import AdapterCache
from early_exit.layer_skip import check_skip_layers
from early_exit.layers import additive_mask, crop_layers, run_layers
from selfspec.runtime.kernels import drafting_with, follow_backend
from selfspec.runtime.layers import decoder_layers, num_decoder_layers

# hidden [1, q, hidden] -> (logits [1, q, v], column -> token id map [v] or None for the identity)
DraftHead = Callable[[torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass(frozen=True)
class DraftPolicy:
    """How big a draft grows.

    Attributes:
        max_depth: longest path drafted (the chain length for a chain).
        top_k: children considered per expanded node (1 = a chain).
        width: nodes kept per depth, best path confidence first (the frontier expanded at the next depth).
        max_nodes: cap on the tree size (verification cost grows with it).
        threshold: stop expanding paths whose confidence falls below it; the best child of the root is always
            drafted, so a step never degenerates below one draft token.
    """

    max_depth: int = 6
    top_k: int = 1
    width: int = 1
    max_nodes: int = 16
    threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.top_k < 1 or self.width < 1 or self.max_nodes < 1:
            raise ValueError(f"draft policy: max_depth, top_k, width and max_nodes must be >= 1, got {self}")
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"draft policy: threshold must be in [0, 1), got {self.threshold}")

    @classmethod
    def chain(cls, length: int = 6, threshold: float = 0.0) -> DraftPolicy:
        return cls(max_depth=length, top_k=1, width=1, max_nodes=length, threshold=threshold)


class PartialForwardDrafter(ContextDrafter):
    """Drafts with base layers ``layer_ids`` and ``head``; the same loop serves early exit and layer skipping."""

    #: it appends its draft to the base model's own KV cache (and crops it back): one sequence per cache
    uses_base_cache = True

    def __init__(self, model, layer_ids: Sequence[int], head: DraftHead, policy: DraftPolicy = DraftPolicy()):
        self.model = model
        self.layer_ids = tuple(layer_ids)
        self.head = head
        self.policy = policy
        #: where ``policy`` came from: "given", or (a saved classifier) "default" / "calibrated for <machine class>"
        #: (``decoding.by_machine``), with " + options" where options overrode part of it
        self.policy_source = "given"
        # Seconds spent in the partial layers and in the head, and draft forwards run: per-instance, for profiling.
        self.timing = {"layers_s": 0.0, "head_s": 0.0, "forwards": 0, "proposals": 0}
        self._linears: list[nn.Linear] | None = None  # the partial layers' linears (found on first use)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> DraftTree | None:
        cache, prefix = state.cache, state.cache_length
        if self._linears is None:
            layers = decoder_layers(self.model)
            self._linears = [m for i in self.layer_ids for m in layers[i].modules() if isinstance(m, nn.Linear)]
        try:
            # the partial layers draft on float16 copies of their weights where the base runs on the skinny kernel
            # (selfspec.runtime.kernels.drafting_with): drafts only propose, verification runs the float32 ones
            with drafting_with(self._linears):
                return self._grow(state, cache, prefix)
        finally:
            # Whatever happened, verification must see the cache exactly as it was handed over.
            crop_layers(cache, self.layer_ids, prefix)

    def _grow(self, state: DecodeState, cache, prefix: int) -> DraftTree:
        policy, device = self.policy, state.sequence.device
        dtype = next(self.model.parameters()).dtype
        # allowed[i, j]: cache slot prefix + j (0 = root, 1 + n = draft node n) is node i's ancestor or itself.
        size = policy.max_nodes + 1
        allowed = torch.zeros(size, size, dtype=torch.bool, device=device)
        allowed[0, 0] = True
        tokens: list[int] = []
        parents: list[int] = []
        confidence: list[float] = []
        # The frontier: slots (0 = root) whose hidden states are computed at this depth; the first is the root.
        frontier_slots = [0]
        frontier_tokens = [state.root]
        level = 0
        self.timing["proposals"] += 1
        while True:
            start = time.perf_counter()
            ids = torch.tensor([frontier_tokens], dtype=torch.long, device=device)
            positions = torch.full_like(ids, prefix + level)
            # The frontier slots are the last ones written, contiguous: the cache holds every drafted node in order.
            written = frontier_slots[-1] + 1
            mask = additive_mask(allowed[frontier_slots][:, :written], prefix, dtype)
            hidden = run_layers(self.model, self.layer_ids, ids, positions, mask, cache)
            mid = time.perf_counter()
            logits, vocab = self._draft_logits(hidden, positions, mask)
            probs = torch.softmax(logits[0].float(), dim=-1)  # [frontier, v]
            top_p, top_i = probs.topk(min(policy.top_k, probs.shape[-1]), dim=-1)
            if vocab is not None:
                top_i = vocab[top_i]
            self.timing["layers_s"] += mid - start
            self.timing["head_s"] += time.perf_counter() - mid
            self.timing["forwards"] += 1
            # Candidate children: (path confidence, parent slot, token), best first.
            base = [1.0 if s == 0 else confidence[s - 1] for s in frontier_slots]
            candidates = sorted(
                ((base[f] * float(p), frontier_slots[f], int(t))
                 for f in range(len(frontier_slots)) for p, t in zip(top_p[f].tolist(), top_i[f].tolist())),
                key=lambda c: -c[0],
            )
            room = policy.max_nodes - len(tokens)
            kept = [c for c in candidates[: min(policy.width, room)] if c[0] >= policy.threshold]
            if not kept and not tokens:
                kept = candidates[:1]
            level += 1
            new_slots = []
            for conf, parent_slot, token in kept:
                slot = len(tokens) + 1
                allowed[slot] = allowed[parent_slot]
                allowed[slot, slot] = True
                tokens.append(token)
                parents.append(parent_slot - 1)
                confidence.append(conf)
                new_slots.append(slot)
            if not new_slots or level >= policy.max_depth or len(tokens) >= policy.max_nodes:
                break
            frontier_slots, frontier_tokens = new_slots, [tokens[s - 1] for s in new_slots]
        return DraftTree(torch.tensor(tokens, dtype=torch.long, device=device),
                         torch.tensor(parents, dtype=torch.long, device=device))

    def _draft_logits(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        """The head on the frontier's hidden states ``[1, q, hidden]``; ``positions`` ``[1, q]`` and the draft
        mask ``[1, 1, q, prefix + written]`` are there for heads that attend to earlier positions."""
        return self.head(hidden)


class EarlyExitDrafter(PartialForwardDrafter):
    """LayerSkip / Kangaroo self-draft: base ``layers[:E]`` then the exit classifier.

    With an attention adapter the drafter asks the decode loop for the layer-E hidden states of accepted tokens
    (``hidden_layers = (E,)``) and keeps the adapter's KV for them; ``begin`` must run before the first
    ``propose`` (the decode loop calls it after prefill).
    """

    def __init__(self, model, classifier, policy: DraftPolicy = DraftPolicy()):
        self.classifier = classifier
        self.adapter_cache = AdapterCache() if classifier.needs_context else None
        self.context_cache, self.context_layer = self.adapter_cache, classifier.exit_layer
        self.hidden_layers = (classifier.exit_layer,) if classifier.needs_context else ()
        self._backend = "stock"
        super().__init__(model, range(classifier.exit_layer), lambda h: classifier.draft_logits(h, model), policy)

    def begin(self, state: DecodeState) -> None:
        # Draft on the kernels the base model was given (selfspec.runtime.kernels).
        self._backend = follow_backend(self.model, lambda: self.classifier.linear_layers(self.model), self._backend)
        super().begin(state)

    def extend_context(self, state: DecodeState, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """The adapter KV of the tokens the last forward added to the base cache (their layer-E states)."""
        self.classifier.extend_cache(self.adapter_cache, hidden, self.model, positions)

    @torch.no_grad()
    def propose(self, state: DecodeState) -> DraftTree | None:
        if self.adapter_cache is None:
            return super().propose(state)
        self.check_context(state)
        try:
            return super().propose(state)
        finally:
            self.adapter_cache.crop(state.cache_length)

    def _draft_logits(self, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
        if self.adapter_cache is None:
            return self.head(hidden)
        # The adapter cache holds the prefix and every draft node written so far, in base-cache slot order, so
        # the base draft mask and positions apply to it unchanged.
        return self.classifier.draft_logits(hidden, self.model, position_ids=positions, attention_mask=mask,
                                            cache=self.adapter_cache)


class LayerSkipDrafter(PartialForwardDrafter):
    """Draft & Verify / SWIFT self-draft: every base layer but ``skip_layers``, then the base norm and LM head."""

    def __init__(self, model, skip_layers: Sequence[int], policy: DraftPolicy = DraftPolicy()):
        total = num_decoder_layers(model)
        check_skip_layers(skip_layers, total)
        self.skip_layers = tuple(sorted(set(skip_layers)))
        head = model.get_output_embeddings()
        super().__init__(model, [i for i in range(total) if i not in self.skip_layers],
                         lambda h: (head(model.model.norm(h)), None), policy)
