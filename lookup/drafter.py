"""The prompt-lookup drafter: the continuation of the latest earlier occurrence of the sequence's last n-gram."""

from __future__ import annotations

import torch

from decoding.combine import merge_trees
from decoding.drafter import DecodeState, DrafterBase
from decoding.tree import DraftTree


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
