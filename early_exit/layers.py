"""Run a chosen subset of a stock HF decoder's layers on draft tokens, writing their KV into the shared base cache.

Both self-drafts here are partial forwards of the base model itself: early exit runs ``layers[:E]``, layer skipping
runs every layer but a chosen set. The KV entries the draft appends to the base ``DynamicCache`` are cropped back by
:func:`crop_layers` before the draft tree is handed to verification, so the base cache never sees them.

The decoder layers are driven through their public ``forward`` (hidden states, 4D additive mask, position ids,
rotary embeddings, ``Cache``): no patched modeling code.
"""

from __future__ import annotations

from typing import Sequence

import torch

# Decoders whose layout is ``model.model.{embed_tokens, layers, norm, rotary_emb}`` + ``model.lm_head``, with
# un-scaled embeddings and one shared rotary embedding: what run_layers assumes.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3")


def check_supported(model) -> None:
    """Fail early, with the reason, on a model the partial forward cannot drive correctly.

    Raises:
        ValueError: unsupported architecture, or a model with sliding-window attention layers (their cache drops
            old entries, which the crop-back of the draft cannot undo).
    """
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"early-exit / layer-skip drafts support the Llama family ({', '.join(SUPPORTED_MODEL_TYPES)}); "
            f"got model_type {model_type!r}. Use the Medusa drafter for other architectures."
        )
    layer_types = getattr(config, "layer_types", None) or ()
    sliding = any(t == "sliding_attention" for t in layer_types)
    if model_type == "mistral" and getattr(config, "sliding_window", None):
        sliding = True
    if sliding:
        raise ValueError(
            f"{model_type} model with sliding-window attention: early-exit / layer-skip drafts need full-attention "
            "layers (a sliding cache cannot be cropped back after drafting)"
        )


def run_layers(model, layer_ids: Sequence[int], input_ids: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None, cache) -> torch.Tensor:
    """Embed ``input_ids`` ``[1, q]`` and run decoder layers ``layer_ids`` in order; returns ``[1, q, hidden]``
    before any final norm. Each layer appends the new tokens' KV to ``cache`` (its own layer index)."""
    decoder = model.model
    hidden = decoder.embed_tokens(input_ids)
    position_embeddings = decoder.rotary_emb(hidden, position_ids=position_ids)
    for i in layer_ids:
        out = decoder.layers[i](hidden, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                                use_cache=True, position_embeddings=position_embeddings)
        # Decoder layers return a tensor in transformers 5; some remote-code layers still return a tuple.
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def additive_mask(allowed: torch.Tensor, prefix_length: int, dtype: torch.dtype) -> torch.Tensor:
    """``[1, 1, q, prefix + k]`` additive mask: every query sees the whole cached prefix, and among the ``k`` draft
    positions after it only those ``allowed`` ``[q, k]`` marks (its ancestors and itself)."""
    q, k = allowed.shape
    keep = torch.cat([torch.ones(q, prefix_length, dtype=torch.bool, device=allowed.device), allowed], dim=1)
    mask = torch.zeros(q, prefix_length + k, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~keep, torch.finfo(dtype).min)
    return mask[None, None]


def cache_layer_length(cache, layer_idx: int) -> int:
    return cache.get_seq_length(layer_idx)


def crop_layers(cache, layer_ids: Sequence[int], length: int) -> None:
    """Drop whatever the draft appended to ``layer_ids`` of ``cache`` beyond ``length`` tokens.

    Raises:
        RuntimeError: a layer is shorter than ``length`` (the draft removed entries it did not add).
    """
    for i in layer_ids:
        extra = cache.get_seq_length(i) - length
        if extra < 0:
            raise RuntimeError(f"cache layer {i} holds fewer tokens than before drafting ({length + extra} < {length})")
        if extra:
            # transformers 5 crops by a negative count of tokens to remove.
            cache.layers[i].crop(-extra)
