"""The committed EAGLE-3 drafter on the embedded SmolLM2: it loads (checksums, base identity), decodes greedily
token-for-token like the model's own ``generate`` alone and merged with lookup, and really drafts (tau > 1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from decoding.registry import make_drafter
from selfspec.testing import assert_decodes_like_references, hf_greedy_continuations

pytestmark = [pytest.mark.real_model, pytest.mark.xdist_group("real_model")]

HEADS = Path(__file__).resolve().parents[2] / "heads" / "smollm2-135m-instruct-eagle3"
PROMPTS = ("Write a haiku about the sea.", "What is 12 times 7?")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def references(smollm2) -> dict[str, list[list[int]]]:
    return hf_greedy_continuations(*smollm2, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("spec, options", [("eagle", {}), ("eagle", {"nodes": 8, "top_k": 4, "width": 4}),
                                           ("eagle+lookup", {})])
def test_committed_drafter_decodes_like_generate(smollm2, references, spec, options):
    drafter = make_drafter(spec, smollm2[0], str(HEADS), **options)
    taus = assert_decodes_like_references(*smollm2, drafter, references, NEW_TOKENS)
    assert sum(taus) / len(taus) > 1.1, taus


def test_the_card_names_the_data_and_the_command():
    config = json.loads((HEADS / "config.json").read_text())
    training = config["training"]
    # trained on a GPU on distill-smollm2-v1, then continued (init_from) on the broader self-distilled set
    assert "distill-smollm2-v1" in training["data"] and "distill-broad" in training["data"]
    assert "gpu_train_eagle.sh" in training["previous_command"] and "init_from=" in training["command"]
    assert len(config["accuracy"]) == training["recipe"]["ttt_steps"] and config["accuracy"][0] > 0.4
    card = (HEADS / "README.md").read_text()
    assert "Held-out acceptance per depth" in card and "selfspec generate --draft eagle" in card
