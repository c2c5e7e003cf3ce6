"""Attention building blocks shared by the draft modules that attend over the base model's states (the Medusa
prefix-attention layer, the early-exit attention adapter): rotary embedding as the Llama family applies it, the
causal mask, and a small KV cache for one layer.
"""

from __future__ import annotations

import torch
from torch import nn


def rotary_of(model: nn.Module) -> nn.Module | None:
    """The base model's rotary embedding module (``rotary_emb(x, position_ids) -> (cos, sin)``), or ``None`` for a
    model without one (GPT-2's learned positions)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return getattr(decoder, "rotary_emb", None)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as the Llama family applies it (rotate-half) to ``x`` ``[b, heads, q, head_dim]``, on the first
    ``cos.shape[-1]`` dims of each head (``cos`` / ``sin``: ``[b, q, rot]``)."""
    rot = cos.shape[-1]
    cos, sin = cos[:, None], sin[:, None]  # [b, 1, q, rot]: broadcast over heads
    rotated = x[..., :rot] * cos + rotate_half(x[..., :rot]) * sin
    return rotated if rot == x.shape[-1] else torch.cat([rotated, x[..., rot:]], dim=-1)


def causal_mask(query_positions: torch.Tensor, key_length: int, padding: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
    """``[b, 1, q, k]`` additive mask: query at absolute position ``p`` sees keys ``0..p``, minus padded keys.

    ``padding``: ``[b, k]`` with 1 for real tokens (the whole key range), or None.
    """
    keys = torch.arange(key_length, device=query_positions.device)
    keep = keys[None, None, :] <= query_positions[:, :, None]  # [b, q, k]
    if padding is not None:
        keep = keep & padding[:, None, :].bool()
    mask = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    mask.masked_fill_(~keep, torch.finfo(dtype).min)
    return mask[:, None]


class LayerCache:
    """Keys and values of one attention layer for the positions seen so far: ``[batch, heads, n, head_dim]``."""

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[b, heads, q, head_dim]`` entries; returns every key and value held now."""
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions.

        Raises:
            RuntimeError: the cache holds fewer than ``length`` positions.
        """
        if length > self.length:
            raise RuntimeError(f"attention cache holds {self.length} positions, cannot crop to {length}")
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]

    def reset(self) -> None:
        self.keys = self.values = None
