"""The decode loop on the real SmolLM2 (fp32): any drafter, same text as transformers' greedy generate."""

from __future__ import annotations

import json

import pytest

from decoding import generate
from selfspec.runtime.prompts import encode_prompt
from selfspec.testing import OracleDrafter, RandomDrafter

# Three kinds of request (writing, arithmetic reasoning, code), held here so that the suite needs nothing outside
# the repository.
PROMPTS = (
    "Write a short, friendly note to a neighbour asking them to water my tomato plants while I am away for a week.",
    "A train leaves at 9:40 and arrives at 13:15. How long is the journey in minutes? Explain each step.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring and two examples.",
)
pytestmark = [pytest.mark.real_model, pytest.mark.xdist_group("real_model")]


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tokenizer = smollm2
    return [encode_prompt(tokenizer, text) for text in PROMPTS]


def test_oracle_and_random_drafters_equal_hf_greedy(smollm2, prompts):
    model, tokenizer = smollm2
    vocab = model.get_output_embeddings().weight.shape[0]
    for i, input_ids in enumerate(prompts):
        reference = model.generate(input_ids, max_new_tokens=40, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                   pad_token_id=tokenizer.eos_token_id)
        oracle = generate(model, OracleDrafter(reference, 5), input_ids, max_new_tokens=40,
                          eos_token_id=tokenizer.eos_token_id)
        assert oracle.sequences.tolist() == reference.tolist()
        assert oracle.stats.tau > 4.0
        random = generate(model, RandomDrafter(vocab, size=12, seed=i, reference=reference, hit_rate=0.6), input_ids,
                          max_new_tokens=40, eos_token_id=tokenizer.eos_token_id)
        assert random.sequences.tolist() == reference.tolist()


def test_cli_generate_json(smollm2, capsys):
    from selfspec.cli import main

    model, tokenizer = smollm2
    rc = main(["generate", "--prompt", "Name three primary colors.", "--max-new-tokens", "12", "--json"])
    assert rc == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    input_ids = encode_prompt(tokenizer, "Name three primary colors.")
    reference = model.generate(input_ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    assert record["token_ids"] == reference[0, input_ids.shape[1]:].tolist()
    assert record["stats"]["steps"] >= 1 and record["text"]


def test_text_streamer_prints_the_answer(smollm2, capsys):
    from transformers import TextStreamer

    model, tokenizer = smollm2
    input_ids = encode_prompt(tokenizer, "What is 2 + 2?")
    reference = model.generate(input_ids, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    out = generate(model, OracleDrafter(reference, 3), input_ids, max_new_tokens=10,
                   streamer=TextStreamer(tokenizer, skip_prompt=True))
    printed = capsys.readouterr().out
    expected = tokenizer.decode(out.sequences[0, input_ids.shape[1]:])
    assert printed.strip() == expected.strip()
