"""Draft trees: the token tree a drafter proposes and the base model verifies in one forward pass.

Node 0 of the verification input is the *root*: the last accepted token, which is not yet in the KV cache.
A tree of ``n`` draft nodes therefore verifies ``n + 1`` tokens. ``parents[i]`` is the draft node that node ``i``
continues, or ``-1`` for the root. Parents always come before their children (``parents[i] < i``), so one pass
over the nodes in order is a topological pass and a cycle cannot be expressed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

ROOT = -1


def _check_parents(parents: torch.Tensor) -> None:
    n = parents.numel()
    if n == 0:
        return
    index = torch.arange(n)
    bad = (parents < ROOT) | (parents >= index)
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise ValueError(
            f"invalid draft tree: node {i} has parent {int(parents[i])}; every parent must be -1 (the root) or an "
            "earlier node (parents[i] < i). This rules out cycles and parents listed after their children: "
            "order the nodes breadth- or depth-first."
        )


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A tree of draft tokens below the root (the last accepted token).

    Attributes:
        tokens: ``[n]`` draft token ids.
        parents: ``[n]`` index of each node's parent node, ``-1`` for children of the root.
        draft_probs: optional ``[n, vocab]``: the distribution each node's token was drawn from, independently of its
            siblings. ``None`` means the tokens were chosen deterministically (top-k), which is what greedy and
            deterministic-draft speculative sampling assume.

    Raises:
        ValueError: on mismatched shapes or a parent that is not an earlier node.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        tokens = torch.as_tensor(self.tokens, dtype=torch.long).reshape(-1)
        parents = torch.as_tensor(self.parents, dtype=torch.long, device=tokens.device).reshape(-1)
        if tokens.shape != parents.shape:
            raise ValueError(f"draft tree: {tokens.numel()} tokens but {parents.numel()} parents")
        _check_parents(parents.cpu())
        if self.draft_probs is not None and self.draft_probs.shape[0] != tokens.numel():
            raise ValueError(f"draft tree: draft_probs has {self.draft_probs.shape[0]} rows for {tokens.numel()} nodes")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)

    @classmethod
    def chain(cls, tokens: Sequence[int] | torch.Tensor, draft_probs: torch.Tensor | None = None) -> DraftTree:
        """A single path: each token continues the previous one."""
        n = len(tokens)
        return cls(torch.as_tensor(tokens), torch.arange(n) - 1, draft_probs)

    @classmethod
    def empty(cls) -> DraftTree:
        return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return self.tokens.numel()

    def to(self, device: torch.device) -> DraftTree:
        """This tree with its tensors on ``device`` (itself when they are there already). ``decoding.generate``
        keeps every proposed tree on the CPU, where its derived structure (depth, ancestor mask) is built."""
        if self.tokens.device == device and (self.draft_probs is None or self.draft_probs.device == device):
            return self
        probs = None if self.draft_probs is None else self.draft_probs.to(device)
        return DraftTree(self.tokens.to(device), self.parents.to(device), probs)

    @cached_property
    def _parents_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def token_list(self) -> list[int]:
        """``tokens`` as a Python list (what acceptance walks)."""
        return self.tokens.tolist()

    @cached_property
    def token_paths(self) -> list[tuple[int, ...]]:
        """Per node, the tokens on the path from the root down to it, itself included (the root's token is not)."""
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens.tolist(), self._parents_list):
            paths.append((paths[parent] if parent != ROOT else ()) + (token,))
        return paths

    @cached_property
    def _depth_list(self) -> list[int]:
        depth: list[int] = []
        for p in self._parents_list:
            depth.append(1 if p == ROOT else depth[p] + 1)
        return depth

    @cached_property
    def depth(self) -> torch.Tensor:
        """``[n]`` depth of each node; children of the root have depth 1."""
        return torch.tensor(self._depth_list, dtype=torch.long)

    @cached_property
    def ancestor_mask(self) -> torch.Tensor:
        """``[n + 1, n + 1]`` bool, root at index 0: ``mask[i, j]`` is True when ``j`` is ``i`` or an ancestor of ``i``."""
        n = len(self)
        rows = [[True] + [False] * n]  # built as lists, one tensor at the end: a row copy per node cost a tensor op
        for i, p in enumerate(self._parents_list):
            row = rows[p + 1].copy()  # the parent's row (the root's for -1), then the node itself
            row[i + 1] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool)

    @cached_property
    def max_depth(self) -> int:
        return max(self._depth_list, default=0)

    @cached_property
    def children(self) -> list[list[int]]:
        """``children[0]`` lists the root's children, ``children[i + 1]`` those of node ``i`` (in node order)."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self._parents_list):
            kids[p + 1].append(i)
        return kids

    @cached_property
    def paths(self) -> list[list[int]]:
        """Root-to-leaf paths as lists of node indices (the root itself excluded)."""
        leaves = [i for i in range(len(self)) if not self.children[i + 1]]
        out = []
        for leaf in leaves:
            path, node = [], leaf
            while node != ROOT:
                path.append(node)
                node = self._parents_list[node]
            out.append(path[::-1])
        return out


class TreeTemplate:
    """A static tree shape in Medusa's *choices* format, filled with fresh tokens at every step.

    Each choice is a path of top-k ranks, one per depth: ``[0]`` is the best candidate at depth 1, ``[0, 1]`` the
    second-best candidate at depth 2 below it. Every prefix of a choice must itself be a choice. The token of a
    node depends only on its depth and its own rank, as with Medusa heads (head ``d - 1`` drafts depth ``d``).
    """

    def __init__(self, choices: Sequence[Sequence[int]]):
        paths = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
        if any(len(c) == 0 for c in paths):
            raise ValueError("tree choices: an empty path is the root itself; list only non-empty paths")
        if any(r < 0 for c in paths for r in c):
            raise ValueError("tree choices: ranks must be >= 0")
        index = {c: i for i, c in enumerate(paths)}
        missing = [c for c in paths if len(c) > 1 and c[:-1] not in index]
        if missing:
            raise ValueError(f"tree choices: {list(missing[0])} is listed but its prefix {list(missing[0][:-1])} is not")
        self.choices: list[list[int]] = [list(c) for c in paths]
        self.parents = torch.tensor([index[c[:-1]] if len(c) > 1 else ROOT for c in paths], dtype=torch.long)
        self.depth = torch.tensor([len(c) for c in paths], dtype=torch.long)
        self.rank = torch.tensor([c[-1] for c in paths], dtype=torch.long)
        self.max_depth = int(self.depth.max()) if paths else 0
        self.max_rank = int(self.rank.max()) + 1 if paths else 0
        # Build one tree to validate and to cache the derived masks; fill() reuses its structure.
        self._shape = DraftTree(torch.zeros(len(paths), dtype=torch.long), self.parents)

    def __len__(self) -> int:
        return len(self.choices)

    def fill(self, candidates: torch.Tensor) -> DraftTree:
        """Build the step's tree from ``candidates`` ``[max_depth, max_rank]``: row ``d`` ranks the tokens for depth ``d + 1``."""
        if candidates.shape[0] < self.max_depth or candidates.shape[1] < self.max_rank:
            raise ValueError(
                f"tree needs candidates for {self.max_depth} depths x {self.max_rank} ranks, got {tuple(candidates.shape)}"
            )
        return self.with_tokens(candidates[self.depth - 1, self.rank])

    def with_tokens(self, tokens: torch.Tensor) -> DraftTree:
        """This shape holding ``tokens`` ``[len(self)]`` (node order), sharing the cached masks and paths."""
        tree = DraftTree(tokens, self.parents)
        # The shape never changes, so share the derived structure instead of recomputing it every step.
        for name in ("_parents_list", "depth", "max_depth", "ancestor_mask", "children", "paths"):
            tree.__dict__[name] = getattr(self._shape, name)
        return tree

    @classmethod
    def chain(cls, length: int) -> TreeTemplate:
        return cls([[0] * d for d in range(1, length + 1)])
