"""scripts/draft_vocab_coverage.py: the share of trained tokens a draft vocabulary holds, for a saved drafter, the
vocabulary extended from it and the most frequent tokens of other data, on a tiny model."""

from __future__ import annotations

import json

import pytest
import torch

from eagle.model import EagleConfig, EagleDraftModel, save_pretrained
from selfspec.runtime.identity import base_model_identity
from selfspec.runtime.models import load_model
from selfspec.testing import load_script, repetitive_conversations


@pytest.fixture(scope="module")
def script():
    return load_script("draft_vocab_coverage")


def test_coverage_counts_trained_tokens_only(script):
    examples = [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [2, 9], "loss_mask": [1, 1]}]
    assert script.coverage(torch.tensor([1, 2]), examples) == pytest.approx(2 / 5)  # 2, 2 of 2, 3, 4, 2, 9
    assert script.coverage(torch.tensor([2, 3, 4, 9]), examples) == 1.0


def test_saved_extended_and_frequent_vocabularies_on_held_out_data(script, tmp_path, capsys):
    model, _ = load_model("tiny:llama")
    vocab = model.config.vocab_size
    chat = repetitive_conversations(tmp_path / "chat.jsonl", 8)
    code = repetitive_conversations(tmp_path / "code.jsonl", 8, seed=3, words=["QUIZ", "JAVA", "#{}", "~|^", "XY"])
    config = EagleConfig(hidden_size=model.config.hidden_size, vocab_size=vocab, draft_vocab_size=32, aux_layers=[1],
                         base_model=base_model_identity(model))
    saved = torch.arange(32)  # ids no text of either corpus uses much
    save_pretrained(EagleDraftModel(config, model, saved), tmp_path / "heads")
    out = script.main(["--model", "tiny:llama", "--heads", str(tmp_path / "heads"), "--train", str(code),
                       "--held", str(code), "--held", str(chat), "--sizes", f"32,64,{vocab}", "--json",
                       str(tmp_path / "c.json")])
    table = out["coverage"]
    assert json.loads((tmp_path / "c.json").read_text())["coverage"] == table
    assert table["saved (32)"][str(code)] < 0.5  # the saved ids hold little of either corpus
    extended = table["saved + most frequent it lacks (64)"][str(code)]
    assert extended == 1.0 and table[f"most frequent ({vocab})"][str(chat)] == 1.0
    # counted on the code corpus: a vocabulary that holds all of it holds less of the chat corpus
    assert table["most frequent (32)"][str(chat)] < table["most frequent (32)"][str(code)] == 1.0
    assert "saved + most frequent it lacks (64)" in capsys.readouterr().out
