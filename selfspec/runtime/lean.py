"""A lean decoder-layer forward for Llama-family models on the skinny backend.

On a 2-core CPU a decode step of SmolLM2 spent ~4 ms of ~17 between its kernels: twelve module calls a layer, the
linear wrappers' per-call checks, and ~25 small tensor ops (RMSNorm alone is seven on the CPU, rotary five a
projection, SwiGLU and the residual adds three more). ``use_lean_layers(model)`` gives each supported decoder layer
a ``forward`` that does the same computation on the skinny extension alone: the layer's linears called straight on
their packed weights with the residual added in the kernel's epilogue, and one pass each for RMSNorm, rotary (in
place) and silu(gate) * up (``skinny.rms_norm``, ``skinny.rope_``, ``skinny.silu_mul_``); transformers' own
attention interface and cache ``update`` stay. Every one of those computes each row on its own, the same way
whatever the row count, so a verified tree's rows get bitwise what one-token steps get (what lossless verification
rests on). It takes a call only when every part of it applies (no gradients, float32 on the CPU, at most
``skinny.MAX_ROWS`` rows, every linear on the skinny kernel with its weights packed as they are now, full-width
rotary); anything else (prefill, training, a LoRA-wrapped projection, ``output_attentions``) runs the layer class's
own ``forward``. Results are the model's up to float rounding (summation order, exp), the same class of difference
as the kernels themselves.

Supported: ``llama``, ``mistral`` and ``qwen2`` decoder layers with SiLU MLPs (the layer structure is checked too),
with transformers 5.25 or later (``MIN_TRANSFORMERS``).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from selfspec.runtime import skinny

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: The layers' forward mirrors these transformers versions' (5.25 on: ``cache.update(..., kwargs=...)``, the
#: attention interface's ``get_interface``); older ones keep their own layers. tests/runtime/test_lean.py compares
#: the two on the installed version.
MIN_TRANSFORMERS = (5, 25)
_LEAN = "_selfspec_lean_forward"


def _transformers_version() -> tuple[int, int]:
    import transformers

    major, minor = (transformers.__version__.split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    # through ``_modules``: ``nn.Module.__getattr__`` costs ~1 us a lookup, and this runs on every layer call
    attn, mlp = layer._modules["self_attn"]._modules, layer._modules["mlp"]._modules
    return (attn["q_proj"], attn["k_proj"], attn["v_proj"], attn["o_proj"], mlp["gate_proj"], mlp["up_proj"],
            mlp["down_proj"])


def supported(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of ``model`` a lean forward can stand in for (empty for other architectures)."""
    config = getattr(model, "config", None)
    if (getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES or getattr(config, "hidden_act", None) != "silu"
            or _transformers_version() < MIN_TRANSFORMERS):
        return []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = list(getattr(decoder, "layers", []) or [])
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
        if (attn is None or mlp is None or any(not hasattr(n, "variance_epsilon") for n in norms)
                or hasattr(attn, "q_norm") or not all(hasattr(attn, a) for a in ("head_dim", "scaling", "layer_idx"))
                or not all(isinstance(m, nn.Linear) for m in _linears(layer))):
            return []
    return layers


def use_lean_layers(model: nn.Module, enabled: bool = True) -> int:
    """Give every supported decoder layer of ``model`` the lean forward (``enabled``) or its class's back; returns how
    many layers have it now."""
    layers = supported(model)
    for layer in layers:
        if enabled:
            layer.forward = layer.__dict__.setdefault(_LEAN, _LeanForward(layer))
        elif isinstance(layer.__dict__.get("forward"), _LeanForward):
            del layer.forward
    return len(layers) if enabled else 0


class _LeanForward:
    """A decoder layer's ``forward`` (see the module docstring); ``calls`` counts the calls it took itself."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.calls = 0
        self.passes_window = getattr(layer.self_attn.config, "model_type", None) in ("mistral", "qwen2")
        from selfspec.runtime.kernels import _SkinnyLinear  # kernels imports this module

        self.skinny_linear = _SkinnyLinear  # resolved once, not on every layer call

    def _fallback(self, *args, **kwargs):
        return type(self.layer).forward(self.layer, *args, **kwargs)

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs):
        layer = self.layer
        shape = hidden_states.shape
        rows = shape[0] * shape[1] if hidden_states.dim() == 3 else 0
        linears = _linears(layer)
        kernels = [m.__dict__.get("forward") for m in linears]
        if (torch.is_grad_enabled() or layer.training or hidden_states.dtype != torch.float32
                or hidden_states.device.type != "cpu" or not 0 < rows <= skinny.MAX_ROWS or position_embeddings is None
                or kwargs.get("output_attentions") or not all(isinstance(k, self.skinny_linear) for k in kernels)
                or not all(k._current(m._parameters["weight"], m._parameters.get("bias"))
                           for k, m in zip(kernels, linears))):
            return self._fallback(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        name = layer.self_attn.config._attn_implementation
        get_interface = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)  # older 5.x: a plain mapping
        interface = get_interface(name, None) if get_interface else ALL_ATTENTION_FUNCTIONS.get(name)
        if interface is None:  # eager attention: transformers' own function, through the class forward
            return self._fallback(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        q_k, k_k, v_k, o_k, gate_k, up_k, down_k = kernels
        q_m, k_m, v_m, o_m, gate_m, up_m, down_m = linears
        attn = layer.self_attn
        batch, n, hidden = shape
        d = attn.head_dim
        cos, sin = position_embeddings
        if cos.shape[-1] != d:  # partial rotary: not this forward's
            return self._fallback(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        self.calls += 1

        def linear(x, kernel, module, residual=None):
            return skinny.linear(x, kernel._weight, module.out_features, module._parameters.get("bias"), residual)

        residual = hidden_states.reshape(rows, hidden).contiguous()
        norm = layer.input_layernorm
        x = skinny.rms_norm(residual, norm.weight, norm.variance_epsilon)
        cos, sin = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
        q = skinny.rope_(linear(x, q_k, q_m), cos, sin, d).view(batch, n, -1, d).transpose(1, 2)
        k = skinny.rope_(linear(x, k_k, k_m), cos, sin, d).view(batch, n, -1, d).transpose(1, 2)
        v = linear(x, v_k, v_m).view(batch, n, -1, d).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, attn.layer_idx, kwargs=kwargs)
        if self.passes_window:  # as Mistral's and Qwen2's attention pass it (only flash attention reads it)
            kwargs = {**kwargs, "sliding_window": getattr(attn, "sliding_window",
                                                          getattr(attn.config, "sliding_window", None))}
        out, _ = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
        h = linear(out.reshape(rows, -1), o_k, o_m, residual)
        norm = layer.post_attention_layernorm
        y = skinny.rms_norm(h, norm.weight, norm.variance_epsilon)
        gated = skinny.silu_mul_(linear(y, gate_k, gate_m), linear(y, up_k, up_m))
        return linear(gated, down_k, down_m, h).view(shape)


__all__ = ["SUPPORTED_MODEL_TYPES", "supported", "use_lean_layers"]
