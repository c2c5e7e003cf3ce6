"""Static draft trees for Medusa heads, in Medusa's choices format, grown greedily from per-head accuracies.

A node is a path of top-k ranks ``(r_1, ..., r_d)``: the rank-``r_1`` candidate of head 0, then the rank-``r_2``
candidate of head 1 below it, ... Treating the heads as independent, the node is accepted with probability
``prod_i head_accuracy[i][r_i]``, and the expected number of accepted draft tokens of a tree is the sum of these
over its nodes. Adding nodes in decreasing order of that product (always a child of a node already in the tree,
so every prefix is present) gives, for every size, the tree that maximises this estimate (Medusa, section 3.3.1).
"""

from __future__ import annotations

import heapq
from typing import Sequence

#: Top-1 accuracy of Medusa's Vicuna-7B heads (Medusa paper, Fig. 3): the prior when no accuracy was measured.
PRIOR_TOP1 = (0.56, 0.32, 0.20, 0.15, 0.12)
#: Prior ratio between the rank-(r+1) and rank-r accuracy of a head (and between head k+1 and head k beyond the
#: five above): a rough geometric fall-off, small enough that a head's accuracies sum to at most 1 (0.56 / 0.6).
PRIOR_DECAY = 0.4
#: Ranks considered per head when the accuracies are the prior.
PRIOR_TOP_K = 10
#: Tree sizes (draft nodes) worth offering on a CPU, where verifying 16 nodes costs ~1.3x one token and 64 ~2.5x.
TREE_SIZES = (8, 16, 32)
DEFAULT_TREE_SIZE = 16


def prior_accuracy(num_heads: int, top_k: int = PRIOR_TOP_K) -> list[list[float]]:
    """``[num_heads][top_k]`` assumed (non-cumulative) accuracies, for heads that have not been measured."""
    top1 = [PRIOR_TOP1[k] if k < len(PRIOR_TOP1) else PRIOR_TOP1[-1] * PRIOR_DECAY ** (k - len(PRIOR_TOP1) + 1)
            for k in range(num_heads)]
    return [[p * PRIOR_DECAY**r for r in range(top_k)] for p in top1]


def default_tree(head_accuracy: Sequence[Sequence[float]] | None, size: int = DEFAULT_TREE_SIZE, *,
                 num_heads: int | None = None) -> list[list[int]]:
    """The ``size``-node tree with the highest expected accepted length under ``head_accuracy``.

    Args:
        head_accuracy: ``[num_heads][top_k]`` measured accuracies (``MedusaConfig.head_accuracy``), or ``None`` for
            the prior (``prior_accuracy``).
        size: number of draft nodes (the root excluded).
        num_heads: limit the depth to the first heads (default: every head in ``head_accuracy``; 4 for the prior).

    Returns:
        Choices in breadth-first order (by depth, then by ranks), every prefix included.

    Raises:
        ValueError: ``size < 1``, no heads, or fewer candidates in all heads together than ``size``.
    """
    if size < 1:
        raise ValueError(f"tree size must be >= 1, got {size}")
    if head_accuracy is None:
        head_accuracy = prior_accuracy(num_heads or 4)
    depth = len(head_accuracy) if num_heads is None else min(num_heads, len(head_accuracy))
    if depth < 1 or not head_accuracy[0]:
        raise ValueError("default_tree needs the accuracy of at least one head")
    # Max-heap of candidate nodes by acceptance probability; ties go to the shallower, lower-rank path.
    frontier = [(-float(p), (r,)) for r, p in enumerate(head_accuracy[0])]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < size:
        neg_p, path = heapq.heappop(frontier)
        chosen.append(path)
        if len(path) < depth:
            for r, p in enumerate(head_accuracy[len(path)]):
                heapq.heappush(frontier, (neg_p * float(p), path + (r,)))
    if len(chosen) < size:
        raise ValueError(f"the heads' candidates allow a tree of at most {len(chosen)} nodes, not {size}")
    return [list(path) for path in sorted(chosen, key=lambda path: (len(path), path))]


def expected_accept_length(choices: Sequence[Sequence[int]], head_accuracy: Sequence[Sequence[float]]) -> float:
    """Expected accepted draft tokens per step of tree ``choices`` (the bonus token excluded), heads independent.

    Raises:
        ValueError: a choice is deeper than the heads or ranks beyond the measured top-k.
    """
    total = 0.0
    for path in choices:
        if len(path) > len(head_accuracy) or any(r >= len(head_accuracy[d]) for d, r in enumerate(path)):
            raise ValueError(f"tree choice {list(path)} needs accuracies the heads do not have")
        p = 1.0
        for d, r in enumerate(path):
            p *= head_accuracy[d][r]
        total += p
    return total
