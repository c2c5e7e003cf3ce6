"""``LayerCache``, the one-layer KV cache of the drafters that attend (Medusa prefix attention, the early-exit
attention adapter, the feature drafter's layer): buffered at decode time, concatenating under autograd."""

import pytest
import torch

from selfspec.runtime.attention import LayerCache


def test_appends_and_crops_hold_what_concatenation_holds():
    gen = torch.Generator().manual_seed(0)
    cache, keys, values = LayerCache(), torch.empty(1, 3, 0, 8), torch.empty(1, 3, 0, 5)
    buffers = set()
    with torch.no_grad():
        for step in range(200):
            if step % 3 == 2 and keys.shape[2]:
                keep = int(torch.randint(0, keys.shape[2] + 1, (1,), generator=gen))
                cache.crop(keep)
                keys, values = keys[:, :, :keep], values[:, :, :keep]
            else:
                q = int(torch.randint(1, 40, (1,), generator=gen))
                k, v = torch.randn(1, 3, q, 8, generator=gen), torch.randn(1, 3, q, 5, generator=gen)
                got_k, got_v = cache.append(k, v)
                keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
                assert torch.equal(got_k, keys) and torch.equal(got_v, values)
                buffers.add(cache._key_buffer.data_ptr())
            assert cache.length == keys.shape[2]
            assert torch.equal(cache.keys, keys) and torch.equal(cache.values, values)
    assert len(buffers) < 10  # grown by doubling, not reallocated per append


def test_recorded_appends_concatenate_and_backpropagate():
    weight = torch.randn(4, 4, requires_grad=True)
    cache = LayerCache()
    first = torch.randn(1, 2, 3, 4) @ weight
    cache.append(first, first)
    second = torch.randn(1, 2, 2, 4) @ weight
    keys, values = cache.append(second, second)
    assert keys.shape == (1, 2, 5, 4) and keys.requires_grad
    (keys.sum() + values.sum()).backward()  # nothing written in place under autograd
    assert weight.grad is not None


def test_a_mismatched_append_and_an_overlong_crop_are_refused():
    cache = LayerCache()
    with torch.no_grad():
        cache.append(torch.zeros(1, 3, 4, 8), torch.zeros(1, 3, 4, 8))
        with pytest.raises(RuntimeError, match="heads and head size must match"):
            cache.append(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
    with pytest.raises(RuntimeError, match="cannot crop to 9"):
        cache.crop(9)
    cache.reset()
    assert cache.length == 0 and cache.keys is None
