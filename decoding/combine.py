"""Several drafters proposing into one tree: ``combine(a, b, ...)`` runs every drafter each step and merges their
trees (identical paths are shared, so a token both propose is verified once). ``medusa+lookup`` on the command
line is ``combine(medusa, lookup)``.

``fallback(a, b)`` asks ``b`` only in the steps where ``a`` proposes nothing: ``lookup|eagle`` on the command line.
A model-free drafter costs ~0.1 ms a step, a drafter that runs layers of its own 1.5-3 ms (15-30% of a plain step
of SmolLM2 on 2 cores). Where prompt lookup has matched, it usually drafts the continuation well and the layers add
little; where the last token never occurred before, it has nothing and the layers are worth their time
(SuffixDecoding's hybrid with a model drafter, Arctic Inference, does the same). Measured on MT-bench 1-40 on a 2-core
Xeon (docs/RESULTS.md): ``lookup|eagle+datastore`` kept most of the merged tree's tau (2.74 of 2.94) at 60% of its
drafting time, 13% faster than ``eagle+lookup+datastore``, and level with ``lookup+datastore`` (1.60-1.65x against
1.65-1.66x): there the feature drafter's extra tokens cost what plain decoding's cost.
"""

from __future__ import annotations

from typing import Sequence

import torch

from decoding.drafter import DecodeState, Drafter
from decoding.tree import DraftTree


class _DrafterGroup:
    """What several drafters acting as one share: one vocabulary, the union of their hidden layers, and every member
    starting and observing every step. Subclasses say how a step's tree comes from the members' (``propose``).

    Raises:
        ValueError: no drafters, or drafters that propose from different vocabularies.
    """

    _builder = _members = ""  # for the error messages: "combine()" / "combined", "fallback()" / "fallback"

    def __init__(self, drafters: Sequence[Drafter]):
        if not drafters:
            raise ValueError(f"{self._builder} needs at least one drafter")
        vocabularies = {getattr(d, "vocab_size", None) for d in drafters} - {None}
        if len(vocabularies) > 1:
            raise ValueError(f"{self._members} drafters propose from different vocabularies: {sorted(vocabularies)}")
        self.drafters = list(drafters)
        self.vocab_size = next(iter(vocabularies), None)
        self.hidden_layers = tuple(dict.fromkeys(layer for d in drafters for layer in getattr(d, "hidden_layers", ())))

    def begin(self, state: DecodeState) -> None:
        for d in self.drafters:
            d.begin(state)

    def observe(self, state: DecodeState) -> None:
        for d in self.drafters:
            d.observe(state)


class CombinedDrafter(_DrafterGroup):
    """Several drafters proposing into one tree every step (see ``merge_trees``).

    Raises:
        ValueError: no drafters, or drafters that propose from different vocabularies.
    """

    _builder, _members = "combine()", "combined"

    def propose(self, state: DecodeState) -> DraftTree | None:
        return merge_trees([d.propose(state) for d in self.drafters])


class FallbackDrafter(_DrafterGroup):
    """Drafters asked in turn each step: the first tree proposed (not ``None``, not empty) is the step's tree.
    Every drafter observes every step (a drafter with a context of its own, such as the feature drafter, may defer
    that work to the steps it drafts in).

    Raises:
        ValueError: no drafters, or drafters that propose from different vocabularies.
    """

    _builder, _members = "fallback()", "fallback"

    def __init__(self, drafters: Sequence[Drafter], names: Sequence[str] | None = None):
        super().__init__(drafters)
        if names is not None and len(names) != len(self.drafters):
            raise ValueError(f"fallback(): {len(names)} names for {len(self.drafters)} drafters")
        #: what reports call each drafter (the spec's part names where the registry built it, else class names)
        self.names = list(names) if names is not None else [type(d).__name__ for d in self.drafters]
        #: how many steps each drafter's tree was the one proposed (none of them proposing: not counted)
        self.proposed = [0] * len(self.drafters)

    def propose(self, state: DecodeState) -> DraftTree | None:
        for i, d in enumerate(self.drafters):
            tree = d.propose(state)
            if tree is not None and len(tree):
                self.proposed[i] += 1
                return tree
        return None


def fallback(*drafters: Drafter, names: Sequence[str] | None = None) -> FallbackDrafter:
    """One drafter that asks ``drafters`` in turn and proposes the first tree one of them proposes (``names``: what
    reports call each, default their class names)."""
    return FallbackDrafter(drafters, names)


def fallback_counts(drafter: Drafter) -> dict[str, int]:
    """Steps whose tree came from each member of every fallback inside ``drafter`` (a fallback, or a combination
    holding some), by member name, summed where a name recurs; empty where there is no fallback."""
    counts: dict[str, int] = {}
    if isinstance(drafter, FallbackDrafter):
        for name, n in zip(drafter.names, drafter.proposed):
            counts[name] = counts.get(name, 0) + n
    for member in drafter.drafters if isinstance(drafter, _DrafterGroup) else ():
        for name, n in fallback_counts(member).items():
            counts[name] = counts.get(name, 0) + n
    return counts


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
