"""Prefix attention for Medusa heads: one causal attention block over the base model's last hidden states, each
position also reading the token that follows it, so the heads start from a state that has looked back at the
whole context with the next token in hand.

Plain and sequential heads read only ``h_t``, the hidden state that predicted the root ``x_{t+1}``. Hydra++ (Ankner
et al. 2024) adds one decoder layer over the prefix's hidden states; here, as in EAGLE (Li et al. 2024), each
position's input also carries the embedding of its next token, so the attention's queries know ``x_{t+1}`` and can
fetch what the context says comes after it::

    u_j = h_j + T e(x_{j+1})
    a_j = u_j + O Attn(RoPE(Q n(u)), RoPE(K n(u)), V n(u))_j          causal over positions <= j
    p_j = a_j + Down(SiLU(Gate m(a_j)) * Up m(a_j))                    (optional SwiGLU MLP)

The heads then start from ``p_t`` instead of ``h_t``. Every position's entry uses only verified states and
verified tokens, so at decode time the block's KV cache only ever grows: after each verification the drafter
appends the accepted positions (their next tokens are known by then) and reads the output at the last one. Draft
tokens never enter it, so nothing has to be cropped. ``T``, ``O`` and ``Down`` start at zero: untrained, the
block is the identity and the heads behave exactly as without it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from selfspec.runtime.attention import LayerCache, apply_rotary, causal_mask


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class PrefixAttention(nn.Module):
    """The prefix-attention block (see the module docstring).

    Args:
        hidden_size: the base model's hidden size.
        num_heads, head_dim: attention shape; ``head_dim`` must be the base's when its rotary embedding is used.
        mlp_size: inner size of the SwiGLU MLP after the attention; 0 for none.
    """

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, mlp_size: int = 0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.token_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.norm = RMSNorm(hidden_size)
        self.q_proj = nn.Linear(hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(hidden_size, inner, bias=False)
        self.o_proj = nn.Linear(inner, hidden_size, bias=False)
        if mlp_size:
            self.mlp_norm = RMSNorm(hidden_size)
            self.gate_proj = nn.Linear(hidden_size, mlp_size, bias=False)
            self.up_proj = nn.Linear(hidden_size, mlp_size, bias=False)
            self.down_proj = nn.Linear(mlp_size, hidden_size, bias=False)
        else:
            self.mlp_norm = self.gate_proj = self.up_proj = self.down_proj = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random q/k/v (and gate/up), zero ``T``, ``O`` and ``Down``: the block starts as the identity."""
        std = self.q_proj.in_features ** -0.5
        for linear in (self.q_proj, self.k_proj, self.v_proj, self.gate_proj, self.up_proj):
            if linear is not None:
                nn.init.normal_(linear.weight, std=std)
        for linear in (self.token_proj, self.o_proj, self.down_proj):
            if linear is not None:
                nn.init.zeros_(linear.weight)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, q, _ = x.shape
        return x.view(b, q, self.num_heads, self.head_dim).transpose(1, 2)  # [b, heads, q, head_dim]

    def forward(self, hidden: torch.Tensor, next_embeddings: torch.Tensor, rotary: nn.Module | None = None,
                position_ids: torch.Tensor | None = None, cache: LayerCache | None = None) -> torch.Tensor:
        """``[b, q, hidden]`` base hidden states and ``[b, q, hidden]`` embeddings of each position's next token ->
        ``[b, q, hidden]`` states for the heads.

        Args:
            rotary: the base model's rotary embedding (``selfspec.runtime.attention.rotary_of``); None: no positions
                beyond the causal order.
            position_ids: ``[b, q]`` absolute positions (default: right after what ``cache`` holds).
            cache: earlier positions' keys and values (decode time); the new ones are appended. Without a cache
                the ``q`` positions attend causally among themselves (training: right padding needs no mask).
        """
        b, q, _ = hidden.shape
        start = cache.length if cache is not None else 0
        x = hidden + self.token_proj(next_embeddings)
        normed = self.norm(x)
        query, keys, values = (self._split(p(normed)) for p in (self.q_proj, self.k_proj, self.v_proj))
        if rotary is not None:
            if position_ids is None:
                position_ids = torch.arange(start, start + q, device=hidden.device)[None].expand(b, q)
            cos, sin = rotary(hidden, position_ids=position_ids)
            query, keys = apply_rotary(query, cos, sin), apply_rotary(keys, cos, sin)
        if cache is not None:
            keys, values = cache.append(keys, values)
        if keys.shape[2] == q:
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=q > 1)
        elif q == 1:
            out = F.scaled_dot_product_attention(query, keys, values)
        else:
            positions = torch.arange(start, start + q, device=hidden.device)[None]
            mask = causal_mask(positions, keys.shape[2], None, query.dtype)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask)
        x = x + self.o_proj(out.transpose(1, 2).reshape(b, q, -1))
        if self.down_proj is not None:
            m = self.mlp_norm(x)
            x = x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))
        return x
