"""Medusa decoding on the embedded SmolLM2: greedy output equals the model's own ``generate``, with random heads
and with the committed heads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import decoding
from medusa import MedusaDrafter, MedusaHeads, load
from selfspec.cli.demo import default_heads_dir
from selfspec.runtime.prompts import encode_prompt
from selfspec.testing import assert_decodes_like_references, hf_greedy_continuations

pytestmark = [pytest.mark.real_model, pytest.mark.xdist_group("real_model")]

PROMPTS = ("Write a haiku about the sea.", "What is 12 times 7?")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def references(smollm2) -> dict[str, list[list[int]]]:
    """HF greedy ``generate`` for each prompt, computed once for every drafter checked against it."""
    return hf_greedy_continuations(*smollm2, PROMPTS, NEW_TOKENS)


def _check(smollm2, references, drafter) -> list[float]:
    return assert_decodes_like_references(*smollm2, drafter, references, NEW_TOKENS)


@pytest.mark.parametrize("tree", [8, 32])
def test_greedy_equality_random_heads(smollm2, references, tree):
    model, _ = smollm2
    heads = MedusaHeads.for_model(model, num_heads=4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        # Scaled to the hidden size so the ResBlocks perturb the features without swamping them.
        for p in heads.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) / p.shape[-1] ** 0.5)
    _check(smollm2, references, MedusaDrafter(heads, tree=tree))


def test_greedy_equality_committed_heads(smollm2, references):
    model, _ = smollm2
    heads_dir = default_heads_dir()
    if not heads_dir.is_dir():
        pytest.skip(f"no committed heads at {heads_dir} yet")
    taus = _check(smollm2, references, load(model, heads_dir))
    # Trained heads must actually draft: a tau of 1 would mean no draft token is ever accepted.
    assert sum(taus) / len(taus) > 1.2, taus


def test_greedy_equality_sequential_heads_with_lookup_on_the_skinny_kernel(smollm2):
    """What the benchmark runs: the committed sequential heads merged with prompt lookup, every linear layer on the
    skinny kernel, against HF ``generate`` on the same kernel."""
    from decoding.registry import make_combined
    from selfspec.runtime.kernels import linear_backend

    model, tokenizer = smollm2
    heads_dir = str(Path(__file__).resolve().parents[2] / "heads" / "smollm2-135m-instruct-medusa-seq")
    with linear_backend(model, "skinny"):
        drafter = make_combined([("medusa", heads_dir), ("lookup", None)], model, {})
        taus = []
        for text in PROMPTS + ("List the planets of the solar system, one per line, with their order from the sun.",):
            ids = encode_prompt(tokenizer, text)
            expected = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48,
                                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                                      temperature=None, top_p=None, top_k=None).tolist()
            out = decoding.generate(model, drafter, ids, max_new_tokens=48, eos_token_id=tokenizer.eos_token_id)
            assert out.sequences.tolist() == expected, text
            taus.append(out.stats.tau)
    assert sum(taus) / len(taus) > 1.3, taus
