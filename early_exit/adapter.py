"""Trained adapters an exit classifier may put before its norm: zero-initialised ResBlocks, or one attention-only
block (Kangaroo) that attends over the exit-layer hidden states of the previous positions.

Both start as the identity (the ResBlock's ``W`` and the attention block's output projection are zero), so an
untrained adapter is exactly the training-free classifier. The attention block keeps its own one-layer KV cache
(:class:`AdapterCache`) at decode time: the drafter feeds it the exit-layer states of accepted tokens, appends
the draft nodes' entries while drafting, and crops them back, as the base cache is handled.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from selfspec.runtime import lean, skinny
from selfspec.runtime.attention import LayerCache, apply_rotary, causal_mask, skinny_attention

ADAPTER_KINDS = ("resblock", "attention")


class ResBlock(nn.Module):
    """``x + SiLU(W x)`` with W zero-initialised: starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


#: The attention adapter's one-layer KV cache (``selfspec.runtime.attention.LayerCache``).
AdapterCache = LayerCache


class AttentionAdapter(nn.Module):
    """One pre-norm attention block: ``x + o(Attn(RoPE(q(n(x))), RoPE(k(n(x))), v(n(x))))``, causal, optionally
    followed by a pre-norm SwiGLU MLP ``x + down(SiLU(gate(m(x))) * up(m(x)))`` (``mlp_size`` > 0).

    The head dimension is the base model's (the base rotary embedding supplies cos/sin); the head count is the
    base's unless ``num_heads`` is given. Keys and values use every head (no grouping): one layer is cheap. The
    output and down projections start at zero, so an untrained block is the identity.
    """

    def __init__(self, model, exit_layer: int, num_heads: int | None = None, mlp_size: int = 0):
        super().__init__()
        config = model.config
        hidden = config.hidden_size
        self.num_heads = num_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
        # Pre-norm initialised as the norm the base layer after the exit applies to the same hidden state.
        self.norm = copy.deepcopy(model.model.layers[exit_layer].input_layernorm)
        inner = self.num_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, inner, bias=False)
        self.k_proj = nn.Linear(hidden, inner, bias=False)
        self.v_proj = nn.Linear(hidden, inner, bias=False)
        self.o_proj = nn.Linear(inner, hidden, bias=False)
        nn.init.zeros_(self.o_proj.weight)  # starts as the identity: the training-free classifier
        self.mlp_norm = self.gate_proj = self.up_proj = self.down_proj = None
        if mlp_size:
            self.mlp_norm = copy.deepcopy(model.model.layers[exit_layer].post_attention_layernorm)
            self.gate_proj = nn.Linear(hidden, mlp_size, bias=False)
            self.up_proj = nn.Linear(hidden, mlp_size, bias=False)
            self.down_proj = nn.Linear(mlp_size, hidden, bias=False)
            nn.init.zeros_(self.down_proj.weight)
        for p in self.parameters():
            p.requires_grad_(True)

    def _lean_kernels(self, hidden: torch.Tensor, attention_mask, cos: torch.Tensor) -> tuple | None:
        """The skinny kernels of the block's linears when a draft step can run as one lean pass (decoding on the
        skinny backend: no gradients, float32 CPU rows, few of them, a 4-D draft mask or none, full-width rotary);
        None otherwise."""
        rows = hidden.shape[0] * hidden.shape[1]
        if (torch.is_grad_enabled() or hidden.dtype != torch.float32 or hidden.device.type != "cpu"  # (no dropout here)
                or not 0 < rows <= skinny.MAX_ROWS or cos.shape[-1] != self.head_dim
                or (attention_mask is not None and attention_mask.dim() != 4)
                or (attention_mask is None and hidden.shape[1] != 1)):
            return None
        linears = [self.q_proj, self.k_proj, self.v_proj, self.o_proj]
        if self.down_proj is not None:
            linears += [self.gate_proj, self.up_proj, self.down_proj]
        return lean.kernels_of(linears)

    def _lean_forward(self, kernels: tuple, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      attention_mask, cache) -> torch.Tensor:
        """``forward`` at decode time on the skinny extension: the same block, one fused pass per norm, rotary and
        SwiGLU, residuals in the GEMM epilogues, the attention kernel (see ``selfspec.runtime.lean``)."""
        b, q, width = hidden.shape
        d = self.head_dim
        run = lean.run_kernel
        residual = hidden.reshape(b * q, width).contiguous()
        normed = skinny.rms_norm(residual, self.norm.weight, self.norm.variance_epsilon)
        cos, sin = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
        query = skinny.rope_(run(kernels[0], normed), cos, sin, d).view(b, q, -1, d).transpose(1, 2)
        keys = skinny.rope_(run(kernels[1], normed), cos, sin, d).view(b, q, -1, d).transpose(1, 2)
        values = run(kernels[2], normed).view(b, q, -1, d).transpose(1, 2)
        if cache is not None:
            keys, values = cache.append(keys, values)
        # the attention kernel where it computes exactly (mask of the keys' length...), grouped SDPA otherwise
        out, _ = skinny_attention(self, query, keys, values, attention_mask, scaling=d ** -0.5)  # [b, q, heads, d]
        h = run(kernels[3], out.reshape(b * q, -1), residual)
        if self.down_proj is not None:
            m = skinny.rms_norm(h, self.mlp_norm.weight, self.mlp_norm.variance_epsilon)
            h = run(kernels[6], skinny.silu_mul_(run(kernels[4], m), run(kernels[5], m)), h)
        return h.view(b, q, width)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, q, _ = x.shape
        return x.view(b, q, self.num_heads, self.head_dim).transpose(1, 2)  # [b, heads, q, head_dim]

    def _keys_values(self, normed: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(self._split(self.k_proj(normed)), cos, sin), self._split(self.v_proj(normed))

    def extend(self, hidden: torch.Tensor, model, position_ids: torch.Tensor, cache: AdapterCache) -> None:
        """Append the keys and values of ``hidden`` ``[b, q, hidden]`` at ``position_ids`` ``[b, q]`` to ``cache``
        (accepted positions: no query needed)."""
        cos, sin = model.model.rotary_emb(hidden, position_ids=position_ids)
        cache.append(*self._keys_values(self.norm(hidden), cos, sin))

    def forward(self, hidden: torch.Tensor, model, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: AdapterCache | None = None) -> torch.Tensor:
        """``[b, q, hidden]`` -> ``[b, q, hidden]``.

        Args:
            hidden: exit-layer hidden states of ``q`` new positions.
            model: the base model (its rotary embedding gives cos/sin).
            position_ids: ``[b, q]`` absolute positions (default: right after what ``cache`` holds).
            attention_mask: None (causal), ``[b, k]`` padding mask over all keys (causal and padding), or a
                ``[b, 1, q, k]`` additive mask used as is (a draft tree's).
            cache: earlier positions' keys and values; the new ones are appended to it.

        Raises:
            ValueError: ``hidden`` is not ``[batch, seq, hidden]``.
        """
        if hidden.dim() != 3:
            raise ValueError(f"the attention adapter needs [batch, seq, hidden] states, got shape {tuple(hidden.shape)}")
        b, q, _ = hidden.shape
        start = cache.length if cache is not None else 0
        if position_ids is None:
            position_ids = torch.arange(start, start + q, device=hidden.device)[None].expand(b, q)
        cos, sin = model.model.rotary_emb(hidden, position_ids=position_ids)
        kernels = self._lean_kernels(hidden, attention_mask, cos)
        if kernels is not None:
            return self._lean_forward(kernels, hidden, cos, sin, attention_mask, cache)
        normed = self.norm(hidden)
        query = apply_rotary(self._split(self.q_proj(normed)), cos, sin)
        keys, values = self._keys_values(normed, cos, sin)
        if cache is not None:
            keys, values = cache.append(keys, values)
        if attention_mask is None or attention_mask.dim() == 2:
            attention_mask = causal_mask(position_ids, keys.shape[2], attention_mask, hidden.dtype)
        out = nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=attention_mask)
        hidden = hidden + self.o_proj(out.transpose(1, 2).reshape(b, q, -1))
        if self.down_proj is not None:
            m = self.mlp_norm(hidden)
            hidden = hidden + self.down_proj(nn.functional.silu(self.gate_proj(m)) * self.up_proj(m))
        return hidden
