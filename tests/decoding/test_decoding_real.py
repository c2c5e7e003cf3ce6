"""The decode loop on the real SmolLM2 (fp32): any drafter, same text as transformers' greedy generate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decoding import generate
from selfspec.runtime.prompts import encode_prompt, read_prompts
from selfspec.testing import OracleDrafter, RandomDrafter

MT_BENCH = Path(__file__).resolve().parents[3] / "shared" / "data" / "mt_bench.jsonl"
pytestmark = [pytest.mark.real_model, pytest.mark.xdist_group("real_model")]


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tokenizer = smollm2
    # One prompt from each of three categories keeps this quick but varied.
    items = read_prompts(MT_BENCH)
    chosen = [items[0], items[30], items[60]]
    return [encode_prompt(tokenizer, item["prompt"]) for item in chosen]


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
