"""Early-exit and layer-skip drafts on the embedded SmolLM2: greedy output equals the model's own ``generate``."""

from __future__ import annotations

from pathlib import Path

import pytest

import decoding
from decoding.registry import make_drafter
from selfspec.runtime.prompts import encode_prompt
from selfspec.testing import hf_greedy_continuations

pytestmark = [pytest.mark.real_model, pytest.mark.xdist_group("real_model")]

PROMPTS = ("Write a haiku about the sea.", "What is 12 times 7?")
NEW_TOKENS = 32
COMMITTED = Path(__file__).resolve().parents[2] / "heads" / "smollm2-135m-instruct-early-exit"


@pytest.fixture(scope="module")
def references(smollm2) -> dict[str, list[list[int]]]:
    """HF greedy ``generate`` for each prompt, computed once for every drafter checked against it."""
    return hf_greedy_continuations(*smollm2, PROMPTS, NEW_TOKENS)


DRAFTS = {
    "early-exit-chain": ("early-exit", None, dict(exit_layer=15, max_depth=4)),
    "early-exit-tree": ("early-exit", None, dict(exit_layer=20, max_depth=3, top_k=2, width=2)),
    "layer-skip": ("layer-skip", None, dict(max_depth=3)),
}


@pytest.mark.parametrize("draft", sorted(DRAFTS))
def test_greedy_equality(smollm2, references, draft):
    model, tokenizer = smollm2
    name, heads, options = DRAFTS[draft]
    drafter = make_drafter(name, model, heads, **options)
    for text in PROMPTS:
        out = decoding.generate(model, drafter, encode_prompt(tokenizer, text), max_new_tokens=NEW_TOKENS,
                                eos_token_id=tokenizer.eos_token_id)
        assert out.sequences.tolist() == references[text], (draft, text)


@pytest.mark.skipif(not (COMMITTED / "config.json").is_file(), reason="no committed early-exit classifier yet")
def test_committed_classifier_is_lossless(smollm2, references):
    model, tokenizer = smollm2
    drafter = make_drafter("early-exit", model, str(COMMITTED))
    for text in PROMPTS:
        out = decoding.generate(model, drafter, encode_prompt(tokenizer, text), max_new_tokens=NEW_TOKENS,
                                eos_token_id=tokenizer.eos_token_id)
        assert out.sequences.tolist() == references[text], text
