"""Reference drafters for tests and sanity checks: they show the decode loop is lossless whatever is proposed."""

from __future__ import annotations

import torch

from .drafter import DecodeState, DrafterBase
from .tree import DraftTree


class OracleDrafter(DrafterBase):
    """Proposes the true continuation (a reference sequence) as a chain: every node is accepted, so
    tau equals depth + 1. Where the reference ends it proposes nothing."""

    def __init__(self, reference: torch.Tensor, depth: int):
        self.reference = reference.reshape(-1)
        self.depth = depth

    def propose(self, state: DecodeState) -> DraftTree | None:
        start = state.sequence.shape[1]
        tokens = self.reference[start:start + self.depth]
        if tokens.numel() == 0:
            return None
        return DraftTree.chain(tokens)


class RandomDrafter(DrafterBase):
    """Proposes a random tree of random tokens each step (random shape unless ``parents`` is fixed)."""

    def __init__(self, vocab_size: int, size: int = 8, seed: int = 0, parents: list[int] | None = None,
                 reference: torch.Tensor | None = None, hit_rate: float = 0.0):
        self.vocab_size = vocab_size
        self.size = size
        self.parents = parents
        self.generator = torch.Generator().manual_seed(seed)
        # With a reference, some nodes copy the true token so that deep partial acceptances happen too.
        self.reference = None if reference is None else reference.reshape(-1)
        self.hit_rate = hit_rate

    def propose(self, state: DecodeState) -> DraftTree | None:
        g = self.generator
        if self.parents is not None:
            parents = torch.tensor(self.parents)
        else:
            parents = torch.tensor([-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, self.size)])
        tree = DraftTree(torch.randint(0, self.vocab_size, (len(parents),), generator=g), parents)
        if self.reference is None or self.hit_rate <= 0:
            return tree
        start = state.sequence.shape[1]
        positions = start + tree.depth - 1
        tokens = tree.tokens.clone()
        hit = (torch.rand(len(tokens), generator=g) < self.hit_rate) & (positions < self.reference.numel())
        tokens[hit] = self.reference[positions[hit]]
        return DraftTree(tokens, parents)
