"""scripts/replay_drafters.py: its option parsing, the cost interpolation, and a run on a tiny model whose replayed
tau equals a decode's."""

from __future__ import annotations

import json

import pytest

import decoding
from decoding import make_drafter
from selfspec.runtime.models import load_model
from selfspec.runtime.prompts import encode_prompt
from selfspec.testing import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("replay_drafters")


def test_options_and_costs(script):
    assert script.parse_drafters("lookup; lookup nodes=none num_tokens=4 ;lookup+datastore:d datastore.nodes=8") == [
        ("lookup", {}), ("lookup", {"nodes": "none", "num_tokens": "4"}),
        ("lookup+datastore:d", {"datastore.nodes": "8"})]
    for bad, message in (("lookup nodes", "key=value"), (" ; ", "empty")):
        with pytest.raises(ValueError, match=message):
            script.parse_drafters(bad)
    curve = {1: 10.0, 4: 12.0, 8: 20.0}
    assert script.relative_cost(curve, 1) == 1.0 and script.relative_cost(curve, 4) == pytest.approx(1.2)
    assert script.relative_cost(curve, 6) == pytest.approx(1.6)
    assert script.relative_cost(curve, 16) == pytest.approx(4.0)  # past the curve: linear in the tokens


def test_a_tiny_run_prints_the_tau_a_decode_measures(script, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in ("abcabcabc", "hello hello")) + "\n")
    assert script.main(["--model", "tiny:llama", "--prompts", str(prompts), "--max-new-tokens", "16",
                        "--drafters", "lookup; lookup nodes=1 num_candidates=1", "--threads", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| lookup")]
    assert len(rows) == 2
    model, tokenizer = load_model("tiny:llama")
    steps = tokens = 0
    for text in ("abcabcabc", "hello hello"):
        out = decoding.generate(model, make_drafter("lookup", model), encode_prompt(tokenizer, text),
                                max_new_tokens=16, eos_token_id=tokenizer.eos_token_id)
        steps, tokens = steps + out.stats.steps, tokens + out.stats.new_tokens - 1  # the prefill made the first
    assert tokens / steps > 1.2  # the lookup drafted: the comparison is not 1 == 1
    assert float(rows[0].split("|")[2]) == pytest.approx(tokens / steps, abs=0.005)
