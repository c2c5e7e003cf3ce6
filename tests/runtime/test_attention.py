"""selfspec.runtime.attention's grouped-query SDPA: what every CPU backend but ``stock`` puts on an ``sdpa`` model.
Tree forwards (a mask, several queries) attend over the key/value heads without transformers' ``repeat_kv`` copy,
with the same result; plain steps, training and ``stock`` keep transformers' own path."""

from __future__ import annotations

import pytest
import torch
import transformers.integrations.sdpa_attention as hf_sdpa

from decoding.generate import tree_attention_mask
from decoding.tree import DraftTree
from selfspec.runtime import cache as kv
from selfspec.runtime.attention import GQA_SDPA, use_gqa_sdpa
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.tiny import tiny_model


def _tree_forward(model, prefix_ids, tree):
    cache = kv.new_cache(model, 64)
    with torch.inference_mode():
        model(input_ids=prefix_ids, cache=cache, use_cache=True)
        prefix = prefix_ids.shape[1]
        ids = torch.cat([torch.tensor([5]), tree.tokens]).unsqueeze(0)
        positions = (prefix + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])).unsqueeze(0)
        mask = tree_attention_mask(tree, prefix, model.dtype, "cpu")
        return model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3", "gemma", "phi3"])
def test_tree_forward_equals_sdpa_without_copying_heads(arch, monkeypatch):
    model = tiny_model(arch, dtype=torch.float32)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query heads
    tree = DraftTree(torch.tensor([7, 8, 9, 10, 11]), torch.tensor([-1, 0, 0, 1, -1]))
    prefix = torch.arange(3, 20).unsqueeze(0)
    reference = _tree_forward(model, prefix, tree)
    assert use_gqa_sdpa(model) == GQA_SDPA
    copies = []
    repeat_kv = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: copies.append(1) or repeat_kv(*a))
    grouped = _tree_forward(model, prefix, tree)
    assert not copies
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)
    assert use_gqa_sdpa(model, enabled=False) == "sdpa"
    _tree_forward(model, prefix, tree)
    assert copies  # transformers' own path again


def test_backends_switch_attention_and_other_implementations_are_left_alone():
    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "onednn")
    assert model.config._attn_implementation == GQA_SDPA
    set_linear_backend(model, "stock")
    assert model.config._attn_implementation == "sdpa"
    eager = tiny_model("llama", dtype=torch.float32, attn_implementation="eager")
    set_linear_backend(eager, "onednn")
    assert eager.config._attn_implementation == "eager"
    assert GQA_SDPA not in str(model.config.to_dict())  # nothing of it is saved with the model


def test_training_takes_transformers_path(monkeypatch):
    model = tiny_model("llama", dtype=torch.float32)
    use_gqa_sdpa(model)
    copies = []
    repeat_kv = hf_sdpa.repeat_kv
    monkeypatch.setattr(hf_sdpa, "repeat_kv", lambda *a: copies.append(1) or repeat_kv(*a))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    model(input_ids=torch.randint(0, 90, (2, 6)), attention_mask=mask).logits.sum().backward()
    assert copies


def test_a_model_that_refuses_registered_attention_keeps_its_own(monkeypatch):
    model = tiny_model("llama", dtype=torch.float32)

    def refuse(name, *a, **k):
        raise ValueError(f"{name} is not supported by this model")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    assert use_gqa_sdpa(model) == "sdpa"
    assert set_linear_backend(model, "onednn") == "onednn"  # the kernels still apply
    assert model.config._attn_implementation == "sdpa"
