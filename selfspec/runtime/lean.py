"""A lean decoder-layer forward for Llama-family models (and Gemma 3) on the skinny backend.

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

Where a layer's keys and values go to one of the project's buffered cache layers (``selfspec.runtime.cache``) and its
attention is the skinny kernel's, the whole layer runs as one extension call instead (``fused_block`` ->
``skinny.decoder_layer``: the same functions on the same inputs in the same order, so bitwise what the twelve calls
give, without the Python between them; a feature drafter's draft layer takes it too). ``FUSED_LAYERS = False``
turns that off, for comparisons (``scripts/forward_ab.py --compare fused``).

Where every layer of a Llama, Mistral or Qwen2 decoder would run as that one call, the decoder runs all of them as one
(``_LeanStack`` -> ``skinny.DecoderStack``, built once over the layers' packed weights and rebuilt when one changes):
the per-layer Python (a module call with its hooks, seven kernel checks, the attention check, the cache bookkeeping:
~30 us a layer) and transformers' layer loop go, and a plain SmolLM2 step on a 2-core Xeon went from 9.5-10.3 ms
to 7.3-7.5. The embedding, mask, rotary embedding and final norm stay the model's own; logits, hidden states and
cache entries are bitwise the per-layer path's (tested). ``FUSED_STACK = False`` turns it off.

Supported: ``llama``, ``mistral`` and ``qwen2`` decoder layers with SiLU MLPs (the layer structure is checked too),
and Gemma 3's text layers with a forward of their own (``_LeanGemma3Forward``: six ``1 + w`` norms, per-head q/k
norms, tanh GELU; per layer, no one-call path), with transformers 5.25 or later (``MIN_TRANSFORMERS``).
"""

from __future__ import annotations

import sys
from operator import attrgetter, is_, itemgetter, methodcaller

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from selfspec.runtime import skinny
from selfspec.runtime.attention import skinny_attention, skinny_attention_takes
from selfspec.runtime.cache import BufferedLayer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
#: Gemma 3's text decoder (``Gemma3ForCausalLM``): a lean forward of its own (``_LeanGemma3Forward``), per layer
GEMMA3_MODEL_TYPES = ("gemma3_text",)
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
    if getattr(config, "model_type", None) in GEMMA3_MODEL_TYPES:
        return _gemma3_layers(model)
    if (getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES
            or getattr(config, "hidden_act", None) != "silu" or _transformers_version() < MIN_TRANSFORMERS):
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


def _gemma3_layers(model: nn.Module) -> list[nn.Module]:
    """Gemma 3's decoder layers where ``_LeanGemma3Forward`` can stand in for them: four (1 + w) RMSNorms a layer,
    per-head q/k norms, a tanh-GELU MLP, no attention softcapping; empty otherwise."""
    config = model.config
    if (getattr(config, "hidden_activation", None) != "gelu_pytorch_tanh"
            or getattr(config, "attn_logit_softcapping", None) is not None
            or _transformers_version() < MIN_TRANSFORMERS):
        return []
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = list(getattr(decoder, "layers", []) or [])
    names = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        norms = [getattr(layer, name, None) for name in names] + [getattr(attn, "q_norm", None),
                                                                  getattr(attn, "k_norm", None)]
        if (attn is None or mlp is None or any(type(n).__name__ != "Gemma3RMSNorm" for n in norms)
                or not all(hasattr(attn, a) for a in ("head_dim", "scaling", "layer_idx", "sliding_window"))
                or not all(isinstance(m, nn.Linear) for m in _linears(layer))):
            return []
    return layers


def rms_norm_args(norm: nn.Module) -> tuple[torch.Tensor, float]:
    """``(scale, eps)`` of an RMSNorm module for ``skinny.rms_norm``: a Llama-family norm multiplies by its weight
    (``variance_epsilon``), Gemma's by ``1 + weight`` (``eps``), computed once per weight and version and kept on the
    norm."""
    if hasattr(norm, "variance_epsilon"):
        return norm.weight, norm.variance_epsilon
    weight = norm._parameters["weight"]
    held = norm.__dict__.get("_selfspec_scale")  # (its weight, its version, 1 + weight)
    if held is None or held[0] is not weight or held[1] != tensor_version(weight):
        held = norm.__dict__["_selfspec_scale"] = (weight, tensor_version(weight), (1.0 + weight.float()).contiguous())
    return held[2], norm.eps


def gemma3_block(model: nn.Module, layer: nn.Module):
    """A lean Gemma 3 layer (``_LeanGemma3Forward``, whose ``block`` runs it from its normed attention input) for
    ``layer``, a layer of the class of ``model``'s (a feature drafter's), where ``model``'s own layers run lean; None
    otherwise."""
    return _LeanGemma3Forward(layer) if _gemma3_layers(model) else None


def use_lean_layers(model: nn.Module, enabled: bool = True) -> int:
    """Give every supported decoder layer of ``model`` the lean forward (``enabled``) or its class's back; returns how
    many layers have it now."""
    layers = supported(model)
    kind = _LeanGemma3Forward if getattr(model.config, "model_type", None) in GEMMA3_MODEL_TYPES else _LeanForward
    for layer in layers:
        if enabled:
            layer.forward = layer.__dict__.setdefault(_LEAN, kind(layer))
        elif isinstance(layer.__dict__.get("forward"), _LeanLayer):
            del layer.forward
    decoder = model.get_decoder() if layers else None
    if decoder is not None and getattr(model.config, "model_type", None) in STACK_MODEL_TYPES:
        if enabled:
            decoder.forward = decoder.__dict__.setdefault(_LEAN, _LeanStack(decoder, layers))
        elif isinstance(decoder.__dict__.get("forward"), _LeanStack):
            del decoder.forward
    return len(layers) if enabled else 0


#: Whether a lean layer whose cache is a ``BufferedLayer`` and whose attention is the skinny kernel runs as one
#: extension call (``skinny.decoder_layer``); False keeps the twelve-call ``block`` (the same result, bitwise).
FUSED_LAYERS = True
#: Whether a decoder whose every layer would take that one call runs its whole stack as one call
#: (``skinny.DecoderStack``: the same per-layer calls in C++, bitwise the same result); needs ``FUSED_LAYERS``.
FUSED_STACK = True
#: Decoders whose forward ``_LeanStack`` mirrors: one mask for every layer (a Qwen2 decoder that mixes in
#: sliding-window layers keeps the per-layer path; Mistral's one mask is its sliding-window one where it has a window).
STACK_MODEL_TYPES = ("llama", "mistral", "qwen2")


def _skinny_linear_class():
    from selfspec.runtime.kernels import _SkinnyLinear  # kernels imports this module

    return _SkinnyLinear


def is_lean_kernel(forward) -> bool:
    """``forward`` (a linear layer's ``__dict__["forward"]``) is the skinny kernel: its module runs on the skinny
    backend, where the extension's fused operations are built."""
    return isinstance(forward, _skinny_linear_class())


def layer_kernels(layer: nn.Module, rows: int, dtype: torch.dtype, device: torch.device,
                  skinny_linear: type | None = None) -> tuple | None:
    """The skinny kernels of ``layer``'s seven linears (q, k, v, o, gate, up, down) when a lean pass over ``rows``
    rows can run on them now (no gradients, not training, float32 CPU rows, at most ``skinny.MAX_ROWS``, every
    linear on the skinny kernel with its weights packed as they are); None otherwise."""
    if (torch.is_grad_enabled() or layer.training or dtype != torch.float32 or device.type != "cpu"
            or not 0 < rows <= skinny.MAX_ROWS):
        return None
    return kernels_of(_linears(layer), skinny_linear)


def kernels_of(linears, skinny_linear: type | None = None) -> tuple | None:
    """The skinny kernels of ``linears`` in order, when every one runs on the skinny kernel with its weights packed
    as they are now; None otherwise."""
    skinny_linear = skinny_linear or _skinny_linear_class()
    kernels = tuple(m.__dict__.get("forward") for m in linears)
    if not all(isinstance(k, skinny_linear) and k._current(m._parameters["weight"], m._parameters.get("bias"))
               for k, m in zip(kernels, linears)):
        return None
    return kernels


def attention_interface(attn: nn.Module):
    """transformers' attention function for ``attn``'s configured implementation; None for eager attention (which
    only the class forward runs)."""
    name = attn.config._attn_implementation
    get_interface = getattr(ALL_ATTENTION_FUNCTIONS, "get_interface", None)  # older 5.x: a plain mapping
    return get_interface(name, None) if get_interface else ALL_ATTENTION_FUNCTIONS.get(name)


class InterfaceLookup:
    """``attention_interface(attn)`` for a layer called on every decode step, looked up again only when its
    configured implementation changes (the lookup goes through transformers' registry on every call otherwise)."""

    def __init__(self):
        self._name, self._function = None, None

    def __call__(self, attn: nn.Module):
        name = attn.config._attn_implementation
        if name != self._name:
            self._name, self._function = name, attention_interface(attn)
        return self._function


def run_kernel(kernel, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``kernel`` (a layer's skinny kernel, from ``layer_kernels``) on rows ``x`` ``[rows, in]``, plus ``residual``
    added last."""
    module = kernel.module
    return skinny.linear(x, kernel._weight, module.out_features, module._parameters.get("bias"), residual)


def block(layer: nn.Module, kernels: tuple, x: torch.Tensor, residual: torch.Tensor, batch: int, n: int,
          position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask, interface, update,
          **kwargs) -> torch.Tensor:
    """One pre-norm decoder layer on the skinny extension, from its normed attention input: ``x`` ``[rows, in]``
    (``input_layernorm`` already applied: a feature drafter's layer reads two normed halves), ``residual`` ``[rows,
    hidden]`` the stream it adds to; ``update(k, v)`` stores the new keys and values ``[batch, kv_heads, n, d]``
    and returns every key and value to attend to. Returns the layer's output ``[rows, hidden]``."""
    q_k, k_k, v_k, o_k, gate_k, up_k, down_k = kernels
    attn = layer.self_attn
    d = attn.head_dim
    cos, sin = position_embeddings
    cos, sin = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
    q = skinny.rope_(run_kernel(q_k, x), cos, sin, d).view(batch, n, -1, d).transpose(1, 2)
    k = skinny.rope_(run_kernel(k_k, x), cos, sin, d).view(batch, n, -1, d).transpose(1, 2)
    v = run_kernel(v_k, x).view(batch, n, -1, d).transpose(1, 2)
    k, v = update(k, v)
    out, _ = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling, **kwargs)
    h = run_kernel(o_k, out.reshape(batch * n, -1), residual)
    norm = layer.post_attention_layernorm
    y = skinny.rms_norm(h, norm.weight, norm.variance_epsilon)
    return run_kernel(down_k, skinny.silu_mul_(run_kernel(gate_k, y), run_kernel(up_k, y)), h)


def fused_block(layer: nn.Module, kernels: tuple, residual: torch.Tensor, batch: int, n: int, position_embeddings,
                attention_mask, held, normed: torch.Tensor | None = None, kwargs: dict | None = None
                ) -> torch.Tensor | None:
    """``layer`` (its skinny ``kernels``) over ``residual`` ``[rows, hidden]`` as one extension call
    (``skinny.decoder_layer``: what ``block`` computes, bitwise, in twelve), its keys and values written after the
    entries ``held`` keeps (a ``BufferedLayer`` of the base's cache, or a drafter's ``attention.LayerCache``: both
    hold views of buffers that ``_reserve`` grows). ``normed``: the attention input where it is not
    ``input_layernorm(residual)`` (a feature drafter's two normed halves). Returns ``[batch, n, hidden]``; None where
    the call does not apply (no buffers yet, another batch size, attention the skinny kernel would not take)."""
    buffer = held._key_buffer
    if held.keys is None or buffer is None or buffer.shape[0] != batch:
        return None
    attn = layer.self_attn
    length = held.keys.shape[-2]
    end = length + n
    if not skinny_attention_takes(batch, n, end, attn.head_dim, attention_mask, 0.0, kwargs):
        return None
    held._reserve(end, held.keys, held.values)
    keys, values = held._key_buffer, held._value_buffer
    d = attn.head_dim
    cos, sin = _rows_of(position_embeddings, d)
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    modules = [k.module for k in kernels]
    out = skinny.decoder_layer(
        residual, norm1.weight, norm1.variance_epsilon, [k._weight for k in kernels],
        [m._parameters.get("bias") for m in modules], [m.out_features for m in modules], cos, sin, d, keys, values,
        length, attention_mask, attn.scaling, norm2.weight, norm2.variance_epsilon, normed)
    held.keys, held.values = keys.narrow(2, 0, end), values.narrow(2, 0, end)  # the views an append leaves
    return out


_ROWS_OF: list = [None, None]  # [the position embeddings last reshaped, their (cos, sin) rows]


def _rows_of(position_embeddings: tuple[torch.Tensor, torch.Tensor], head_dim: int) -> tuple[torch.Tensor, ...]:
    """``(cos, sin)`` as contiguous rows ``[rows, head_dim]``; every layer of a forward gets the same tuple from the
    model, so it is reshaped once a forward rather than once a layer."""
    if _ROWS_OF[0] is not position_embeddings:
        cos, sin = position_embeddings
        _ROWS_OF[:] = [position_embeddings, (cos.reshape(-1, head_dim).contiguous(),
                                             sin.reshape(-1, head_dim).contiguous())]
    return _ROWS_OF[1]


class _LeanLayer:
    """What the lean forwards of every architecture share: the layer, a count of the calls they took themselves
    (``calls``), the class's own forward for the rest, and the check that a call can run lean."""

    def __init__(self, layer: nn.Module):
        self.layer = layer
        self.calls = 0
        self.skinny_linear = _skinny_linear_class()  # resolved once, not on every layer call
        self._interface = InterfaceLookup()

    def _fallback(self, *args, **kwargs):
        return type(self.layer).forward(self.layer, *args, **kwargs)

    def _takes(self, hidden_states: torch.Tensor, position_embeddings, kwargs: dict) -> tuple | None:
        """``(kernels, attention interface, rows)`` where a lean pass takes this call; None for eager attention,
        partial rotary, attentions asked for, anything ``layer_kernels`` refuses (the class's forward runs)."""
        shape = hidden_states.shape
        rows = shape[0] * shape[1] if hidden_states.dim() == 3 else 0
        kernels = layer_kernels(self.layer, rows, hidden_states.dtype, hidden_states.device, self.skinny_linear)
        attn = self.layer.self_attn
        interface = self._interface(attn) if kernels is not None else None
        if (kernels is None or interface is None or position_embeddings is None or kwargs.get("output_attentions")
                or position_embeddings[0].shape[-1] != attn.head_dim):
            return None
        self.calls += 1
        return kernels, interface, rows


class _LeanForward(_LeanLayer):
    """A decoder layer's ``forward`` (see the module docstring); ``calls`` counts the calls it took itself."""

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        self.passes_window = getattr(layer.self_attn.config, "model_type", None) in ("mistral", "qwen2")

    def __call__(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache=None, use_cache: bool | None = False,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs):
        taken = self._takes(hidden_states, position_embeddings, kwargs)
        if taken is None:
            return self._fallback(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        kernels, interface, rows = taken
        layer, shape = self.layer, hidden_states.shape
        attn = layer.self_attn
        batch, n, hidden = shape
        cache_kwargs = kwargs
        if self.passes_window:  # as Mistral's and Qwen2's attention pass it (only flash attention reads it)
            kwargs = {**kwargs, "sliding_window": getattr(attn, "sliding_window",
                                                          getattr(attn.config, "sliding_window", None))}
        residual = hidden_states.reshape(rows, hidden).contiguous()
        norm = layer.input_layernorm
        if FUSED_LAYERS and interface is skinny_attention:
            out = self._fused(kernels, residual, batch, n, position_embeddings, attention_mask, cache, kwargs)
            if out is not None:
                return out  # [batch, n, hidden]
        x = skinny.rms_norm(residual, norm.weight, norm.variance_epsilon)
        if cache is not None:
            def update(k, v):
                return cache.update(k, v, attn.layer_idx, kwargs=cache_kwargs)
        else:
            def update(k, v):
                return k, v
        out = block(layer, kernels, x, residual, batch, n, position_embeddings, attention_mask, interface, update,
                    **kwargs)
        return out.view(shape)

    def _fused(self, kernels: tuple, residual: torch.Tensor, batch: int, n: int, position_embeddings, attention_mask,
               cache, kwargs: dict) -> torch.Tensor | None:
        """``fused_block`` where the layer's keys and values go to one of the project's buffered cache layers; None
        otherwise (the caller then runs ``block``)."""
        layers = getattr(cache, "layers", None)
        index = self.layer.self_attn.layer_idx
        if layers is None or index >= len(layers) or type(layers[index]) is not BufferedLayer:
            return None
        return fused_block(self.layer, kernels, residual, batch, n, position_embeddings, attention_mask, layers[index],
                           kwargs=kwargs)


class _LeanGemma3Forward(_LeanLayer):
    """A Gemma 3 decoder layer's ``forward`` on the skinny extension: its seven linears straight on their packed
    weights, its six RMSNorms (input, post-attention, pre- and post-feedforward, and per head on queries and keys)
    as one ``skinny.rms_norm`` pass each over ``1 + weight`` (what Gemma's norm multiplies by, kept until the weight
    changes), rotary in place, transformers' attention interface (sliding window and scaling as the layer passes
    them) and cache ``update``, the tanh GELU and residual adds as torch ops. About 20 calls where the layer's
    modules make ~70 (a Gemma 3 270M token spent ~10 ms of ~29 between its kernels on a 2-core Xeon). Each row is
    computed on its own, as in ``_LeanForward``; what it does not take goes to the class's forward."""

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        attn = layer.self_attn
        self._norms = (layer.input_layernorm, attn.q_norm, attn.k_norm, layer.post_attention_layernorm,
                       layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm)
        self._eps = [norm.eps for norm in self._norms]

    def _scale(self, i: int) -> torch.Tensor:
        return rms_norm_args(self._norms[i])[0]

    def __call__(self, hidden_states: torch.Tensor,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                 attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None, cache=None,
                 **kwargs):
        taken = self._takes(hidden_states, position_embeddings, kwargs)
        if taken is None:
            return self._fallback(hidden_states, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, position_ids=position_ids, cache=cache, **kwargs)
        kernels, interface, rows = taken
        shape = hidden_states.shape
        residual = hidden_states.reshape(rows, shape[2]).contiguous()
        x = skinny.rms_norm(residual, self._scale(0), self._eps[0])
        if cache is not None:
            def update(k, v):
                return cache.update(k, v, self.layer.self_attn.layer_idx, kwargs=kwargs)
        else:
            def update(k, v):
                return k, v
        return self.block(kernels, interface, x, residual, shape[0], shape[1], position_embeddings, attention_mask,
                          update, kwargs).view(shape)

    def block(self, kernels: tuple, interface, x: torch.Tensor, residual: torch.Tensor, batch: int, n: int,
              position_embeddings, attention_mask, update, kwargs: dict) -> torch.Tensor:
        """The layer from its normed attention input ``x`` ``[rows, in]`` (``input_layernorm`` applied; a feature
        drafter's layer reads two normed halves) over ``residual`` ``[rows, hidden]``; ``update(k, v)`` stores the
        new keys and values and returns every key and value to attend to. Returns ``[rows, hidden]``."""
        attn = self.layer.self_attn
        rows = residual.shape[0]
        d, eps = attn.head_dim, self._eps
        q_k, k_k, v_k, o_k, gate_k, up_k, down_k = kernels
        cos, sin = _rows_of(position_embeddings, d)  # per forward and layer type, not per layer
        q = skinny.rms_norm(run_kernel(q_k, x).view(-1, d), self._scale(1), eps[1]).view(rows, -1)
        k = skinny.rms_norm(run_kernel(k_k, x).view(-1, d), self._scale(2), eps[2]).view(rows, -1)
        q = skinny.rope_(q, cos, sin, d).view(batch, n, -1, d).transpose(1, 2)
        k = skinny.rope_(k, cos, sin, d).view(batch, n, -1, d).transpose(1, 2)
        v = run_kernel(v_k, x).view(batch, n, -1, d).transpose(1, 2)
        k, v = update(k, v)
        out, _ = interface(attn, q, k, v, attention_mask, dropout=0.0, scaling=attn.scaling,
                           sliding_window=attn.sliding_window, **kwargs)
        h = residual + skinny.rms_norm(run_kernel(o_k, out.reshape(rows, -1)), self._scale(3), eps[3])
        y = skinny.rms_norm(h, self._scale(4), eps[4])
        m = torch.nn.functional.gelu(run_kernel(gate_k, y), approximate="tanh") * run_kernel(up_k, y)
        return h + skinny.rms_norm(run_kernel(down_k, m), self._scale(5), eps[5])


class _LeanStack:
    """A Llama-family decoder's (``LlamaModel``, ``MistralModel``, ``Qwen2Model``) ``forward`` that runs all its
    layers as one extension call
    (``skinny.DecoderStack``) where each layer would run as one (``fused_block``): a decode step's few rows, every
    layer lean with its linears packed as they are now, a buffered cache (``selfspec.runtime.cache``) and the skinny
    attention kernel. The embedding, position ids, mask (transformers' ``create_causal_mask``), rotary embedding and
    final norm are the model's own, as its forward computes them; the layers are the same calls as the per-layer
    path's, so logits, cache entries and hidden states (``output_hidden_states=True``: the embeddings, every layer's
    output, the normed last one) are bitwise that path's. Anything else (prefill beyond ``skinny.MAX_ROWS`` rows,
    gradients, ``inputs_embeds``, attentions, hidden states selected by index, another cache, a forward hook on a
    layer) runs the class's own forward. ``calls`` counts the calls it took itself."""

    def __init__(self, decoder: nn.Module, layers: list[nn.Module]):
        self.decoder, self.layers = decoder, list(layers)
        self.calls = 0
        self.skinny_linear = _skinny_linear_class()
        self._interface = InterfaceLookup()
        self._stack = None  # and, once built, what it was built from (``_unchanged``)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        # the mask the decoder's forward builds for its layers, from its own module's functions
        modeling = sys.modules.get(type(decoder).__module__)
        name = "create_causal_mask"
        if getattr(decoder.config, "model_type", None) == "mistral" and decoder.config.sliding_window is not None:
            name = "create_sliding_window_causal_mask"
        self._mask_function = getattr(modeling, name, None)
        if getattr(decoder, "has_sliding_layers", False):  # Qwen2 with sliding-window layers: a mask per layer type
            self._mask_function = None

    def _fallback(self, *args, **kwargs):
        return type(self.decoder).forward(self.decoder, *args, **kwargs)

    def _current_stack(self):
        """The extension's stack over the layers' kernels as they are now (rebuilt when a kernel repacked, a
        weight was replaced or changed in place, or a layer left the skinny kernel); None where a layer cannot run
        lean now."""
        if self._stack is not None and self._unchanged():
            return self._stack
        per_layer = [kernels_of(_linears(layer), self.skinny_linear) for layer in self.layers]
        if any(k is None for k in per_layer):
            self._stack = None
            return None
        layers = self.layers
        kernels = [k for layer_kernels in per_layer for k in layer_kernels]
        modules = [k.module for k in kernels]
        self._stack = skinny.extension().DecoderStack(
            [layer.input_layernorm.weight for layer in layers],
            [float(layer.input_layernorm.variance_epsilon) for layer in layers],
            [[k._weight for k in ks] for ks in per_layer],
            [[k.module._parameters.get("bias") for k in ks] for ks in per_layer],
            [[k.module.out_features for k in ks] for ks in per_layer],
            [float(layer.self_attn.scaling) for layer in layers],
            [layer.post_attention_layernorm.weight for layer in layers],
            [float(layer.post_attention_layernorm.variance_epsilon) for layer in layers], self.head_dim)
        self._slots = [module.__dict__ for module in modules]
        self._params = [module._parameters for module in modules]
        self._kernels = kernels
        self._weights = [params["weight"] for params in self._params]
        self._versions = [tensor_version(weight) for weight in self._weights]
        self._versioned = None not in self._versions
        self._norm_params = [norm._parameters for layer in layers
                             for norm in (layer.input_layernorm, layer.post_attention_layernorm)]
        self._norms = [params["weight"] for params in self._norm_params]
        self._biases = [params.get("bias") for params in self._params]
        return self._stack

    def _unchanged(self) -> bool:
        """Every linear still runs the kernel the stack was built from, on the same weight and bias, the weight
        unchanged in place, and every norm has the weight the stack holds; what changes in place the stack reads as
        it is. Every pass is a ``map`` over C getters: the check runs once a forward, right after the last one has
        streamed the weights through the caches, where each of SmolLM2's 210 linears' dictionaries is a cache miss
        (a pass of Python list comprehensions took ~0.4 ms a step there on a Zen 3, against ~30 us warm)."""
        return (all(map(is_, map(_FORWARD, self._slots), self._kernels))
                and all(map(is_, map(_WEIGHT, self._params), self._weights))
                and all(map(is_, map(_BIAS, self._params), self._biases))
                and all(map(is_, map(_WEIGHT, self._norm_params), self._norms))
                and list(map(_VERSION if self._versioned else tensor_version, self._weights)) == self._versions)

    def __call__(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, cache=None, inputs_embeds: torch.Tensor | None = None,
                 use_cache: bool | None = None, **kwargs):
        out = None
        config = self.decoder.config
        # what the class's forward would read from the config where the call does not say
        hidden = kwargs.get("output_hidden_states")
        hidden = getattr(config, "output_hidden_states", False) if hidden is None else hidden
        attentions = kwargs.get("output_attentions")
        attentions = getattr(config, "output_attentions", False) if attentions is None else attentions
        return_dict = kwargs.get("return_dict")
        return_dict = getattr(config, "return_dict", True) if return_dict is None else return_dict
        if FUSED_STACK and FUSED_LAYERS and input_ids is not None and inputs_embeds is None and use_cache is not False \
                and set(kwargs) <= _STACK_KWARGS and hidden in (False, True) and return_dict and not attentions:
            out = self._run(input_ids, attention_mask, position_ids, cache, bool(hidden))
        if out is None:
            return self._fallback(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        return out

    def _run(self, input_ids, attention_mask, position_ids, cache, want_hidden: bool):
        decoder = self.decoder
        if (torch.is_grad_enabled() or decoder.training or input_ids.dim() != 2 or self._mask_function is None
                or isinstance(attention_mask, dict)  # masks per layer type, prepared by generate
                or decoder.config.num_hidden_layers != len(self.layers)):  # HF's early-exit assistant: fewer layers
            return None
        batch, n = input_ids.shape
        if not 0 < batch * n <= skinny.MAX_ROWS:
            return None
        held = getattr(cache, "layers", None)
        if held is None or len(held) != len(self.layers) or getattr(held[0], "keys", None) is None:
            return None
        length = held[0].keys.shape[-2]
        for layer in held:
            if (type(layer) is not BufferedLayer or layer._key_buffer is None or layer.keys is None
                    or layer.keys.shape[-2] != length or layer._key_buffer.shape[0] != batch):
                return None
        if self._interface(self.layers[0].self_attn) is not skinny_attention or _hooked(self.layers):
            return None
        stack = self._current_stack()
        if stack is None:
            return None
        embeds = decoder.embed_tokens(input_ids)
        if embeds.dtype != torch.float32 or embeds.device.type != "cpu":
            return None
        if position_ids is None:  # as the model's forward numbers them
            position_ids = (torch.arange(n, device=embeds.device) + length).unsqueeze(0)
        mask = self._mask_function(config=decoder.config, inputs_embeds=embeds, attention_mask=attention_mask,
                                   cache=cache, position_ids=position_ids)
        end = length + n
        if not skinny_attention_takes(batch, n, end, self.head_dim, mask, 0.0, None):
            return None
        for layer in held:
            layer._reserve(end, layer.keys, layer.values)
        keys = [layer._key_buffer for layer in held]
        values = [layer._value_buffer for layer in held]
        cos, sin = _rows_of(decoder.rotary_emb(embeds, position_ids=position_ids), self.head_dim)
        outputs, keys, values = skinny.decoder_stack(stack, embeds.reshape(batch * n, -1).contiguous(), cos, sin,
                                                     keys, values, length, mask, want_hidden)
        for layer, k, v in zip(held, keys, values):
            layer.keys, layer.values = k, v  # the views an append leaves, made in the call
        self.calls += 1
        last = decoder.norm(outputs[-1])
        hidden_states = (embeds, *outputs[:-1], last) if want_hidden else None
        return BaseModelOutputWithPast(last_hidden_state=last, cache=cache, hidden_states=hidden_states)


def _hooked(layers: list[nn.Module]) -> bool:
    """Whether a forward hook or pre-hook on a layer (or a global one) expects to see the layers' calls: any but
    transformers' output-capturing hooks, which only record inside the model class's own forward (the stack
    returns hidden states itself)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    for layer in layers:
        if layer._forward_pre_hooks:
            return True
        for hook in layer._forward_hooks.values():
            if getattr(hook, "__name__", None) != "output_capturing_hook" and not getattr(hook, COUNTS_ONLY, False):
                return True
    return False


#: An attribute that marks a forward hook on a layer as one that only counts calls (the benchmark's step counter):
#: it leaves the whole-stack call on, and adds ``stack_calls`` to what it counted.
COUNTS_ONLY = "_selfspec_counts_only"


def stack_calls(model: nn.Module) -> int:
    """Forwards ``model``'s decoder has run as one whole-stack call so far (0 where it has no ``_LeanStack``): they
    run no per-layer module, so a hook on a layer does not see them."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    forward = getattr(decoder, "__dict__", {}).get("forward")
    return forward.calls if isinstance(forward, _LeanStack) else 0


_STACK_KWARGS = frozenset({"output_hidden_states", "return_dict", "output_attentions"})

# the getters of _LeanStack._unchanged
_FORWARD, _BIAS = methodcaller("get", "forward"), methodcaller("get", "bias")
_WEIGHT, _VERSION = itemgetter("weight"), attrgetter("_version")


def tensor_version(tensor: torch.Tensor) -> int | None:
    """In-place change counter; inference tensors (made under ``torch.inference_mode``) keep none, so a layer built
    from them is packed once (``selfspec.runtime.kernels``) and a stack over them built once."""
    return None if tensor.is_inference() else tensor._version


__all__ = ["SUPPORTED_MODEL_TYPES", "InterfaceLookup", "attention_interface", "block", "fused_block", "is_lean_kernel",
           "kernels_of", "layer_kernels", "run_kernel", "stack_calls", "supported", "tensor_version",
           "use_lean_layers"]
