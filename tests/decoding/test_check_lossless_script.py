"""``scripts/check_lossless.py``: the lossless check a lent GPU runs (``scripts/gpu_train_eagle.sh``) passes on the
CPU for every drafter family, and reports a difference when decoding goes wrong."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.testing import load_script


def test_every_family_decodes_like_generate_and_the_summary_says_so(tmp_path, capsys):
    script = load_script("check_lossless")
    assert script.main(["--device", "cpu", "--arch", "llama", "--json", str(tmp_path / "cases.json")]) == 0
    cases = json.loads((tmp_path / "cases.json").read_text())["cases"]
    names = {case["drafter"] for case in cases}
    assert {"eagle (dynamic tree)", "eagle (static tree)", "medusa (sequential)", "early exit", "lookup",
            "eagle+lookup", "lookup|eagle", "random trees holding the answer", "eagle, prompts as one batch"} <= names
    assert all(case["equal"] == case["of"] == len(script.PROMPT_LENGTHS) for case in cases)
    # the oracle trees do exercise deep acceptance (random weights alone accept almost nothing)
    assert next(c for c in cases if c["drafter"] == "random trees holding the answer")["tau"] > 2
    assert "cpu: 27/27 outputs equal to generate" in capsys.readouterr().out


def test_a_decoder_that_goes_wrong_is_reported_and_fails(monkeypatch, capsys):
    script = load_script("check_lossless")
    real = script.generate

    def off_by_one(*args, **kwargs):
        out = real(*args, **kwargs)
        out.sequences = out.sequences.clone()
        out.sequences[0, -1] = (out.sequences[0, -1] + 1) % 96
        return out

    monkeypatch.setattr(script, "generate", off_by_one)
    assert script.main(["--device", "cpu", "--arch", "qwen3"]) == 1
    assert "cases differ" in capsys.readouterr().out


def test_a_batch_that_goes_wrong_is_reported_and_fails(monkeypatch, capsys):
    script = load_script("check_lossless")
    real = script.generate_batch

    def one_row_off(*args, **kwargs):
        out = real(*args, **kwargs)
        out.sequences[1] = out.sequences[1].clone()
        out.sequences[1][0, -1] = (out.sequences[1][0, -1] + 1) % 96
        return out

    monkeypatch.setattr(script, "generate_batch", one_row_off)
    assert script.main(["--device", "cpu", "--arch", "qwen3"]) == 1
    assert "eagle, prompts as one batch    2/3" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without a GPU")
def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    script = load_script("check_lossless")
    with pytest.raises(SystemExit) as exit:
        script.main(["--device", "cuda"])
    assert exit.value.code == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
