"""scripts/draft_calibration.py: the nodes it counts as accepted are the ones the decode loop accepted, its tables
add up, and it leaves the drafter as it found it."""

from __future__ import annotations

import math

import pytest
import torch

from decoding.generate import generate
from eagle.drafter import EagleDrafter, EaglePolicy
from selfspec.runtime.tiny import tiny_model
from selfspec.testing import eagle_draft, greedy_reference, load_script, random_prompt


@pytest.fixture(scope="module")
def script():
    return load_script("draft_calibration")


def test_recorded_acceptance_is_the_decode_loops(script):
    model = tiny_model("llama")
    draft = eagle_draft(model, seed=5, draft_vocab_size=60)
    policy = EaglePolicy(depth=3, nodes=7, top_k=3, width=2)
    ids = random_prompt(5, seed=2)
    reference = generate(model, EagleDrafter(model, draft, policy), ids, max_new_tokens=40)
    drafter = EagleDrafter(model, draft, policy)
    steps = script.record_nodes(model, drafter, ids, 40, None)
    assert "propose" not in vars(drafter)  # the class's method again
    # every proposal of the same decode, minus those reaching past the end of the output
    assert 0 < len(steps) <= reference.stats.steps
    accepted = [sum(a for _, _, a in step) for step in steps]
    assert accepted == reference.stats.accepted_per_step[:len(steps)]
    assert all(0 < p <= 1 and 1 <= d <= 3 for step in steps for p, d, _ in step)
    assert any(accepted)  # the tiny draft accepts something (else the comparison above proves little)
    assert torch.equal(reference.sequences, greedy_reference(model, ids, 40))

    rows = script.reliability([node for step in steps for node in step])
    assert sum(r["nodes"] for r in rows) == sum(len(step) for step in steps)
    assert math.isclose(sum(r["share_of_accepted"] for r in rows), 1.0)
    budgets = script.tau_by_budget(steps, budgets=(1, 7, 8))
    assert [b["nodes"] for b in budgets] == [1, 7]  # no step holds 8 nodes
    assert budgets[1]["tau"] == pytest.approx(1 + sum(accepted) / len(steps))
    assert budgets[0]["tau"] <= budgets[1]["tau"]
