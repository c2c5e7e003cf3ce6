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


class SequentialBeam:
    """Dynamic trees for sequential heads (EAGLE-2's expansion, Li et al. 2024): grow the tree depth by depth from
    the ``width`` most probable paths, then keep the ``size`` most probable nodes of everything grown.

    A node's score is the sum of its path's draft log-probabilities, each from the head of its depth run on its
    own parent's state, so it estimates the probability that the whole path is accepted. Depth 1 takes the first
    head's ``top_k`` tokens; each later depth runs the next head on the ``width`` best nodes of the depth above (one
    batched step) and gives each ``top_k`` children. A child never scores above its parent (plus a tiny per-depth
    penalty for ties), so the kept nodes always form a tree. Per step this costs ``depth`` small head steps of at
    most ``width`` rows; no Python loop runs over nodes.

    Raises:
        ValueError: ``depth``, ``size``, ``width`` or ``top_k`` below 1.
    """

    def __init__(self, depth: int, size: int, width: int = 4, top_k: int = 4):
        for name, value in (("depth", depth), ("size", size), ("width", width), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dynamic sequential tree: {name} must be an integer >= 1, got {value!r}")
        self.depth, self.size, self.width, self.top_k = depth, size, width, top_k

    def _expand(self, heads, states: torch.Tensor, tokens: torch.Tensor, level: int, k: int):
        """Head ``level`` on ``states`` ``[rows, hidden]`` reading ``tokens`` ``[rows]``: its output states and the
        top-``k`` ``(log_probs, draft indices)`` ``[rows, k]`` of each row."""
        out = heads.step(states, tokens, level)
        logits, _ = heads.head_draft_logits(out, level)  # columns map to tokens through heads.draft_vocab
        top = logits.float().log_softmax(-1).topk(k, dim=-1)
        return out, top.values.double(), top.indices

    def draft(self, heads, start: torch.Tensor, root: int) -> DraftTree:
        """The tree below ``root`` from the start state ``[1, hidden]`` (``h_t``, or prefix attention's ``p_t``)."""
        device = start.device
        vocab = heads.draft_vocab
        k0 = min(self.top_k if self.depth > 1 else self.size, self.size)
        states, scores, index = self._expand(heads, start, torch.tensor([root], device=device), 0, k0)
        node_scores, node_ids, node_parents = [scores[0].cpu()], [index[0]], [torch.full((k0,), -1)]
        frontier_scores, frontier = scores[0].cpu(), torch.arange(k0)  # global node ids
        parent_rows = torch.zeros(k0, dtype=torch.long)  # row of ``states`` that produced each frontier node
        count = k0
        for level in range(1, self.depth):
            keep = frontier_scores.topk(min(self.width, len(frontier))).indices
            frontier, parent_rows = frontier[keep], parent_rows[keep]
            tokens = torch.cat(node_ids)[frontier.to(device)]
            tokens = tokens if vocab is None else vocab[tokens]
            states, scores, index = self._expand(heads, states[parent_rows.to(device)], tokens, level, self.top_k)
            rows = len(frontier)
            child_scores = (torch.cat(node_scores)[frontier][:, None] + scores.cpu()).reshape(-1)
            node_scores.append(child_scores)
            node_ids.append(index.reshape(-1))
            node_parents.append(frontier.repeat_interleave(self.top_k))
            frontier_scores = child_scores
            frontier = torch.arange(count, count + rows * self.top_k)
            parent_rows = torch.arange(rows).repeat_interleave(self.top_k)
            count += rows * self.top_k
        depth = torch.cat([torch.full((len(s),), d + 1) for d, s in enumerate(node_scores)])
        score = torch.cat(node_scores).clamp_min(_MIN_LOG_PROB) - depth.double() * _DEPTH_TIE_BREAK
        keep = score.topk(min(self.size, count)).indices.sort().values  # global order: parents before children
        new_index = torch.full((count,), -1, dtype=torch.long)
        new_index[keep] = torch.arange(len(keep))
        old_parents = torch.cat(node_parents)[keep]
        parents = torch.where(old_parents >= 0, new_index[old_parents.clamp_min(0)], old_parents)
        ids = torch.cat(node_ids)[keep.to(device)]
        return DraftTree(ids if vocab is None else vocab[ids], parents)
