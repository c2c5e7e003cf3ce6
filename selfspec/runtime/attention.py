"""Attention building blocks shared by the draft modules that attend over the base model's states (the Medusa
prefix-attention layer, the early-exit attention adapter): rotary embedding as the Llama family applies it, the
causal mask, and a small KV cache for one layer.
"""

from __future__ import annotations

import torch
from torch import nn

from selfspec.runtime import skinny
from selfspec.runtime.cache import grown_buffers


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
    """Keys and values of one attention layer for the positions seen so far: ``[batch, heads, n, head_dim]``.

    At decode time (no autograd) ``keys`` / ``values`` are views ``[:, :, :n]`` of buffers that grow by doubling, as
    the base model's cache is (``selfspec.runtime.cache.BufferedLayer``): an append writes the new entries after the
    view's end and a crop moves the end, where concatenating copied the whole cache on every draft step (an
    early-exit adapter's 9-head cache at 500 positions: 2.3 MB per append). Appends that autograd records (training
    unrolls) concatenate, so no tensor a backward needs is written in place.
    """

    def __init__(self):
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[b, heads, q, head_dim]`` entries; returns every key and value held now."""
        held = self.length
        recorded = torch.is_grad_enabled() and (keys.requires_grad or values.requires_grad or (
            self.keys is not None and (self.keys.requires_grad or self.values.requires_grad)))
        if recorded:
            self._key_buffer = self._value_buffer = None
            if self.keys is None:
                self.keys, self.values = keys, values
            else:
                self.keys = torch.cat([self.keys, keys], dim=2)
                self.values = torch.cat([self.values, values], dim=2)
            return self.keys, self.values
        end = held + keys.shape[2]
        self._reserve(end, keys, values)
        self._key_buffer[:, :, held:end] = keys
        self._value_buffer[:, :, held:end] = values
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values

    def _reserve(self, needed: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Buffers of at least ``needed`` positions shaped for ``keys`` / ``values``, holding what is held now."""
        buffer = self._key_buffer
        if buffer is not None and buffer.shape[2] >= needed and buffer.shape[:2] == keys.shape[:2] \
                and buffer.shape[3] == keys.shape[3] and buffer.dtype == keys.dtype and buffer.device == keys.device \
                and self._value_buffer.shape[3] == values.shape[3]:
            return
        if self.keys is not None and (self.keys.shape[:2] != keys.shape[:2] or self.keys.shape[3] != keys.shape[3]):
            raise RuntimeError(f"attention cache holds entries of shape {tuple(self.keys.shape)}, cannot append "
                               f"{tuple(keys.shape)}: batch, heads and head size must match")
        held = None if self.keys is None else (self.keys, self.values)
        self._key_buffer, self._value_buffer = grown_buffers(held, needed, keys, values, current=buffer)

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
        self.keys = self.values = self._key_buffer = self._value_buffer = None


# --- The base model's attention on CPU: grouped-query SDPA for masked (tree) forwards ------------------------------

#: The attention implementation ``set_linear_backend`` puts on a CPU model whose attention is ``sdpa``
#: (registered with transformers' ``AttentionInterface`` / ``AttentionMaskInterface`` on import).
GQA_SDPA = "selfspec_gqa_sdpa"


def gqa_sdpa_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs):
    """transformers' ``sdpa`` attention, except that a masked forward with grouped-query heads on the CPU attends
    over the key/value heads as they are (``enable_gqa``) instead of copying them once per query head.

    transformers' own ``sdpa`` copies (``repeat_kv``) whenever a mask is given, which is every tree verification
    and every padded batch; on a 2-core CPU that copy and the 9-head kernel cost about twice the grouped kernel
    (SmolLM2, 8 queries over 264 keys: 149 vs 86 microseconds a layer). Plain decoding (one query, no mask) takes
    transformers' path unchanged. The result is the same attention up to float rounding."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (groups > 1 and attention_mask is not None and query.device.type == "cpu" and not torch.is_grad_enabled()
            and dropout == 0.0 and kwargs.get("softcap") is None and kwargs.get("position_bias") is None
            and kwargs.get("s_aux") is None):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                               scale=scaling, enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


#: The attention of a model on the skinny backend: forwards of a few queries (a decode step, a verified tree, a
#: padded batch's step) on the project's kernel (``skinny.attention``), everything else as ``GQA_SDPA``.
SKINNY_ATTENTION = "selfspec_skinny_attention"
#: Up to this many queries a forward takes the skinny attention kernel (its scores live in a [keys x 16] block).
MAX_SKINNY_QUERIES = 32


def skinny_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs):
    """``gqa_sdpa_attention``, except that a float32 CPU forward of at most ``MAX_SKINNY_QUERIES`` queries, with a
    mask (or a single query, which sees every key) and nothing but a scale on the scores, runs the skinny attention
    kernel: every key/value head read once for all the query rows that share it, no BLAS calls. PyTorch's flash
    kernel costs about 7 us a query on SmolLM2's layers on a 2-core CPU (64 us for 8 queries over 264 keys); this
    one about 3 (27 us). Same attention up to float rounding."""
    batch, _, n, head_dim = query.shape
    if (query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32
            and key.shape[0] == value.shape[0] == batch and value.shape[-1] == key.shape[-1] == head_dim
            and skinny_attention_takes(batch, n, key.shape[-2], head_dim, attention_mask, dropout, kwargs)):
        scale = scaling if scaling is not None else head_dim ** -0.5
        return skinny.attention(query, key, value, attention_mask, scale), None
    return gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                              is_causal=is_causal, **kwargs)


def skinny_attention_takes(batch: int, n: int, keys: int, head_dim: int, mask: torch.Tensor | None,
                           dropout: float = 0.0, kwargs: dict | None = None) -> bool:
    """Whether ``skinny_attention`` runs its kernel for ``n`` float32 CPU queries per batch row over ``keys`` keys
    with ``mask`` (the lean layers' fused call, ``selfspec.runtime.lean``, asks the same): at most
    ``MAX_SKINNY_QUERIES`` queries, no gradients, nothing but a scale on the scores, and a mask of
    ``[1 or batch, 1, n, keys]`` (or none for a single query, which sees every key)."""
    kwargs = kwargs or {}
    return (n <= MAX_SKINNY_QUERIES and not torch.is_grad_enabled() and dropout == 0.0
            and kwargs.get("softcap") is None and kwargs.get("position_bias") is None and kwargs.get("s_aux") is None
            and (n == 1 if mask is None else (
                mask.dim() == 4 and mask.shape[0] in (1, batch) and mask.shape[1] == 1 and mask.shape[2] == n
                and mask.shape[3] == keys and mask.dtype in (torch.bool, torch.float32)
                and mask.device.type == "cpu"))
            and skinny.attention_supported(head_dim))


def _register() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    for name, function in ((GQA_SDPA, gqa_sdpa_attention), (SKINNY_ATTENTION, skinny_attention)):
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)


_register()

#: The inference attentions a drafter's copied layer may switch between to follow its base (``follow_attention``).
_FOLLOWED = ("sdpa", GQA_SDPA, SKINNY_ATTENTION)


def follow_attention(model: nn.Module, config) -> str | None:
    """Give ``config`` (a drafter's layer's, copied from ``model``'s when it was built) the attention
    implementation ``model`` runs now, where both are plain SDPA or one of the project's CPU attentions; any other
    (eager, flash, a training-time one) is left alone. Returns the implementation ``config`` has."""
    base = getattr(getattr(model, "config", None), "_attn_implementation", None)
    own = getattr(config, "_attn_implementation", None)
    if base in _FOLLOWED and own in _FOLLOWED and own != base:
        config._attn_implementation = base
    return config._attn_implementation


_ORIGINAL = "_selfspec_original_attention"


def use_attention(model: nn.Module, implementation: str | None) -> str:
    """Switch a model whose attention is transformers' ``sdpa`` to ``implementation`` (``GQA_SDPA`` or
    ``SKINNY_ATTENTION``; ``None``: back to its own); other implementations (eager, flash, a model without a config)
    are left alone. Returns the implementation now in effect."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current is None or not hasattr(model, "set_attn_implementation"):
        return str(current)
    original = model.__dict__.setdefault(_ORIGINAL, current)
    wanted = implementation if implementation is not None and original == "sdpa" else original
    if current != wanted:
        try:
            model.set_attn_implementation(wanted)
        except (ValueError, ImportError, NotImplementedError):  # a model that takes no registered attention
            return str(current)
    return wanted


def use_gqa_sdpa(model: nn.Module, enabled: bool = True) -> str:
    """``use_attention(model, GQA_SDPA if enabled else None)``."""
    return use_attention(model, GQA_SDPA if enabled else None)
