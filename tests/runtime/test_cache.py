"""selfspec.runtime.cache: the buffered cache layers the decode loop uses behave exactly like transformers' DynamicLayer
(same tensors after every update, crop and tree rollback; same logits from the stock modeling code), without
reallocating while they fit."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from selfspec.runtime.cache import BufferedLayer, crop, keep_accepted, new_cache
from selfspec.testing import ARCHITECTURES, tiny_model


def _states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, n, 4, generator=g), torch.randn(1, 2, n, 4, generator=g)


def test_buffered_layer_tracks_a_dynamic_layer_through_updates_crops_and_rollbacks():
    buffered, plain = BufferedLayer(capacity=8), DynamicLayer()
    lengths = [5, 1, 4, 3, 9, 2, 30]  # the 9 and the 30 overflow the buffer: it must grow and keep the prefix
    for step, n in enumerate(lengths):
        k, v = _states(n, step)
        for layer in (buffered, plain):
            keys, values = layer.update(k, v)
        assert torch.equal(buffered.keys, plain.keys) and torch.equal(buffered.values, plain.values)
        assert torch.equal(keys, plain.keys) and buffered.get_seq_length() == plain.get_seq_length()
        if step % 2:  # a tree step: keep the prefix, the root and some accepted nodes, out of order
            prefix = plain.keys.shape[-2] - n
            accepted = sorted({0, n // 2, n - 2} - {-1}) if n > 2 else []
            for layer in (buffered, plain):
                cache = type("C", (), {"layers": [layer]})()
                keep_accepted(cache, prefix, [a for a in accepted if a + 1 < n])
            assert torch.equal(buffered.keys, plain.keys) and torch.equal(buffered.values, plain.values)
    assert buffered._key_buffer.shape[-2] >= buffered.keys.shape[-2] > 8
    cache = type("C", (), {"layers": [buffered, plain]})()
    crop(cache, 3)
    assert torch.equal(buffered.keys, plain.keys) and buffered.keys.shape[-2] == 3


def test_no_reallocation_while_the_capacity_suffices():
    layer = BufferedLayer(capacity=64)
    layer.update(*_states(10, 0))
    buffer = layer._key_buffer
    for step in range(20):
        layer.update(*_states(2, step + 1))
        crop(type("C", (), {"layers": [layer]})(), 10 + step + 1)
    assert layer._key_buffer is buffer and layer.keys.data_ptr() == buffer.data_ptr()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_stock_forward_with_the_buffered_cache_gives_the_same_logits(arch):
    model = tiny_model(arch, dtype=torch.float64)
    ids = torch.randint(0, model.config.vocab_size, (1, 19), generator=torch.Generator().manual_seed(3))
    plain, buffered = DynamicCache(config=model.config), new_cache(model, capacity=12)
    assert any(isinstance(layer, BufferedLayer) for layer in buffered.layers) or not buffered.layers
    with torch.no_grad():
        for start, end in [(0, 7), (7, 8), (8, 12), (12, 19)]:
            chunk = ids[:, start:end]
            a = model(input_ids=chunk, cache=plain, use_cache=True).logits
            b = model(input_ids=chunk, cache=buffered, use_cache=True).logits
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert buffered.get_seq_length() == plain.get_seq_length() == 19


@pytest.mark.xdist_group("skinny")
def test_rollback_in_one_extension_call_equals_the_tensor_ops():
    """With the skinny extension loaded, ``keep_accepted`` on buffered layers is one call (``skinny.keep_entries``):
    the same entries and views as the tensor ops on transformers' own layers, for chains, out-of-order paths,
    nothing accepted and batches; a path that does not ascend goes the tensor way."""
    from selfspec.runtime import skinny

    if not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.unavailable_reason()}")
    calls = []
    real = skinny.keep_entries
    gen = torch.Generator().manual_seed(3)
    for batch, accepted in ((1, [0, 1, 2]), (1, [1, 4, 5]), (2, [2, 3]), (1, []), (3, [0, 3, 6]), (1, [3, 1])):
        buffered = [BufferedLayer(capacity=4) for _ in range(3)]  # grows past 4 entries
        plain = [DynamicLayer() for _ in range(3)]
        for step, n in enumerate((9, 8)):
            states = [(torch.randn(batch, 2, n, 8, generator=gen), torch.randn(batch, 2, n, 8, generator=gen))
                      for _ in range(3)]
            for layers in (buffered, plain):
                for layer, (k, v) in zip(layers, states):
                    layer.update(k, v)
        skinny.keep_entries = lambda *a: calls.append(a[3]) or real(*a)
        try:
            for layers in (buffered, plain):
                keep_accepted(type("C", (), {"layers": layers})(), 9, accepted)
        finally:
            skinny.keep_entries = real
        for b, p in zip(buffered, plain):
            assert torch.equal(b.keys, p.keys) and torch.equal(b.values, p.values)
            assert b.keys.shape[-2] == 10 + len(accepted) and b.keys.data_ptr() == b._key_buffer.data_ptr()
    assert calls == [[0, 1, 2], [1, 4, 5], [2, 3], [], [0, 3, 6]]  # not the descending path


@pytest.mark.xdist_group("skinny")
def test_argmax_in_one_pass_is_torch_max_indices():
    """``skinny.argmax_rows`` (greedy verification's argmax) gives ``max(dim=-1).indices``: the first maximal column
    across vector lanes and tails, the first NaN where a row has one, column 0 for a row of -inf."""
    from decoding.verify import _argmax
    from selfspec.runtime import skinny

    if not skinny.available():
        pytest.skip(f"the skinny kernel does not build here: {skinny.unavailable_reason()}")
    gen = torch.Generator().manual_seed(4)
    rows = [torch.randn(3, 49152, generator=gen), torch.randn(2, 7, generator=gen), torch.randn(4, 37, generator=gen)]
    ties = torch.zeros(2, 100)
    ties[0, [17, 50, 99]] = 5.0  # equal maxima in different lanes and in the tail
    ties[1, [96, 97]] = 1.0
    nans = torch.randn(3, 70, generator=gen)
    nans[0, 40], nans[0, 66], nans[1, 69] = float("nan"), float("nan"), float("nan")
    nans[2] = float("-inf")
    for x in (*rows, ties, nans, torch.round(torch.randn(5, 333, generator=gen))):  # many ties
        assert torch.equal(skinny.argmax_rows(x), x.max(dim=-1).indices), x.shape
        assert torch.equal(_argmax(x), x.max(dim=-1).indices)
