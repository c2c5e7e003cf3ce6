"""Per-step tree selection: keep the ``size`` nodes of a larger static tree that the heads are most sure of.

A static tree spends its nodes where the heads are right *on average*; at a given step the heads' own softmax
says where they are right *now* (EAGLE-2's observation, applied to Medusa heads). A node's score is the product of
its path's draft probabilities. A child's score never exceeds its parent's, so the top ``size`` nodes always form
a tree; a tiny per-depth penalty breaks the ties of probability-1 drafts the same way, in favour of the parent.
Everything is a tensor operation over the pool: no Python loop over nodes.
"""

from __future__ import annotations

import torch

from decoding.tree import DraftTree, TreeTemplate

# Score penalty per depth, in log-probability: far below any real difference, large enough to order exact ties.
_DEPTH_TIE_BREAK = 1e-6
_MIN_LOG_PROB = -1e4


class DynamicTreeSelector:
    """Chooses ``size`` nodes of ``pool`` every step from the heads' top-k log-probabilities.

    Raises:
        ValueError: ``size`` below 1 or larger than the pool.
    """

    def __init__(self, pool: TreeTemplate, size: int):
        if not 1 <= size <= len(pool):
            raise ValueError(f"dynamic tree size must be between 1 and the pool's {len(pool)} nodes, got {size}")
        self.pool, self.size = pool, size
        shape = pool.fill(torch.zeros(pool.max_depth, pool.max_rank, dtype=torch.long))
        self._mask = shape.ancestor_mask  # [n + 1, n + 1], root at 0
        # [n, n]: row i sums the log-probabilities of i and its ancestors.
        self._path_sum = shape.ancestor_mask[1:, 1:].double()
        self._penalty = pool.depth.double() * _DEPTH_TIE_BREAK

    def select(self, candidates: torch.Tensor, log_probs: torch.Tensor) -> DraftTree:
        """``candidates`` / ``log_probs`` ``[max_depth, max_rank]``: token ids and their draft log-probabilities."""
        pool = self.pool
        # Clamped so that impossible drafts (-inf) still order parent before child.
        node_logp = log_probs[pool.depth - 1, pool.rank].double().cpu().clamp_min(_MIN_LOG_PROB)  # [n]
        score = self._path_sum @ node_logp - self._penalty
        keep = score.topk(self.size).indices.sort().values  # sorted: parents stay before children
        new_index = torch.full((len(pool),), -1, dtype=torch.long)
        new_index[keep] = torch.arange(self.size)
        old_parents = pool.parents[keep]
        parents = torch.where(old_parents >= 0, new_index[old_parents.clamp_min(0)], old_parents)
        tokens = candidates[pool.depth[keep] - 1, pool.rank[keep]]
        tree = DraftTree(tokens, parents)
        # Derive the structure from the pool's instead of the per-node loops DraftTree would run.
        rows = torch.cat([torch.zeros(1, dtype=torch.long), keep + 1])
        depth = pool.depth[keep]
        tree.__dict__.update(ancestor_mask=self._mask[rows][:, rows], depth=depth, max_depth=int(depth.max()),
                             _parents_list=parents.tolist())
        return tree
