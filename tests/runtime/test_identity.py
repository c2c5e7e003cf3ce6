"""selfspec.runtime.identity: recognising a base model again, and refusing heads trained for another one."""

from __future__ import annotations

import copy
import json
import time

import pytest
import torch

from selfspec.runtime.identity import BaseModelMismatchError, base_model_identity, check_base_model
from selfspec.testing import tiny_model


def test_identity_fields(tiny_arch):
    model = tiny_model(tiny_arch)
    identity = base_model_identity(model)
    assert identity["architecture"] == type(model).__name__
    assert identity["model_type"] == tiny_arch
    assert (identity["hidden_size"], identity["vocab_size"], identity["num_hidden_layers"]) == (32, 96, 4)
    assert identity["dtype"] == "float32" and len(identity["fingerprint"]) == 16
    assert json.loads(json.dumps(identity)) == identity  # saved as is in the heads' config.json
    check_base_model(identity, model)


def test_fingerprint_is_deterministic_and_tells_weights_apart():
    same = base_model_identity(tiny_model("llama", seed=0))["fingerprint"]
    assert base_model_identity(tiny_model("llama", seed=0))["fingerprint"] == same
    assert base_model_identity(tiny_model("llama", seed=1))["fingerprint"] != same


def test_fine_tuning_one_layer_changes_the_fingerprint():
    model = tiny_model("llama")
    expected = base_model_identity(model)
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.model.layers[-1].mlp.down_proj.weight.add_(1e-4)  # a small update, in one tensor only
    with pytest.raises(BaseModelMismatchError, match="weights differ"):
        check_base_model(expected, tuned)


def test_same_weights_in_another_dtype_pass_and_other_weights_do_not():
    expected = base_model_identity(tiny_model("llama"))
    check_base_model(expected, tiny_model("llama").to(torch.bfloat16))
    check_base_model(expected, tiny_model("llama").to(torch.float16))
    with pytest.raises(BaseModelMismatchError, match="weights differ"):
        check_base_model(expected, tiny_model("llama", seed=1).to(torch.bfloat16))


def test_precision_change_near_ties_and_underflow_still_matches():
    # Values that bf16 rounds onto the same magnitude with opposite signs, and ones float16 flushes to zero:
    # a sample that picks elements by value, or compares each value relatively, would call these different.
    model = tiny_model("llama")
    with torch.no_grad():
        for p in model.parameters():
            p.view(-1)[:8] = torch.tensor([0.50012, -0.50024, 1e-9, -3e-8, 0.25003, -0.25001, 2e-7, 0.1])
    expected = base_model_identity(model)
    for dtype in (torch.bfloat16, torch.float16):
        check_base_model(expected, copy.deepcopy(model).to(dtype))


def test_vocab_mismatch_is_named_with_both_sizes_and_the_fix():
    expected = base_model_identity(tiny_model("llama"))
    with pytest.raises(BaseModelMismatchError) as info:
        check_base_model(expected, tiny_model("llama", vocab_size=128), what="Medusa heads")
    message = str(info.value)
    assert "vocab_size 96 vs 128" in message
    assert "these Medusa heads were trained for" in message and "retrain" in message
    assert "hidden_size 32 vs" not in message


def test_hidden_size_mismatch_is_named():
    expected = base_model_identity(tiny_model("llama"))
    with pytest.raises(BaseModelMismatchError, match="hidden_size 32 vs 64"):
        check_base_model(expected, tiny_model("llama", hidden_size=64, intermediate_size=64))


def test_architecture_mismatch_is_named():
    expected = base_model_identity(tiny_model("llama"))
    with pytest.raises(BaseModelMismatchError, match="architecture 'LlamaForCausalLM' vs 'Qwen2ForCausalLM'"):
        check_base_model(expected, tiny_model("qwen2"))


def test_name_alone_does_not_decide():
    model = tiny_model("llama")
    expected = {**base_model_identity(model), "name_or_path": "somewhere/else"}
    check_base_model(expected, model)


def test_partial_identity_checks_only_what_it_has():
    model = tiny_model("llama")
    check_base_model({"vocab_size": 96}, model)
    with pytest.raises(BaseModelMismatchError, match="weights differ"):
        check_base_model({"name_or_path": "x", "fingerprint": "abc"}, model)


@pytest.mark.real_model
@pytest.mark.xdist_group("real_model")
def test_identity_of_smollm2_is_cheap(smollm2):
    model, _ = smollm2
    base_model_identity(model)  # warm-up: first touches of the weights page them in
    start = time.perf_counter()
    identity = base_model_identity(model)
    elapsed = time.perf_counter() - start
    assert elapsed < 0.05, f"fingerprint took {elapsed * 1000:.1f} ms"
    assert identity["name_or_path"] == "smollm2-135m-instruct"
    assert (identity["hidden_size"], identity["vocab_size"], identity["num_hidden_layers"]) == (576, 49152, 30)
