"""KV-cache rollback: after a verification, keep exactly the prefix plus the accepted path.

One function serves every drafter. It works on transformers' ``DynamicCache`` layers (``layer.keys`` /
``layer.values`` of shape ``[batch, kv_heads, seq, head_dim]``) through their public tensors.
"""

from __future__ import annotations

import torch


def _layers(cache):
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"unsupported cache type {type(cache).__name__}: selfspec needs a transformers Cache with .layers")
    return layers


def cache_length(cache) -> int:
    return cache.get_seq_length()


def keep_accepted(cache, prefix_length: int, accepted: list[int], layers: range | None = None) -> None:
    """Shrink the cache to ``prefix_length`` entries, then the root and the accepted draft nodes.

    The verification forward appended the root at ``prefix_length`` and node ``i`` at ``prefix_length + 1 + i``.
    When the accepted nodes are ``0..k-1`` (always the case for chains) this is a plain crop; otherwise the accepted
    entries are gathered into place first. ``layers`` restricts the operation to some layer indices (a shallow
    drafter only ever writes its own layers).

    Raises:
        NotImplementedError: on a sliding-window layer that has already dropped old entries.
    """
    all_layers = _layers(cache)
    selected = range(len(all_layers)) if layers is None else layers
    k = len(accepted)
    new_length = prefix_length + 1 + k
    contiguous = accepted == list(range(k))
    if not contiguous:
        source = torch.tensor(accepted, dtype=torch.long) + (prefix_length + 1)
    for index in selected:
        layer = all_layers[index]
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        if getattr(layer, "is_sliding", False) and getattr(layer, "cumulative_length", layer.keys.shape[-2]) != layer.keys.shape[-2]:
            raise NotImplementedError(
                "tree verification past a sliding window is not supported yet; use a prompt + max_new_tokens "
                "shorter than the model's sliding window"
            )
        keys, values = layer.keys, layer.values
        if not contiguous:
            src = source.to(keys.device)
            keys[:, :, prefix_length + 1:new_length] = keys.index_select(2, src)
            values[:, :, prefix_length + 1:new_length] = values.index_select(2, src)
        layer.keys = keys[:, :, :new_length]
        layer.values = values[:, :, :new_length]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = new_length


def crop(cache, length: int, layers: range | None = None) -> None:
    """Drop every entry from position ``length`` on (in ``layers``, default all)."""
    all_layers = _layers(cache)
    for index in range(len(all_layers)) if layers is None else layers:
        layer = all_layers[index]
        if not getattr(layer, "is_initialized", True) or layer.keys is None or layer.keys.numel() == 0:
            continue
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = min(layer.cumulative_length, length)
