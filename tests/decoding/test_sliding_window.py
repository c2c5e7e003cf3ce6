"""Decoders that mix sliding-window layers in by layer type (Gemma 3; Qwen2 with ``use_sliding_window``) decode past
their window losslessly: their sliding layers' caches keep every entry (``selfspec.runtime.cache.new_cache``) and a
verified tree's rows are masked per layer type (``decoding.generate._per_layer_type``). The reference is HF
``generate`` with transformers' own sliding-window cache."""

from __future__ import annotations

import pytest
import torch

from selfspec.runtime import cache as kv
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.tiny import tiny_gemma3
from selfspec.testing import assert_random_trees_decode_losslessly, tiny_model

pytestmark = pytest.mark.xdist_group("skinny")


def sliding_models():
    gemma = tiny_gemma3(window=5)
    qwen2 = tiny_model("qwen2", dtype=torch.float32, use_sliding_window=True, sliding_window=5, max_window_layers=2)
    return {"gemma3": gemma, "qwen2": qwen2}


@pytest.mark.parametrize("name", ["gemma3", "qwen2"])
@pytest.mark.parametrize("backend", ["stock", "skinny"])
def test_trees_verified_past_the_sliding_window_decode_losslessly(name, backend):
    model = sliding_models()[name]
    assert kv.sliding_window_by_layer_type(model) == 5
    set_linear_backend(model, backend)
    cache = kv.new_cache(model, capacity=64)
    assert all(isinstance(layer, kv.BufferedLayer) for layer in cache.layers)  # the sliding ones keep every entry
    # prompts of 3 and 17 tokens, 20 new ones, windows of 5: both cross the window
    assert_random_trees_decode_losslessly(model)
    assert_random_trees_decode_losslessly(model, seeds_and_lengths=((3, 9),), max_new_tokens=40)


def test_models_without_sliding_layer_types_keep_their_caches():
    llama = tiny_model("llama", dtype=torch.float32)
    assert not kv.sliding_window_by_layer_type(llama)
    mistral = tiny_model("mistral", dtype=torch.float32, sliding_window=16)  # one window for every layer, one mask
    assert not kv.sliding_window_by_layer_type(mistral)
    assert not any(isinstance(layer, kv.BufferedLayer) for layer in kv.new_cache(mistral, 8).layers
                   if getattr(layer, "is_sliding", False))


def test_a_ragged_batch_still_refuses_sliding_window_layers():
    from decoding.batch import generate_batch
    from selfspec.testing import RandomDrafter

    model = tiny_gemma3(window=5)
    prompts = [torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 7)]
    with pytest.raises(ValueError, match="sliding-window"):
        generate_batch(model, [RandomDrafter(96, size=3, seed=r) for r in range(2)], prompts, max_new_tokens=4)
