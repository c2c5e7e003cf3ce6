"""selfspec.bench.replay: replaying a drafter against the greedy continuation gives exactly the steps real greedy
speculative decoding takes (same tau, same per-step accepted counts), for static, dynamic and combined drafters."""

from __future__ import annotations

import pytest
import torch

import decoding
from decoding import combine
from decoding.tree import DraftTree
from lookup import LookupDrafter
from medusa import MedusaDrafter
from selfspec.bench.replay import make_references, matched_path, replay
from selfspec.testing import RandomDrafter, prefix_heads, sequential_heads


def test_matched_path_follows_the_target_through_the_tree():
    tree = DraftTree(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 0, 3]))
    assert matched_path(tree, torch.tensor([5, 8, 9, 1])) == [0, 3, 4]
    assert matched_path(tree, torch.tensor([6, 7])) == [1]
    assert matched_path(tree, torch.tensor([7])) == []
    assert matched_path(tree, torch.tensor([5, 8])) == [0, 3]


def _drafters(model):
    seq = sequential_heads(model, num_heads=4, seed=3)
    pre = prefix_heads(model, seed=5, num_heads=4)
    return {
        "sequential-static": lambda: MedusaDrafter(seq, tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]]),
        "sequential-dynamic": lambda: MedusaDrafter(seq, dynamic=12, width=3, top_k=24),
        "prefix-dynamic": lambda: MedusaDrafter(pre, dynamic=10, width=2, top_k=24),
        "lookup": lambda: LookupDrafter(num_tokens=5),
        "prefix+lookup": lambda: combine(MedusaDrafter(pre, dynamic=6, width=2, top_k=24), LookupDrafter()),
    }


@pytest.mark.parametrize("name", ["sequential-static", "sequential-dynamic", "prefix-dynamic", "lookup",
                                  "prefix+lookup"])
def test_replay_takes_the_same_steps_as_real_decoding(tiny_llama64, name):
    model = tiny_llama64
    make = _drafters(model)[name]
    prompts = [torch.tensor([[1, 17, 4, 33, 8]]), torch.tensor([[1, 60, 61, 2, 9, 9, 40, 12, 3]]),
               torch.tensor([[3, 4, 3, 4, 3]])]
    references = make_references(model, prompts, 30)
    simulated = replay(make(), references, model)
    real_steps, real_tokens = 0, 0
    for reference, prompt in zip(references, prompts):
        out = decoding.generate(model, make(), prompt, max_new_tokens=30, eos_token_id=None)
        assert out.sequences[0].tolist() == reference.ids[0].tolist()
        real_steps, real_tokens = real_steps + out.stats.steps, real_tokens + sum(out.stats.tokens_per_step)
    assert (simulated.steps, simulated.tokens) == (real_steps, real_tokens)
    assert simulated.tau > 1.0 or name == "sequential-static"


def test_replay_needs_the_hidden_states(tiny_llama64):
    references = make_references(tiny_llama64, [torch.tensor([[1, 2, 3]])], 5, layers=())
    drafter = MedusaDrafter(sequential_heads(tiny_llama64, num_heads=2), tree=2)
    with pytest.raises(ValueError, match="call add_hidden first"):
        replay(drafter, references, tiny_llama64)
    assert replay(RandomDrafter(96, size=3, seed=0), references).steps > 0
