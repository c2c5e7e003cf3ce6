"""The prompt-lookup drafter: what followed the earlier occurrences of the sequence's longest repeated suffix.

Prompt lookup (Saxena, 2023; HF ``prompt_lookup_num_tokens``) proposes one fixed-length chain: the continuation of the
latest earlier occurrence of the last n-gram, n <= 3. Two things it leaves on the table, both measured on the greedy
answers of MT-bench questions 1-40 (docs/RESULTS.md, "Drafts without a model"):

- **How much to propose depends on how long the match is.** A one-token match is a weak hint; a 10-token match (a
  quoted passage, a code block being rewritten, a small model repeating itself) is usually followed by exactly what
  followed it before. The chain is ``tokens_per_match`` tokens per matched token, up to ``num_tokens``: long where
  the evidence is long, and on a verification cost curve that is flat up to ~16 tokens the long drafts are almost
  free.
- **Several earlier occurrences disagree.** The continuations of the ``num_candidates`` latest occurrences of the
  longest match are counted into a tree (``lookup.tree.count_tree``): the ``nodes`` paths most of them share.

The default budget is 6 nodes. 15 were chosen where a 16-token verification cost about what 8 did (float32
weights, memory-bound steps); on weights streamed as their exact GGUF grid a step is bound by the multiply-adds from a
few tokens on (8 tokens ~1.5x one token on a 2-core Xeon), and 8 nodes decoded MT-bench 1-40 at 1.60x against 1.42x
for 15 (docs/RESULTS.md, "Exact grids"). Once the whole decoder stack ran as one call (a plain step 9.5 -> 7.4 ms,
the extra tokens costing what they did), a replay of MT-bench 1-40 against the new curve put 6 nodes first (1.66x
predicted; 8: 1.61x, 4: 1.61x, a budget of 2-4 nodes per matched token 1.64-1.65x; docs/RESULTS.md, "One call for
the whole stack"). On a Zen 5 a budget of 2 nodes per matched token (``nodes_per_match``) then won as the
feature drafter's guard and alone, and became the default: a 1-token match proposes 2 nodes, 2 tokens 4, longer
matches 6. ``lookup[nodes=15,nodes_per_match=none]`` restores the first tree, ``lookup[nodes_per_match=none]`` the
last one.
"""

from __future__ import annotations

import numpy as np
import torch

from decoding.drafter import DecodeState, DrafterBase
from decoding.tree import DraftTree
from lookup.tree import count_tree


def suffix_matches(sequence: np.ndarray, max_ngram: int) -> np.ndarray:
    """``matches[j]`` for every ``j < len(sequence) - 1``: how many tokens ending at ``j`` equal the sequence's last
    tokens (the common suffix of ``sequence[:j + 1]`` and ``sequence``), at most ``max_ngram``."""
    length = sequence.size
    matches = np.zeros(max(length - 1, 0), dtype=np.int64)
    if length < 2:
        return matches
    ends = np.flatnonzero(sequence[:-1] == sequence[-1])
    n = 1
    while ends.size:
        matches[ends] = n
        if n == max_ngram:
            break
        ends = ends[ends >= n]  # an occurrence must have a token n positions before its end
        ends = ends[sequence[ends - n] == sequence[length - 1 - n]]
        n += 1
    return matches


def latest_occurrences(sequence: torch.Tensor | np.ndarray, max_ngram: int, min_ngram: int) -> tuple[int, np.ndarray]:
    """``(n, ends)``: the longest ``n`` (``min_ngram <= n <= max_ngram``) for which the sequence's last ``n`` tokens
    occurred earlier, and the end positions of those occurrences, most recent first; ``(0, [])`` when none did."""
    tokens = sequence.detach().cpu().numpy() if isinstance(sequence, torch.Tensor) else sequence
    matches = suffix_matches(tokens, max_ngram)
    best = int(matches.max()) if matches.size else 0
    if best < min_ngram:
        return 0, np.zeros(0, dtype=np.int64)
    return best, np.flatnonzero(matches == best)[::-1]


def lookup_continuations(sequence: torch.Tensor, max_ngram: int, min_ngram: int, num_tokens: int,
                         num_candidates: int = 1) -> list[torch.Tensor]:
    """Up to ``num_candidates`` distinct continuations (``num_tokens`` tokens at most each) of the latest earlier
    occurrences of ``sequence``'s last n-gram, most recent first, for the longest ``n`` (``max_ngram`` down to
    ``min_ngram``) that occurred before; empty when none did."""
    n, ends = latest_occurrences(sequence, max_ngram, min_ngram)
    found, seen = [], set()
    for end in ends.tolist():
        tokens = sequence[end + 1:end + 1 + num_tokens]
        key = tuple(tokens.tolist())
        if key not in seen:
            seen.add(key)
            found.append(tokens)
            if len(found) == num_candidates:
                break
    return found


def lookup_continuation(sequence: torch.Tensor, max_ngram: int, min_ngram: int, num_tokens: int) -> torch.Tensor | None:
    """Up to ``num_tokens`` tokens that followed the latest earlier occurrence of ``sequence``'s last n-gram
    (``n`` from ``max_ngram`` down to ``min_ngram``), or ``None`` when no suffix occurred before."""
    found = lookup_continuations(sequence, max_ngram, min_ngram, num_tokens)
    return found[0] if found else None


class LookupDrafter(DrafterBase):
    """Proposes what followed the latest earlier occurrences of the sequence's longest repeated suffix, as a tree.

    Args:
        max_ngram: longest suffix matched (longer matches are more reliable; it also caps the draft length below).
        min_ngram: shortest suffix that counts as a match.
        num_tokens: deepest draft.
        num_candidates: how many of the latest occurrences of the longest match are read.
        nodes: node budget of the tree (``None``: every distinct continuation in full).
        tokens_per_match: draft depth per matched token (depth ``min(num_tokens, tokens_per_match * n)`` for an
            ``n``-token match); ``None`` always drafts ``num_tokens``.
        nodes_per_match: node budget per matched token (``min(nodes, nodes_per_match * n)``): a weak match proposes
            fewer nodes, where verifying them costs more than they are likely to return; ``None``: ``nodes``. The
            default 2 was chosen on MT-bench 1-40 on a 2-core Zen 5 (as lookup, else the feature drafter: 2.21x
            against 2.09x with no per-match budget, twice; 1 node a token 1.97x) and held on 41-80 (2.36x against
            2.25x; lookup alone 1.99x against 1.82x); on a 2-core Xeon it had replayed even (docs/RESULTS.md).

    ``LookupDrafter(max_ngram=3, num_tokens=4, num_candidates=1, nodes=None, tokens_per_match=None,
    nodes_per_match=None)`` is classic prompt lookup (one chain of 4).

    Raises:
        ValueError: sizes below 1, or ``min_ngram > max_ngram``.
    """

    #: what it drafts with, as a benchmark records it (``selfspec.bench.methods.drafter_settings``)
    SETTINGS = ("max_ngram", "min_ngram", "num_tokens", "num_candidates", "nodes", "tokens_per_match", "nodes_per_match")

    def __init__(self, max_ngram: int = 32, min_ngram: int = 1, num_tokens: int = 15, num_candidates: int = 8,
                 nodes: int | None = 6, tokens_per_match: int | None = 4, nodes_per_match: int | None = 2):
        for name, value in (("max_ngram", max_ngram), ("min_ngram", min_ngram), ("num_tokens", num_tokens),
                            ("num_candidates", num_candidates), ("nodes", nodes),
                            ("tokens_per_match", tokens_per_match), ("nodes_per_match", nodes_per_match)):
            if value is None and name in ("nodes", "tokens_per_match", "nodes_per_match"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LookupDrafter {name} must be an integer >= 1, got {value!r}")
        if min_ngram > max_ngram:
            raise ValueError(f"LookupDrafter min_ngram ({min_ngram}) exceeds max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram, self.num_tokens = max_ngram, min_ngram, num_tokens
        self.num_candidates, self.nodes, self.tokens_per_match = num_candidates, nodes, tokens_per_match
        self.nodes_per_match = nodes_per_match

    def propose(self, state: DecodeState) -> DraftTree | None:
        tokens = state.sequence[0].detach().cpu().numpy()
        n, ends = latest_occurrences(tokens, self.max_ngram, self.min_ngram)
        if not n:
            return None
        depth = self.num_tokens if self.tokens_per_match is None else min(self.num_tokens, self.tokens_per_match * n)
        continuations = [tokens[end + 1:end + 1 + depth].tolist() for end in ends[:self.num_candidates].tolist()]
        nodes = self.nodes if self.nodes is not None else depth * len(continuations)
        if self.nodes_per_match is not None:
            nodes = min(nodes, self.nodes_per_match * n)
        return count_tree(continuations, nodes)


#: the options ``make_lookup_drafter`` accepts; ``none`` turns off those that can be unbounded
_OPTIONS = LookupDrafter.SETTINGS


def make_lookup_drafter(model, heads_dir=None, **options) -> LookupDrafter:
    """Registry factory: ``--draft lookup`` (options as ``LookupDrafter``'s; ``nodes=none``,
    ``tokens_per_match=none`` and ``nodes_per_match=none`` lift those limits).

    Raises:
        ValueError: a heads directory (lookup has none), or an unknown option.
    """
    if heads_dir is not None:
        raise ValueError("the lookup drafter has no heads; drop --heads (or combine it: --draft medusa+lookup)")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"unknown lookup drafter option(s) {unknown}; known: {sorted(_OPTIONS)}")
    return LookupDrafter(**{k: None if str(v).lower() == "none" else int(v) for k, v in options.items()})
