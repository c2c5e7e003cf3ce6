"""Batched decoding (``decoding.batch.generate_batch``): prompts of different lengths decoded together, each row
accepting its own number of tokens per step, and each row's output equal to its own ``model.generate``.

float64 tiny models, so argmax ties cannot flip between a batched padded forward and a single-row one.
"""

from __future__ import annotations

from functools import lru_cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding import generate
from decoding.batch import fork, generate_batch
from decoding.registry import make_drafter
from selfspec.testing import ARCHITECTURES, RandomDrafter, eagle_draft, sequential_heads, tiny_model

VOCAB = 96


@lru_cache(maxsize=None)
def model_for(arch: str):
    return tiny_model(arch, dtype=torch.float64)


def batchable(arch: str) -> bool:
    try:
        generate_batch(model_for(arch), None, [[5, 6]], max_new_tokens=1)
        return True
    except ValueError as e:
        assert "sliding-window" in str(e)
        return False


BATCHABLE = tuple(a for a in ARCHITECTURES if batchable(a))


def hf_greedy(model, prompt: torch.Tensor, max_new_tokens: int, eos: int | None = None) -> torch.Tensor:
    return model.generate(prompt, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                          pad_token_id=0 if eos is None else eos)


def prompts_of(lengths, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (1, n), generator=g) for n in lengths]


def test_most_architectures_batch():
    assert {"llama", "qwen2", "qwen3", "phi3", "gpt2"} <= set(BATCHABLE), BATCHABLE


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(
    arch=st.sampled_from(BATCHABLE),
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    max_new_tokens=st.integers(1, 24),
    size=st.integers(1, 12),
    hit_rate=st.sampled_from([0.0, 0.5, 0.9]),
    use_eos=st.booleans(),
    seed=st.integers(0, 2**20),
)
def test_random_trees_per_row_match_each_rows_greedy(arch, lengths, max_new_tokens, size, hit_rate, use_eos, seed):
    """Every row drafts its own random tree (copying its own continuation part of the time), so rows accept
    different numbers of tokens, finish at different steps (EOS or budget) and leave the batch."""
    model = model_for(arch)
    prompts = prompts_of(lengths, seed)
    eos = None
    if use_eos:  # a token that occurs in the first row's continuation: some rows stop early, inside a tree
        long = hf_greedy(model, prompts[0], max_new_tokens)[0, lengths[0]:]
        eos = int(long[seed % long.numel()])
    drafters = [RandomDrafter(VOCAB, size=size, seed=seed + r, reference=hf_greedy(model, p, max_new_tokens + 16),
                              hit_rate=hit_rate) for r, p in enumerate(prompts)]
    out = generate_batch(model, drafters, prompts, max_new_tokens=max_new_tokens, eos_token_id=eos)
    for r, prompt in enumerate(prompts):
        reference = hf_greedy(model, prompt, max_new_tokens, eos)
        assert out.sequences[r].tolist() == reference.tolist(), (r, lengths)
        assert out.stats[r].new_tokens == reference.shape[1] - lengths[r]


def _drafter(kind: str, model):
    if kind == "medusa":
        from medusa.drafter import MedusaDrafter

        return MedusaDrafter(sequential_heads(model, num_heads=3), tree=[[0], [0, 0], [1], [0, 0, 0]])
    if kind == "eagle":
        from eagle.drafter import EagleDrafter, EaglePolicy

        return EagleDrafter(model, eagle_draft(model, seed=3), EaglePolicy(depth=3, nodes=6, top_k=2, width=2))
    return make_drafter(kind, model)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("kind", ["none", "lookup", "medusa", "eagle"])
def test_registered_drafters_batch_losslessly(arch, kind):
    """One drafter given: each row gets a fork (shared weights, its own caches); outputs equal both HF greedy and
    selfspec's own single-row loop, and the per-row statistics are the single-row ones."""
    model = model_for(arch)
    prompts = prompts_of([4, 17, 9, 1, 26, 12], seed=7)
    drafter = _drafter(kind, model)
    out = generate_batch(model, drafter, prompts, max_new_tokens=30)
    for r, prompt in enumerate(prompts):
        single = generate(model, _drafter(kind, model), prompt, max_new_tokens=30)
        assert out.sequences[r].tolist() == hf_greedy(model, prompt, 30).tolist() == single.sequences.tolist()
        assert out.stats[r].tokens_per_step == single.stats.tokens_per_step
    if kind != "none":
        assert any(s.tau > 1.0 for s in out.stats)


def test_sampled_rows_equal_single_row_sampling_with_the_same_seed():
    model = model_for("llama")
    prompts = prompts_of([5, 11, 3], seed=2)
    out = generate_batch(model, make_drafter("lookup", model), prompts, max_new_tokens=20, temperature=0.8,
                         top_p=0.9, seed=40)
    for r, prompt in enumerate(prompts):
        single = generate(model, make_drafter("lookup", model), prompt, max_new_tokens=20, temperature=0.8,
                          top_p=0.9, generator=torch.Generator().manual_seed(40 + r))
        assert out.sequences[r].tolist() == single.sequences.tolist()
    again = generate_batch(model, make_drafter("lookup", model), prompts, max_new_tokens=20, temperature=0.8,
                           top_p=0.9, seed=40)
    assert [s.tolist() for s in again.sequences] == [s.tolist() for s in out.sequences]


def test_fork_shares_weights_not_state():
    model = model_for("llama")
    drafter = _drafter("eagle", model)
    twin = fork(drafter)
    assert twin.draft is drafter.draft and twin.model is model
    assert twin.cache is not drafter.cache


@pytest.mark.parametrize("prompts, drafter, message", [
    ([], None, "no prompts"),
    ([[4, 5], []], None, "prompt 1 is empty"),
    ([[4, 500]], None, "prompt 0 holds token ids outside the model's vocabulary"),
    ([[4, 5]], "early-exit", "drafts inside the base model's own KV cache"),
    ([[4, 5], [6]], "two", "1 drafters for 2 prompts"),
])
def test_bad_batches_are_clear_errors(prompts, drafter, message):
    model = model_for("llama")
    if drafter == "early-exit":
        drafter = make_drafter("early-exit", model)
    elif drafter == "two":
        drafter = [make_drafter("lookup", model)]
    with pytest.raises(ValueError, match=message):
        generate_batch(model, drafter, prompts, max_new_tokens=4)


def test_cli_batch_size_gives_the_batch_1_answers(tmp_path, capsys):
    import json

    from selfspec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in ("Say hi", "Count to five, slowly", "Why")))
    runs = {}
    for size in (1, 3):
        assert main(["generate", "--model", "tiny:llama", "--prompts", str(prompts), "--draft", "lookup",
                     "--max-new-tokens", "12", "--json", "--batch-size", str(size), "--linear-backend", "stock"]) == 0
        runs[size] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["token_ids"] for r in runs[3]] == [r["token_ids"] for r in runs[1]]
    assert [r["batch_size"] for r in runs[3]] == [3, 3, 3]
