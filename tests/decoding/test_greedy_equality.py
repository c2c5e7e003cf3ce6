"""Lossless greedy decoding: whatever the drafter proposes, the output equals ``model.generate(do_sample=False)``.

float64 tiny models, so argmax ties cannot flip between a one-token forward and a tree forward.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding import DraftTree, EmptyDrafter, TreeTemplate, generate
from selfspec.testing import ARCHITECTURES, OracleDrafter, RandomDrafter, tiny_model

VOCAB = 96


@lru_cache(maxsize=None)
def model_for(arch: str):
    return tiny_model(arch, dtype=torch.float64)


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos: int | None = None) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                          pad_token_id=0 if eos is None else eos)


def random_prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def tree_parents(kind: str, size: int, rng: torch.Generator) -> list[int]:
    if kind == "single":
        return [-1]
    if kind == "chain":
        return list(range(-1, size - 1))
    if kind == "wide":
        return [-1] * size
    if kind == "deep":
        return list(range(-1, 15))
    # random shape: each node hangs below the root or any earlier node
    return [-1] + [int(torch.randint(-1, i, (1,), generator=rng)) for i in range(1, size)]


@settings(max_examples=240, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    arch=st.sampled_from(ARCHITECTURES),
    prompt_length=st.integers(1, 48),
    max_new_tokens=st.integers(1, 40),
    kind=st.sampled_from(["single", "chain", "wide", "deep", "random"]),
    size=st.integers(1, 24),
    hit_rate=st.sampled_from([0.0, 0.5, 0.8, 0.95]),
    use_eos=st.booleans(),
    seed=st.integers(0, 2**20),
)
def test_random_trees_match_hf_greedy(arch, prompt_length, max_new_tokens, kind, size, hit_rate, use_eos, seed):
    model = model_for(arch)
    prompt = random_prompt(prompt_length, seed)
    rng = torch.Generator().manual_seed(seed + 1)
    eos = None
    if use_eos:
        # An EOS that really occurs in the continuation, so generation stops there (often inside a tree).
        long = hf_greedy(model, prompt, max_new_tokens)[0, prompt_length:]
        eos = int(long[int(torch.randint(0, long.numel(), (1,), generator=rng))])
    reference = hf_greedy(model, prompt, max_new_tokens, eos)
    # Drafts copy the reference (where it exists) part of the time, so that deep and partial acceptances happen.
    oracle_source = hf_greedy(model, prompt, max_new_tokens + 16)
    parents = tree_parents(kind, size, rng) if kind != "random" else None
    drafter = RandomDrafter(VOCAB, size=size, seed=seed, parents=parents, reference=oracle_source, hit_rate=hit_rate)
    out = generate(model, drafter, prompt, max_new_tokens=max_new_tokens, eos_token_id=eos)
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.new_tokens == reference.shape[1] - prompt_length


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("depth", [1, 3, 6])
def test_oracle_tau_is_depth_plus_one(arch, depth):
    model = model_for(arch)
    prompt = random_prompt(7, depth)
    steps = 4
    max_new = 1 + steps * (depth + 1)  # one token from prefill, then full steps
    reference = hf_greedy(model, prompt, max_new)
    out = generate(model, OracleDrafter(reference, depth), prompt, max_new_tokens=max_new)
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.steps == steps
    assert out.stats.tau == depth + 1
    assert out.stats.accepted_per_step == [depth] * steps


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma"])
def test_empty_drafter_matches_hf(arch):
    model = model_for(arch)
    prompt = random_prompt(5, 0)
    reference = hf_greedy(model, prompt, 25)
    class EmptyTrees(RandomDrafter):
        def propose(self, state):
            return DraftTree.empty()

    for drafter in (None, EmptyDrafter(), EmptyTrees(VOCAB)):
        out = generate(model, drafter, prompt, max_new_tokens=25)
        assert out.sequences.tolist() == reference.tolist()
        assert out.stats.tau == 1.0


@pytest.mark.parametrize("eos_offset", [0, 1, 2, 3, 5])
def test_eos_inside_accepted_path_ends_there(eos_offset):
    model = model_for("llama")
    prompt = random_prompt(6, 11)
    free = hf_greedy(model, prompt, 30)
    new = free[0, prompt.shape[1]:]
    # Take the first occurrence of a token as EOS so that it first appears at eos_offset.
    candidates = [i for i in range(len(new)) if int(new[i]) not in new[:i].tolist()]
    position = candidates[min(eos_offset, len(candidates) - 1)]
    eos = int(new[position])
    reference = hf_greedy(model, prompt, 30, eos)
    assert reference.shape[1] == prompt.shape[1] + position + 1
    out = generate(model, OracleDrafter(free, 8), prompt, max_new_tokens=30, eos_token_id=eos)
    assert out.sequences.tolist() == reference.tolist()
    # Several EOS ids: the first one that occurs wins.
    out = generate(model, OracleDrafter(free, 8), prompt, max_new_tokens=30, eos_token_id=[eos, 9999])
    assert out.sequences.tolist() == reference.tolist()


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 4, 5, 8, 9, 10])
def test_max_new_tokens_is_exact(max_new_tokens):
    model = model_for("qwen2")
    prompt = random_prompt(4, 3)
    reference = hf_greedy(model, prompt, max_new_tokens)
    source = hf_greedy(model, prompt, 40)
    for depth in (1, 3, 4):
        out = generate(model, OracleDrafter(source, depth), prompt, max_new_tokens=max_new_tokens)
        assert out.sequences.tolist() == reference.tolist()
        assert out.stats.new_tokens == max_new_tokens


def test_static_template_tree_in_float32():
    model = tiny_model("llama")
    prompt = random_prompt(9, 5)
    reference = hf_greedy(model, prompt, 30)
    template = TreeTemplate([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]])

    class TemplateDrafter(RandomDrafter):
        def propose(self, state):
            start = state.sequence.shape[1]
            truth = reference[0, start:start + template.max_depth]
            candidates = torch.randint(0, VOCAB, (template.max_depth, template.max_rank), generator=self.generator)
            candidates[: truth.numel(), 1] = truth  # the true token sits at rank 1
            return template.fill(candidates)

    out = generate(model, TemplateDrafter(VOCAB), prompt, max_new_tokens=30)
    assert out.sequences.tolist() == reference.tolist()
    assert out.stats.tau > 1.5  # rank-1 paths ([1], [1, 0]) are accepted


def test_streamer_receives_prompt_then_every_token():
    class Recorder:
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    model = model_for("llama")
    prompt = random_prompt(5, 2)
    reference = hf_greedy(model, prompt, 20)
    recorder = Recorder()
    generate(model, OracleDrafter(reference, 3), prompt, max_new_tokens=20, streamer=recorder)
    assert recorder.ended
    assert recorder.chunks[0] == prompt[0].tolist()
    assert sum(recorder.chunks[1:], []) == reference[0, 5:].tolist()
    assert max(len(c) for c in recorder.chunks[1:]) == 4  # whole accepted paths arrive at once


def test_cache_holds_exactly_prefix_and_accepted_path():
    """After every step the cache equals the cache plain decoding would have built."""
    model = model_for("mistral")
    prompt = random_prompt(6, 8)
    reference = hf_greedy(model, prompt, 16)
    seen = []

    class Checking(RandomDrafter):
        def propose(self, state):
            seen.append((state.cache_length, [layer.keys.clone() for layer in state.cache.layers]))
            return super().propose(state)

    drafter = Checking(VOCAB, size=10, seed=4, reference=reference, hit_rate=0.7)
    out = generate(model, drafter, prompt, max_new_tokens=16)
    assert out.sequences.tolist() == reference.tolist()
    full = model(reference, use_cache=True).cache
    for length, keys in seen:
        assert length == keys[0].shape[2]
        for layer, k in zip(full.layers, keys):
            torch.testing.assert_close(k, layer.keys[:, :, :length], rtol=1e-9, atol=1e-9)
