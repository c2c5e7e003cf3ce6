"""The order a recipe visits its examples: every example once per epoch, reproducible (a resumed run sees the same
batches), split across processes without overlap, and with ``optim.group_by_length`` far less padding."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from selfspec.training.config import LENGTH_GROUP_STEPS, OptimConfig, epoch_order, step_batches


def lengths(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(20, 512) for _ in range(n)]


def padded_tokens(batches: list[list[int]], lens: list[int]) -> int:
    return sum(len(b) * max(lens[i] for i in b) for b in batches)


@pytest.mark.parametrize("grouped", [False, True])
def test_each_epoch_visits_every_example_once_and_is_reproducible(grouped):
    optim = OptimConfig(batch_size=4, group_by_length=grouped)
    lens = lengths(1000)
    for epoch in range(3):
        order = epoch_order(1000, epoch, optim, 1, seed=7, lengths=lens)
        assert sorted(order.tolist()) == list(range(1000))
        assert order.tolist() == epoch_order(1000, epoch, optim, 1, seed=7, lengths=lens).tolist()
    assert epoch_order(1000, 0, optim, 1, 7, lens).tolist() != epoch_order(1000, 1, optim, 1, 7, lens).tolist()


def test_group_by_length_cuts_padding_and_keeps_batches_shuffled():
    lens = lengths(2000)
    steps = 2000 // 8
    plain, grouped = OptimConfig(batch_size=8), OptimConfig(batch_size=8, group_by_length=True)
    one = SimpleNamespace(num_processes=1, process_index=0)
    random_batches = [step_batches(2000, s, steps, plain, one)[0] for s in range(steps)]
    grouped_batches = [step_batches(2000, s, steps, grouped, one, lengths=lens)[0] for s in range(steps)]
    assert sorted(i for b in grouped_batches for i in b) == list(range(2000))
    assert padded_tokens(grouped_batches, lens) < 0.75 * padded_tokens(random_batches, lens)
    # within a group the batches are not simply longest-first: the step lengths do not trend downwards
    longest = [max(lens[i] for i in b) for b in grouped_batches[:LENGTH_GROUP_STEPS]]
    assert longest != sorted(longest, reverse=True)


def test_processes_take_disjoint_slices_of_the_same_global_batches():
    lens = lengths(640)
    optim = OptimConfig(batch_size=4, gradient_accumulation_steps=2, group_by_length=True)
    steps = 640 // (4 * 2 * 2)
    for step in (0, 5, steps + 3):
        per_process = [step_batches(640, step, steps, optim, SimpleNamespace(num_processes=2, process_index=p),
                                    seed=1, lengths=lens) for p in range(2)]
        seen = [i for batches in per_process for b in batches for i in b]
        assert len(seen) == len(set(seen)) == 16


def test_lengths_must_match_the_examples():
    with pytest.raises(ValueError, match="3 lengths for 4 examples"):
        epoch_order(4, 0, OptimConfig(group_by_length=True), 1, lengths=[1, 2, 3])
