"""Draft trees from counted continuations: the tree that model-free drafters (prompt lookup, a datastore) propose.

Several earlier occurrences of the same context continue in different ways. Counted into a trie, each node's share of
the occurrences that pass through its parent estimates the probability of its token given the path above it, and the
product along the path estimates the probability that verification reaches the node. The tree keeps the ``nodes``
best nodes by that estimate, best first (a parent always scores at least its children, so a kept node's parent is
kept), which is the node budget spent where it buys the most expected accepted tokens (SuffixDecoding's
frequency-scored speculation trees; EAGLE-2's dynamic trees do the same with a drafter's confidences).
"""

from __future__ import annotations

import heapq
from typing import Iterable, Sequence

import torch

from decoding.tree import DraftTree


def count_tree(continuations: Iterable[Sequence[int]], nodes: int, *, min_score: float = 0.0,
               stop_token: int | None = None) -> DraftTree | None:
    """The ``nodes`` likeliest nodes of the trie of ``continuations`` (each a token sequence after the root), or
    ``None`` when nothing scores above ``min_score``.

    A node's score is the fraction of all continuations that start with its path. Ties go to the node first seen
    (continuations given most relevant first: the most recent occurrence wins a tie). A continuation ends early at
    ``stop_token`` (a separator between documents), exclusive.

    Raises:
        ValueError: ``nodes`` below 1.
    """
    if nodes < 1:
        raise ValueError(f"count_tree: nodes must be >= 1, got {nodes}")
    children: list[dict[int, int]] = [{}]  # trie node -> {token: trie node}; trie node 0 is the root
    counts, tokens, parents = [0], [-1], [-1]
    for continuation in continuations:
        node = 0
        counts[0] += 1
        for token in continuation:
            token = int(token)
            if token == stop_token:
                break
            child = children[node].get(token)
            if child is None:
                child = children[node][token] = len(tokens)
                children.append({})
                counts.append(0)
                tokens.append(token)
                parents.append(node)
            node = child
            counts[node] += 1
    if counts[0] == 0:
        return None
    total = counts[0]
    # best first by score; the trie index breaks ties (lower = seen first)
    frontier = [(-counts[c] / total, c) for c in children[0].values()]
    heapq.heapify(frontier)
    kept: dict[int, int] = {}  # trie node -> draft-tree node
    while frontier and len(kept) < nodes:
        negative_score, node = heapq.heappop(frontier)
        if -negative_score <= min_score:
            break
        kept[node] = len(kept)
        for child in children[node].values():
            heapq.heappush(frontier, (-counts[child] / total, child))
    if not kept:
        return None
    order = list(kept)
    return DraftTree(torch.tensor([tokens[n] for n in order], dtype=torch.long),
                     torch.tensor([kept[parents[n]] if parents[n] != 0 else -1 for n in order], dtype=torch.long))
