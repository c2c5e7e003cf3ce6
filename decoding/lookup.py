"""Training-free drafts from the text itself, and drafters combined into one tree.

``LookupDrafter`` is prompt lookup decoding (n-gram lookup): when the last ``n`` tokens already occurred earlier in
the sequence (prompt or answer so far), the tokens that followed that occurrence are proposed as a chain. It costs
a few microseconds per step and no model, and it is right often exactly where model-based drafts are weak:
copied names, code, quoted text, and the repetitions small models make.

``combine(a, b, ...)`` runs several drafters every step and merges their trees into one (identical paths are
shared, so a token both propose is verified once). ``medusa+lookup`` on the command line is
``combine(medusa, lookup)``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .drafter import DecodeState, Drafter, DrafterBase, register_drafter
from .tree import DraftTree


class LookupDrafter(DrafterBase):
    """Proposes the continuation of the most recent earlier occurrence of the sequence's last n-gram.

    Args:
        max_ngram: longest suffix tried first (longer matches are more reliable).
        min_ngram: shortest suffix tried.
        num_tokens: length of each proposed chain.
        num_candidates: continuations of that many distinct earlier occurrences (most recent first), merged into
            one tree; 1 proposes a single chain.

    Raises:
        ValueError: sizes below 1, or ``min_ngram > max_ngram``.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_tokens: int = 4, num_candidates: int = 1):
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram), ("num_tokens", num_tokens),
                            ("num_candidates", num_candidates)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LookupDrafter {name} must be an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"LookupDrafter min_ngram ({min_ngram}) exceeds max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens
        self.num_candidates = num_candidates

    def propose(self, state: DecodeState) -> DraftTree | None:
        found = lookup_continuations(state.sequence[0], self.max_ngram, self.min_ngram, self.num_tokens,
                                     self.num_candidates)
        return merge_trees([DraftTree.chain(tokens) for tokens in found])


def lookup_continuations(sequence: torch.Tensor, max_ngram: int, min_ngram: int, num_tokens: int,
                         num_candidates: int = 1) -> list[torch.Tensor]:
    """Up to ``num_candidates`` distinct continuations (``num_tokens`` tokens at most each) of the latest earlier
    occurrences of ``sequence``'s last n-gram, most recent first, for the longest ``n`` (``max_ngram`` down to
    ``min_ngram``) that occurred before; empty when none did."""
    length = sequence.numel()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = sequence[:-1].unfold(0, n, 1)  # [length - n, n]: every n-gram that has a next token
        hits = (windows == sequence[-n:]).all(dim=1).nonzero().flatten()
        if not hits.numel():
            continue
        found, seen = [], set()
        for hit in reversed(hits.tolist()):  # the most recent occurrence first: its continuation is the likeliest
            tokens = sequence[hit + n:hit + n + num_tokens]
            key = tuple(tokens.tolist())
            if key not in seen:
                seen.add(key)
                found.append(tokens)
                if len(found) == num_candidates:
                    break
        return found
    return []


def lookup_continuation(sequence: torch.Tensor, max_ngram: int, min_ngram: int, num_tokens: int) -> torch.Tensor | None:
    """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of ``sequence``'s last n-gram
    (``n`` from ``max_ngram`` down to ``min_ngram``), or ``None`` when no suffix occurred before."""
    found = lookup_continuations(sequence, max_ngram, min_ngram, num_tokens)
    return found[0] if found else None


class CombinedDrafter:
    """Several drafters proposing into one tree every step (see ``merge_trees``).

    Raises:
        ValueError: no drafters, or drafters that propose from different vocabularies.
    """

    def __init__(self, drafters: Sequence[Drafter]):
        if not drafters:
            raise ValueError("combine() needs at least one drafter")
        vocabularies = {getattr(d, "vocab_size", None) for d in drafters} - {None}
        if len(vocabularies) > 1:
            raise ValueError(f"combined drafters propose from different vocabularies: {sorted(vocabularies)}")
        self.drafters = list(drafters)
        self.vocab_size = next(iter(vocabularies), None)
        self.hidden_layers = tuple(dict.fromkeys(layer for d in drafters for layer in getattr(d, "hidden_layers", ())))

    def begin(self, state: DecodeState) -> None:
        for d in self.drafters:
            d.begin(state)

    def propose(self, state: DecodeState) -> DraftTree | None:
        return merge_trees([d.propose(state) for d in self.drafters])

    def observe(self, state: DecodeState) -> None:
        for d in self.drafters:
            d.observe(state)


def combine(*drafters: Drafter) -> CombinedDrafter:
    """One drafter whose tree is the union of ``drafters``' trees."""
    return CombinedDrafter(drafters)


def merge_trees(trees: Sequence[DraftTree | None]) -> DraftTree | None:
    """The union of draft trees under one root: a node of a later tree that repeats an existing path (same
    parent, same token) is merged into it. Trees with per-node draft probabilities cannot be merged, because a
    shared node would have two draft distributions.

    Raises:
        ValueError: a tree carries ``draft_probs``.
    """
    trees = [t for t in trees if t is not None and len(t)]
    if not trees:
        return None
    if len(trees) == 1:
        return trees[0]
    if any(t.draft_probs is not None for t in trees):
        raise ValueError("trees with draft probabilities (sampled drafts) cannot be merged; combine only "
                         "deterministic (top-k) drafters")
    index: dict[tuple[int, int], int] = {}  # (parent in the merged tree, token) -> merged node
    tokens: list[int] = []
    parents: list[int] = []
    for tree in trees:
        mapped: list[int] = []
        for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
            key = (mapped[parent] if parent >= 0 else -1, token)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(key[0])
            mapped.append(index[key])
    return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


@register_drafter("lookup")
def make_lookup_drafter(model, heads_dir=None, **options) -> LookupDrafter:
    """Registry factory: ``--draft lookup`` (options ``max_ngram``, ``min_ngram``, ``num_tokens``,
    ``num_candidates``).

    Raises:
        ValueError: a heads directory (lookup has none), or an unknown option.
    """
    if heads_dir is not None:
        raise ValueError("the lookup drafter has no heads; drop --heads (or combine it: --draft medusa+lookup)")
    known = {"max_ngram", "min_ngram", "num_tokens", "num_candidates"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown lookup drafter option(s) {unknown}; known: {sorted(known)}")
    return LookupDrafter(**{k: int(v) for k, v in options.items()})
