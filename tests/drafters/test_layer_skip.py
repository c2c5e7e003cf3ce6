"""Layer-skip self-drafts: skip-set validation, save/load, the cache, greedy equality, and the skip-set search."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoding.generate import generate
from decoding.registry import make_drafter
from early_exit import DraftPolicy, LayerSkipConfig, LayerSkipDrafter
from early_exit.estimates import calibration_set, chain_speedup
from early_exit.layer_skip import search_skip_layers
from selfspec.runtime.identity import base_model_identity
from selfspec.testing import LLAMA_FAMILY, prefilled_state, random_prompt, snapshot, tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("skip", [[4], [-1], [0, 1, 2, 3]])
def test_bad_skip_sets_are_clear_errors(skip):
    with pytest.raises(ValueError, match="skip"):
        make_drafter("layer-skip", tiny_model("llama"), skip_layers=skip)


def test_unknown_draft_option_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown draft option"):
        make_drafter("layer-skip", tiny_model("llama"), depth=3)


def test_skipping_nothing_drafts_the_full_model():
    """With no layer skipped the draft is the base model itself: every draft token is accepted."""
    model = tiny_model("llama", dtype=torch.float64)
    out = generate(model, LayerSkipDrafter(model, [], DraftPolicy.chain(4)), random_prompt(), max_new_tokens=30)
    assert out.stats.accepted_per_step[:-1] == [4] * (out.stats.steps - 1)


def test_cache_is_unchanged_after_propose():
    model = tiny_model("qwen3", dtype=torch.float64)
    state = prefilled_state(model, random_prompt(9))
    before = snapshot(state.cache)
    tree = LayerSkipDrafter(model, [2], DraftPolicy(max_depth=3, top_k=2, width=2, max_nodes=6)).propose(state)
    assert len(tree) > 1
    for (k0, v0), (k1, v1) in zip(before, snapshot(state.cache)):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


@pytest.mark.parametrize("options", [dict(skip_layers=[2]), dict(skip_layers=[1, 3], max_depth=4, top_k=2)])
@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_greedy_equality(arch, options):
    model = tiny_model(arch, dtype=torch.float64)
    ids = random_prompt(7)
    expected = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=0)
    out = generate(model, make_drafter("layer-skip", model, **options), ids, max_new_tokens=40)
    assert torch.equal(out.sequences, expected)
    assert out.stats.tau > 1.0


def test_config_round_trip_and_identity(tmp_path):
    model = tiny_model("mistral", dtype=torch.float64)
    LayerSkipConfig([3, 1], base_model_identity(model), policy={"max_depth": 3}).save(tmp_path / "skip")
    drafter = make_drafter("layer-skip", model, str(tmp_path / "skip"))
    assert drafter.skip_layers == (1, 3) and drafter.policy.max_depth == 3
    from selfspec.runtime.identity import BaseModelWeightsWarning
    with pytest.warns(BaseModelWeightsWarning, match="other weights"):  # same shapes, other weights: loads
        make_drafter("layer-skip", tiny_model("mistral", dtype=torch.float64, seed=1), str(tmp_path / "skip"))
    with pytest.raises(ValueError, match="trained for"):
        make_drafter("layer-skip", tiny_model("mistral", dtype=torch.float64, hidden_size=64, intermediate_size=64),
                     str(tmp_path / "skip"))
    with pytest.raises(FileNotFoundError):
        make_drafter("layer-skip", model, str(tmp_path / "nothing"))


def test_chain_speedup_model():
    assert chain_speedup(1.0, 0.0, 4) == (5.0, 4)  # a free, perfect draft: as long as allowed
    speedup, k = chain_speedup(0.0, 0.5, 4)
    assert k == 1 and speedup == pytest.approx(1 / 1.5)


def test_search_finds_the_layers_that_do_nothing():
    model = tiny_model("llama", dtype=torch.float64, num_hidden_layers=6)
    with torch.no_grad():
        # Layers 2 and 4 become the identity (zero residual updates): skipping them is free and exact.
        for i in (2, 4):
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    calibration = calibration_set(model, [random_prompt(6, seed=s) for s in range(3)], new_tokens=24)
    skip, metrics = search_skip_layers(model, calibration, max_depth=4, max_skip=4)
    rounds = metrics["rounds"]
    assert [set(r["skip"]) for r in rounds[1:3]] in ([{2}, {2, 4}], [{4}, {2, 4}])
    assert rounds[2]["agreement"] == 1.0 and len(rounds) == 5
    assert {2, 4} <= set(skip) and 0 not in skip
    assert metrics["expected_speedup"] == max(r["speedup"] for r in rounds) > rounds[0]["speedup"]


def test_search_script_saves_a_loadable_set(tmp_path):
    out = tmp_path / "skip"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "search_layer_skip.py"), "--model", "tiny:llama",
                    "--output", str(out), "--num-prompts", "2", "--new-tokens", "16", "--measure-tokens", "16"],
                   check=True, cwd=ROOT, capture_output=True, timeout=300)
    config = LayerSkipConfig.load(out, _tiny_for_script())
    # On a random tiny model skipping rarely pays, so the set may be empty; the record must be complete.
    assert isinstance(config.skip_layers, list) and config.metrics["tau"] >= 1.0
    assert config.policy["max_depth"] == config.metrics["max_depth"]


def _tiny_for_script():
    from selfspec.runtime.models import load_model

    return load_model("tiny:llama", dtype=torch.float32)[0]


def test_agreement_is_exactly_the_first_draft_token():
    """The teacher-forced agreement sees what a real draft sees (the full model's KV of the prefix): scored
    against the drafter's own first tokens at every position, it is exactly 1."""
    from early_exit.estimates import Calibration, agreement

    model = tiny_model("qwen2", dtype=torch.float64)
    calibration = calibration_set(model, [random_prompt(5)], new_tokens=10)
    ids, start = calibration.sequences[0], calibration.starts[0]
    skip = [1, 2]
    drafter = LayerSkipDrafter(model, skip, DraftPolicy.chain(1))
    drafted = calibration.targets[0].clone()
    for t in range(start - 1, ids.shape[1] - 1):
        drafted[t] = drafter.propose(prefilled_state(model, ids[:, :t + 1])).tokens[0]
    kept = [i for i in range(4) if i not in skip]
    head = lambda h: model.lm_head(model.model.norm(h))  # noqa: E731
    as_drafted = Calibration(calibration.sequences, calibration.starts, [drafted], calibration.caches)
    assert agreement(model, as_drafted, kept, head) == 1.0
    assert agreement(model, calibration, kept, head) < 1.0  # and the draft does differ from the full model
