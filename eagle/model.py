"""The EAGLE-3 draft model: one decoder layer of the base model's own class that reads the base's fused low, mid
and high-layer hidden states together with the embedding of the next token, and drafts on its own outputs.

For position ``t`` of the verified text (``s_0 .. s_c``, hidden states ``h^a_t`` of the base layers ``aux_layers``)::

    g_t   = fc([h^1_t ; h^2_t ; h^3_t])                                  fused features, [hidden]
    x     = [n_e(e(s_{t+1})) ; n_h(g_t)]                                 [2 * hidden] into q/k/v
    a_t   = g_t + Attn(x)                                                the base layer's attention, RoPE at t
    o_t   = a_t + MLP(n_post(a_t))                                       the base layer's MLP
    logits over the draft vocabulary = lm_head(norm(o_t))                predicts s_{t+2}

Drafting continues on the draft's own outputs: the next draft step at position ``t + 1`` reads ``o_t`` in place
of ``g_{t+1}`` and the embedding of the token it drafted. Training unrolls exactly that ("training-time test",
Li et al. 2025): step ``j`` of position ``t`` attends to the step-0 entries of positions ``<= t`` (the verified
context) and to its own chain's entries of steps ``1..j`` (what the drafted ancestors wrote), which is precisely
what a draft-tree node at depth ``j + 1`` sees at decode time. ``tests/drafters/test_eagle.py`` checks the two
paths give the same numbers. The unroll attends through ``ttt_attention``, which takes that mask by its structure
(one causal block, then one key per query in each later block), so step ``j`` costs about what step 0 costs rather
than ``j + 1`` times its attention.

The layer is the base model's own decoder-layer class built from its config, with q/k/v widened to ``2 * hidden``
inputs, and its MLP as wide as ``EagleConfig.intermediate_size`` says (default: the base's); the embedding table
(and, with ``share_lm_head``, the LM-head rows of the draft vocabulary) are the base's, read at run time and never
saved. Supported: decoders whose layers have ``self_attn.{q,k,v}_proj``,
``input_layernorm``, ``post_attention_layernorm`` and ``mlp`` (Llama, Qwen2/3, Mistral, Gemma), and Gemma 3's
"sandwich" layers, which also normalise the attention's output (``post_attention_layernorm``) and the MLP's input
and output (``pre_feedforward_layernorm``, ``post_feedforward_layernorm``): there the draft layer applies them as its
class does. A base that mixes sliding-window and full layers (Gemma 3) gets a full-attention draft layer, with the
rotary embedding of its full layers: the draft sees its whole context, as every other draft layer does.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from decoding import by_machine
from selfspec.runtime import lean, skinny
from selfspec.runtime.attention import LayerCache, skinny_attention
from selfspec.runtime.layers import decoder_layers, num_decoder_layers

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3_text")
FORMAT = "selfspec-eagle3"


def check_supported(model: nn.Module) -> None:
    """Raises: ValueError: a base model whose decoder layer the draft layer cannot be built from."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    layer = decoder_layers(model)[0]
    attn = getattr(layer, "self_attn", None)
    ok = attn is not None and all(hasattr(attn, p) for p in ("q_proj", "k_proj", "v_proj")) and all(
        hasattr(layer, m) for m in ("input_layernorm", "post_attention_layernorm", "mlp"))
    if model_type not in SUPPORTED_MODEL_TYPES or not ok:
        raise ValueError(f"the eagle feature drafter builds its layer from the base's decoder layer and supports "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}; got model_type {model_type!r}. Use --draft medusa "
                         "for other architectures.")


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / mid / high choice, in ``output_hidden_states`` indexing (``i`` = after decoder layer
    ``i``): the outputs of layers 2, L/2 and L-3 (as vLLM and speculators capture them)."""
    low, mid, high = 2, num_layers // 2, num_layers - 3
    return tuple(sorted({max(1, min(num_layers, i)) for i in (low, mid, high)}))  # type: ignore[return-value]


def check_size(value, name: str, null: str = "") -> None:
    """Raises: ValueError: ``value`` is neither None nor an integer >= 1 (``null`` says what None stands for)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an integer >= 1 or null{null}, got {value!r}")


@dataclasses.dataclass
class EagleConfig:
    """What a saved drafter is: shapes, the base layers it reads, its vocabulary and how it was made."""

    hidden_size: int
    vocab_size: int  # the base model's
    draft_vocab_size: int
    aux_layers: list[int]  # output_hidden_states indices fused by fc
    share_lm_head: bool = True  # LM-head rows of the base (not saved) instead of a trained draft head
    #: the draft layer's MLP width (None: the base's); wider buys capacity at the cost of a few draft microseconds
    #: (``eagle.recipe.grow_mlp`` widens a trained drafter without changing what it computes)
    intermediate_size: int | None = None
    base_model: dict = dataclasses.field(default_factory=dict)  # selfspec.runtime.identity of the base
    decoding: dict = dataclasses.field(default_factory=dict)  # default drafting policy (depth, top_k, width, nodes)
    #: drafting calibrated per kind of machine (``selfspec.runtime.kernels.machine_class``): ``{class: {"policy":
    #: {...}, "calibrated_on": "...", "date": "..."}}``; where the machine running it has an entry, that policy
    #: replaces ``decoding`` (``eagle.drafter.saved_policy``)
    decoding_by_machine: dict = dataclasses.field(default_factory=dict)
    accuracy: list[float] | None = None  # held-out top-1 acceptance per draft depth (teacher-forced chain)
    training: dict | None = None  # recipe, command, data and metrics
    format: str = FORMAT

    def __post_init__(self):
        if self.format != FORMAT:
            raise ValueError(f"not a selfspec eagle drafter config (format {self.format!r}, expected {FORMAT!r})")
        self.aux_layers = [int(i) for i in self.aux_layers]
        if not self.aux_layers:
            raise ValueError("eagle config: aux_layers must name at least one base layer")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"eagle config: draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size "
                             f"{self.vocab_size}]")
        check_size(self.intermediate_size, "eagle config: intermediate_size", " (the base's)")
        by_machine.check_entries(self.decoding_by_machine, "eagle config: decoding_by_machine")

    def policy_for(self, machine: str) -> tuple[dict, str]:
        """``(options, source)``: the drafting saved for machines of class ``machine`` (its ``decoding_by_machine``
        entry, whole), else the default ``decoding``; ``source`` names which (``eagle.drafter.saved_policy`` checks
        the options and resolves the class of the machine a drafter runs on)."""
        return by_machine.policy_for(self.decoding, self.decoding_by_machine, machine,
                                     ("decoding", "decoding_by_machine"))

    def save(self, directory: Path) -> None:
        (directory / "config.json").write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> EagleConfig:
        """Raises: FileNotFoundError, ValueError: a missing or unreadable config, naming the file."""
        if not path.is_file():
            raise FileNotFoundError(f"eagle drafter config {path} does not exist")
        try:
            data = json.loads(path.read_text())
            return cls(**data)
        except (json.JSONDecodeError, TypeError) as e:
            raise ValueError(f"{path} is not a valid eagle drafter config: {e}") from None


class ChainMask:
    """The attention mask of one training-time-test step, by its structure rather than as a dense tensor: the
    keys are ``blocks`` blocks of ``s`` positions; a query at ``t`` sees block 0 (the step-0 entries) where
    ``first`` ``[b, 1, s, s]`` says so, and in each later block only position ``t`` (its own chain's entry).

    ``ttt_attention`` computes that in ``O(s^2 + blocks s)`` instead of a dense ``[s, blocks s]`` mask's
    ``O(blocks s^2)``; ``dense()`` is the same mask as a tensor, for any other attention implementation."""

    def __init__(self, first: torch.Tensor, blocks: int, fallback: str):
        self.first, self.blocks, self.fallback = first, blocks, fallback

    def dense(self, additive: torch.dtype | None = None) -> torch.Tensor:
        """``[b, 1, s, blocks s]``: bool (True = attend), or with ``additive`` a float mask of that dtype (0 or the
        dtype's minimum), as eager attention takes it."""
        b, _, s, _ = self.first.shape
        diagonal = torch.eye(s, dtype=torch.bool, device=self.first.device).expand(b, 1, s, s)
        mask = torch.cat([self.first] + [diagonal] * (self.blocks - 1), dim=-1)
        if additive is None:
            return mask
        return torch.zeros(mask.shape, dtype=additive, device=mask.device).masked_fill(~mask,
                                                                                       torch.finfo(additive).min)


#: The attention implementation the draft layer runs while training unrolls (registered with transformers).
TTT_ATTENTION = "selfspec_ttt_attention"
_STRUCTURED_FROM = 2  # blocks from which ttt_attention computes by structure (step 0: the model's own kernel)


def ttt_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """Attention of a training-time-test step (``attention_mask`` a ``ChainMask``): scores against block 0 as one
    matmul and against the chain's own entries of blocks ``1..`` as one dot product per query, one softmax over
    both. The same attention as the dense mask up to float rounding; step 0 (one block), a soft cap or attention sinks
    go to the model's own implementation with the dense mask."""
    if not isinstance(attention_mask, ChainMask):
        raise TypeError(f"{TTT_ATTENTION} runs training-time-test steps only (got a {type(attention_mask).__name__})")
    mask = attention_mask
    b, heads, s, head_dim = query.shape
    kv_heads = key.shape[1]
    # A sliding window is not applied, as sdpa and eager with an explicit mask (how the draft layer decodes) do not
    # apply one either (Mistral passes its config's window on every call).
    # Step 0 (one block) is plain causal attention: the model's own kernel runs it best.
    plain = (mask.blocks >= _STRUCTURED_FROM and key.shape[2] == mask.blocks * s and heads % kv_heads == 0
             and kwargs.get("softcap") is None and kwargs.get("s_aux") is None)
    if not plain:
        dense = mask.dense(query.dtype if mask.fallback == "eager" else None)
        return _own_attention(module, mask.fallback)(module, query, key, value, dense, dropout=dropout,
                                                     scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else head_dim ** -0.5
    groups = heads // kv_heads
    q = query.reshape(b, kv_heads, groups * s, head_dim)  # the query heads that share a key/value head
    k = key.view(b, kv_heads, mask.blocks, s, head_dim)
    v = value.view(b, kv_heads, mask.blocks, s, head_dim)
    first = (q @ k[:, :, 0].transpose(-1, -2)).view(b, kv_heads, groups, s, s) * scale
    first = first.masked_fill(~mask.first[:, :, None], float("-inf"))
    # each query's score against its own chain entry of block i: <q_t, k_{i, t}>, elementwise (a batched matmul
    # of b * heads * s products of [groups, d] x [d, blocks - 1] runs far slower on a CPU)
    own_keys = k[:, :, 1:].permute(0, 1, 3, 2, 4)[:, :, None]  # [b, kv, 1, s, blocks - 1, d]
    own_values = v[:, :, 1:].permute(0, 1, 3, 2, 4)[:, :, None]
    # (summed in fp32 as a matmul accumulates, also under bf16 autocast) -> [b, kv, g, s, blocks - 1]
    chain = (q.view(b, kv_heads, groups, s, 1, head_dim).float() * own_keys.float()).sum(-1) * scale
    probs = torch.softmax(torch.cat([first.float(), chain], dim=-1), dim=-1).to(query.dtype)
    if dropout and module.training:
        probs = F.dropout(probs, p=dropout)
    out = (probs[..., :s].reshape(b, kv_heads, groups * s, s) @ v[:, :, 0]).view(b, kv_heads, groups, s, head_dim)
    out = out + (probs[..., s:, None] * own_values).sum(-2)
    return out.reshape(b, heads, s, head_dim).transpose(1, 2).contiguous(), None


def _own_attention(module: nn.Module, implementation: str):
    """The attention function ``implementation`` names for ``module`` (its modeling file's eager one for eager)."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if implementation != "eager" and implementation in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[implementation]
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as eager
    return eager


def _register_ttt_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(TTT_ATTENTION, ttt_attention)


_register_ttt_attention()


class DraftCache(LayerCache):
    """The draft layer's own KV cache: the verified positions' entries, then draft nodes appended while a tree
    grows and cropped back before verification. Speaks the one method of transformers' ``Cache`` that an
    attention module calls (``update``)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.append(key_states, value_states)


def _widen(linear: nn.Linear, in_features: int) -> nn.Linear:
    return nn.Linear(in_features, linear.out_features, bias=linear.bias is not None)


class EagleDraftModel(nn.Module):
    """The draft layer, its fusion ``fc``, final norm and draft head (see the module docstring).

    ``base_model`` supplies the decoder-layer class and config, the embedding table, the rotary embedding and,
    with ``config.share_lm_head``, the LM-head rows of the draft vocabulary; none of them is a submodule here.
    ``draft_vocab`` (a buffer, saved) lists the base token id of each draft column.
    """

    def __init__(self, config: EagleConfig, base_model: nn.Module, draft_vocab: torch.Tensor | None = None):
        super().__init__()
        check_supported(base_model)
        self.config = config
        base_config = base_model.config.get_text_config() if hasattr(base_model.config, "get_text_config") \
            else base_model.config
        hidden = base_config.hidden_size
        if hidden != config.hidden_size or base_config.vocab_size != config.vocab_size:
            raise ValueError(f"eagle drafter for hidden {config.hidden_size} / vocab {config.vocab_size}, but the "
                             f"base model has hidden {hidden} / vocab {base_config.vocab_size}")
        total = num_decoder_layers(base_model)
        bad = [i for i in config.aux_layers if not 0 <= i <= total]
        if bad:
            raise ValueError(f"eagle config: aux_layers {bad} out of range for a {total}-layer base (0..{total})")
        layer_config = copy.deepcopy(base_config)
        if getattr(layer_config, "layer_types", None):
            # one layer, attending to its whole context (a window-free layer of a base that mixes both kinds)
            layer_config.layer_types = ["full_attention"] * len(layer_config.layer_types)
        if config.intermediate_size is not None:
            layer_config.intermediate_size = config.intermediate_size
        template = decoder_layers(base_model)[0]
        self.layer = type(template)(layer_config, layer_idx=0)
        attn = self.layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(attn, name, _widen(getattr(attn, name), 2 * hidden))
        self.hidden_norm = copy.deepcopy(self.layer.input_layernorm)
        self._sandwich = hasattr(self.layer, "pre_feedforward_layernorm")
        self.fc = nn.Linear(len(config.aux_layers) * hidden, hidden, bias=False)
        base_norm = base_model.get_decoder().norm
        self.norm = copy.deepcopy(base_norm)
        if draft_vocab is None:
            draft_vocab = torch.arange(config.draft_vocab_size)
        draft_vocab = torch.as_tensor(draft_vocab, dtype=torch.long).reshape(-1)
        if draft_vocab.numel() != config.draft_vocab_size:
            raise ValueError(f"draft vocabulary has {draft_vocab.numel()} ids, config says {config.draft_vocab_size}")
        self.register_buffer("draft_vocab", draft_vocab, persistent=True)
        lm_head = base_model.get_output_embeddings()
        if config.share_lm_head:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
            with torch.no_grad():
                self.lm_head.weight.copy_(lm_head.weight[draft_vocab].to(self.lm_head.weight.dtype))
        self.requires_grad_(True)  # the norm copied from the frozen base came frozen
        # a lean decode step (selfspec.runtime.lean.block) fits a Llama-family layer with SiLU MLP and RMSNorms
        self._lean_ok = (not hasattr(attn, "q_norm") and not self._sandwich
                         and getattr(base_config, "hidden_act", None) == "silu"
                         and all(hasattr(n, "variance_epsilon") for n in (self.layer.input_layernorm, self.hidden_norm,
                                                                          self.layer.post_attention_layernorm))
                         and all(hasattr(attn, a) for a in ("head_dim", "scaling")))
        # Gemma 3's layer, lean: the base's lean forward run from the draft's two normed halves
        self._lean_gemma = lean.gemma3_block(base_model, self.layer) if self._sandwich else None
        # The base's modules, held outside the module tree: never trained, never saved.
        self._base = (base_model,)
        self._interface = lean.InterfaceLookup()
        self._rotary_table: tuple | None = None  # (cos, sin) [positions, head_dim] for decode steps
        self.refresh_shared()

    @property
    def base_model(self) -> nn.Module:
        return self._base[0]

    def refresh_shared(self) -> None:
        """Re-read the base LM-head rows of the draft vocabulary and the base's embedding module (after
        ``draft_vocab`` or the device changed, or the base's embeddings were replaced)."""
        head = self.base_model.get_output_embeddings()
        rows = head.weight.detach()[self.draft_vocab.to(head.weight.device)]
        bias = getattr(head, "bias", None)
        # The rows as a (frozen, unregistered) linear layer, so that the decode-time kernels apply to it too.
        shared = nn.Linear(rows.shape[1], rows.shape[0], bias=bias is not None, device="meta")
        shared.weight = nn.Parameter(rows, requires_grad=False)
        if bias is not None:
            shared.bias = nn.Parameter(bias.detach()[self.draft_vocab.to(bias.device)], requires_grad=False)
        object.__setattr__(self, "shared_head", shared)
        object.__setattr__(self, "_embedding", self.base_model.get_input_embeddings())

    def linear_layers(self) -> list[nn.Linear]:
        """Every linear layer drafting runs, the shared LM-head rows included (for ``selfspec.runtime.kernels``)."""
        layers = [m for m in self.modules() if isinstance(m, nn.Linear)]
        return layers + ([self.shared_head] if self.lm_head is None else [])

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1).to(self.draft_vocab.device)
        if ids.numel() != self.config.draft_vocab_size:
            raise ValueError(f"draft vocabulary of {ids.numel()} ids for draft_vocab_size "
                             f"{self.config.draft_vocab_size}")
        self.draft_vocab.copy_(ids)
        self.refresh_shared()
        if self.lm_head is not None:
            with torch.no_grad():
                rows = self.base_model.get_output_embeddings().weight[ids]
                self.lm_head.weight.copy_(rows.to(self.lm_head.weight))

    # ------------------------------------------------------------ the pieces
    def fuse(self, aux: Sequence[torch.Tensor]) -> torch.Tensor:
        """``[b, s, hidden]`` fused features of the base hidden states ``aux`` (one per ``aux_layers``)."""
        return self.fc(torch.cat(list(aux), dim=-1))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # the base's embedding module, found once (``refresh_shared``): transformers' lookup tries a few attribute
        # names before it, ~0.1 ms a draft step on a 2-core Zen 3 once the base's weights have streamed through
        return self._embedding(ids)

    def step(self, hidden: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor,
             attention_mask: torch.Tensor | None, cache: DraftCache | None) -> torch.Tensor:
        """One pass of the draft layer: ``hidden`` ``[b, q, hidden]`` (fused features or earlier outputs) with the
        tokens that follow them ``next_ids`` ``[b, q]`` at ``position_ids`` -> outputs ``[b, q, hidden]``.

        ``attention_mask``: bool or additive ``[b, 1, q, keys]`` over every key ``cache`` holds after this call (None:
        each query sees every key, right for a single new position). The new keys are appended to ``cache``.
        """
        embeds = self.embed(next_ids).to(hidden.dtype)
        layer = self.layer
        batch, n, width = hidden.shape
        lean_gemma = self._lean_gemma
        kernels = (lean.layer_kernels(layer, batch * n, hidden.dtype, hidden.device)
                   if self._lean_ok or lean_gemma is not None else None)
        interface = self._interface(layer.self_attn) if kernels is not None else None
        if interface is not None:
            position_embeddings = self._rotary_rows(hidden, position_ids)
        else:
            position_embeddings = self._rotary(hidden, position_ids)
        if interface is not None and position_embeddings[0].shape[-1] == layer.self_attn.head_dim:
            # Decoding on the skinny backend: the same layer as one pass of fused kernels (selfspec.runtime.lean),
            # without the module calls and the ~25 small tensor ops around its seven matmuls.
            residual = hidden.reshape(batch * n, width).contiguous()
            x = torch.cat([skinny.rms_norm(embeds.reshape(batch * n, width).contiguous(),
                                           *lean.rms_norm_args(layer.input_layernorm)),
                           skinny.rms_norm(residual, *lean.rms_norm_args(self.hidden_norm))], dim=-1)
            if lean_gemma is not None:
                update = (cache.update if cache is not None else lambda k, v: (k, v))
                return lean_gemma.block(kernels, interface, x, residual, batch, n, position_embeddings,
                                        attention_mask, update, {}).view(batch, n, width)
            if lean.FUSED_LAYERS and cache is not None and interface is skinny_attention:
                out = lean.fused_block(layer, kernels, residual, batch, n, position_embeddings, attention_mask,
                                       cache, normed=x)
                if out is not None:  # the same layer as one extension call
                    return out
            update = (cache.update if cache is not None else lambda k, v: (k, v))
            out = lean.block(layer, kernels, x, residual, batch, n, position_embeddings, attention_mask, interface,
                             update)
            return out.view(batch, n, width)
        x = torch.cat([layer.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        attn, _ = layer.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                  attention_mask=attention_mask, cache=cache)
        if self._sandwich:  # Gemma 3: the attention's output normalised, then the MLP between two norms
            hidden = hidden + layer.post_attention_layernorm(attn)
            return hidden + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(hidden)))
        hidden = hidden + attn
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    def _rotary(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` of the base's rotary embedding at ``position_ids``: for a base with one embedding per layer
        type (Gemma 3's local and global), the one the draft layer's type uses (full attention)."""
        rotary = self.base_model.get_decoder().rotary_emb
        if getattr(rotary, "layer_types", None):
            return rotary(hidden, position_ids, self.layer.self_attn.layer_type)
        return rotary(hidden, position_ids=position_ids)

    def _rotary_rows(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[b, q, head_dim]`` of the base's rotary embedding at ``position_ids``, looked up in a
        table the rotary module computed once for every position up to a power of two (a draft step's positions are
        one or two lookups, where the module runs six small ops a call). The module computes each position alone,
        so its rows are what it would give one position at a time; a drafter's inputs only shape what it
        proposes in any case."""
        needed = int(position_ids.max()) + 1
        table = self._rotary_table
        if table is None or table[0].shape[0] < needed or table[0].dtype != hidden.dtype \
                or table[0].device != hidden.device:
            size = max(1024, 1 << (needed - 1).bit_length())
            positions = torch.arange(size, device=hidden.device)[None]
            cos, sin = self._rotary(hidden[:, :1], positions)
            table = self._rotary_table = (cos[0], sin[0])
        return table[0][position_ids], table[1][position_ids]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[..., draft_vocab_size]`` of draft outputs ``[..., hidden]``."""
        shared = self.shared_head
        if self._lean_head(hidden) is not None:
            # decoding on the skinny backend: the final RMSNorm as one pass (as the lean layers run theirs)
            rows = hidden.reshape(-1, hidden.shape[-1]).contiguous()
            normed = skinny.rms_norm(rows, *lean.rms_norm_args(self.norm)).view(hidden.shape)
        else:
            normed = self.norm(hidden)
        if self.lm_head is not None:
            return self.lm_head(normed)
        if normed.dtype != shared.weight.dtype:
            bias = None if shared.bias is None else shared.bias.to(normed.dtype)
            return F.linear(normed, shared.weight.to(normed.dtype), bias)
        return shared(normed)

    def _lean_head(self, hidden: torch.Tensor):
        """The draft head's skinny kernel where decoding runs it on the skinny backend (no gradients, float32 CPU
        rows), which is where the extension's norm and ranking apply; None otherwise."""
        head = self.lm_head if self.lm_head is not None else self.shared_head
        kernel = head.__dict__.get("forward")
        if ((self._lean_ok or self._lean_gemma is not None) and not torch.is_grad_enabled()
                and hidden.dtype == torch.float32
                and hidden.device.type == "cpu" and lean.is_lean_kernel(kernel)):
            return kernel
        return None

    def top(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log-probabilities, draft columns)`` ``[rows, k]`` of the ``k`` best draft tokens below each draft output
        ``hidden [rows, hidden]``, best first: ``log_softmax(logits(hidden)).topk(k)``. On the skinny backend the
        final norm, the head and the ranking run as one extension call (``skinny.head_top``)."""
        k = min(k, self.config.draft_vocab_size)
        head = self.lm_head if self.lm_head is not None else self.shared_head
        kernel = self._lean_head(hidden)
        if kernel is not None and kernel._current(head._parameters["weight"], head._parameters.get("bias")):
            return skinny.head_top(hidden.reshape(-1, hidden.shape[-1]).contiguous(),
                                   *lean.rms_norm_args(self.norm), kernel._weight, head.out_features,
                                   head._parameters.get("bias"), k)
        top = torch.log_softmax(self.logits(hidden).float(), dim=-1).topk(k, dim=-1)
        return top.values, top.indices

    def head_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(weight [draft_vocab, hidden], bias)`` of the draft head (the trained one or the shared base rows)."""
        if self.lm_head is not None:
            return self.lm_head.weight, None
        return self.shared_head.weight, self.shared_head.bias

    # ------------------------------------------------------------ training-time test
    def forward(self, aux: Sequence[torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                steps: int) -> list[torch.Tensor]:
        """``unroll`` (what DDP calls)."""
        return self.unroll(aux, input_ids, attention_mask, steps)

    def unroll(self, aux: Sequence[torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor,
               steps: int, sparse: bool = True) -> list[torch.Tensor]:
        """The draft unrolled ``steps`` times over whole sequences (training-time test): ``[b, s, hidden]`` outputs
        of each step. Step ``j`` at position ``t`` reads ``s_{t+j+1}`` and predicts ``s_{t+j+2}``; it attends to
        the step-0 entries of positions ``<= t`` and to the step-1..j entries of position ``t`` (its own chain).

        ``sparse``: attend through ``ttt_attention`` (the chain entries as one dot product per query, so step ``j``
        costs about what step 0 costs) rather than the layer's own attention over a dense ``[s, (j + 1) s]`` mask;
        the same numbers up to float rounding."""
        b, s = input_ids.shape
        device = input_ids.device
        valid = attention_mask.bool()
        positions = torch.arange(s, device=device)
        causal = positions[None, :] <= positions[:, None]  # [q, k]
        first = (causal[None] & valid[:, None, :]) | torch.eye(s, dtype=torch.bool, device=device)[None]  # [b, q, k]
        config = self.layer.self_attn.config
        original = config._attn_implementation
        own = original or "eager"
        cache = DraftCache()
        hidden = self.fuse(aux)
        outputs = []
        pad = torch.zeros(b, 1, dtype=input_ids.dtype, device=device)
        ids = input_ids
        if sparse:
            config._attn_implementation = TTT_ATTENTION
        try:
            for j in range(steps):
                ids = torch.cat([ids[:, 1:], pad], dim=1)  # s_{t+j+1} at position t
                mask = ChainMask(first[:, None], j + 1, own)  # [b, 1, q, (j + 1) s] by its structure
                if not sparse:  # the layer's own attention over the whole mask (eager takes it additive)
                    mask = mask.dense(hidden.dtype if own == "eager" else None)
                hidden = self.step(hidden, ids, (positions + j)[None].expand(b, s), mask, cache)
                outputs.append(hidden)
        finally:
            config._attn_implementation = original
        return outputs


# ---------------------------------------------------------------- saving and loading
def _width_note(config: EagleConfig) -> str:
    return f"an MLP {config.intermediate_size} wide; " if config.intermediate_size else ""


def render_card(config: EagleConfig) -> str:
    """The README written beside a saved drafter: what it is, how it was made, how good it is per depth."""
    base = config.base_model or {}
    training = dict(config.training or {})
    command, metrics = training.pop("command", None), training.pop("metrics", None)
    name = base.get("name_or_path") or "an unnamed base model"
    if Path(name).is_absolute():  # a local directory says nothing of the model: name its architecture too
        name = (f"a {base.get('architecture') or 'causal LM'} of {base.get('num_hidden_layers', '?')} layers "
                f"(loaded from {name})")
    lines = [f"# EAGLE-3 feature drafter for {name}", "",
             f"One decoder layer of the base's own class over the fused hidden states of base layers "
             f"{config.aux_layers} (output_hidden_states indexing) and the next token's embedding; draft vocabulary "
             f"of {config.draft_vocab_size} of {config.vocab_size} tokens; "
             f"{_width_note(config)}"
             f"{'LM-head rows shared with the base (not stored here)' if config.share_lm_head else 'its own LM head'}.",
             "", "    selfspec generate --draft eagle --heads THIS_DIR --prompt '...'", ""]
    if config.accuracy:
        lines += ["## Held-out acceptance per depth (teacher-forced chain, top-1)", "", "| depth | top-1 |", "|---|---|"]
        lines += [f"| {d + 1} | {a:.3f} |" for d, a in enumerate(config.accuracy)] + [""]
    if command:
        lines += ["## How it was made", "", f"    {command}", ""]
    if metrics:
        lines += ["## Metrics", "", "```json", json.dumps(metrics, indent=2), "```", ""]
    if training:
        lines += ["## Recipe", "", "```json", json.dumps(training, indent=2), "```", ""]
    if config.decoding:
        lines += ["## Default drafting", "", f"`{json.dumps(config.decoding)}`", ""]
    lines += by_machine.card_lines(config.decoding_by_machine)
    return "\n".join(lines)


def save_pretrained(draft: EagleDraftModel, directory: str | Path, calibration: dict | None = None,
                    dtype: torch.dtype | None = None, card: str | None = None) -> Path:
    """``config.json``, ``model.safetensors`` (the draft's own weights only) and ``README.md``, written atomically.

    ``dtype``: store the floating-point weights in this dtype (``torch.float16`` halves a committed drafter; loading
    casts back to the base model's dtype, and verification keeps decoding exact either way). ``card``: the README's
    text (default: ``render_card``)."""
    from safetensors.torch import save_file

    from selfspec.runtime.io import CALIBRATION_NAME, README_NAME, WEIGHTS_NAME, atomic_directory

    directory = Path(directory)
    state = {k: v.detach().cpu().contiguous() for k, v in draft.state_dict().items()}
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    with atomic_directory(directory) as tmp:
        tmp = Path(tmp)
        draft.config.save(tmp)
        save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / README_NAME).write_text(card if card is not None else render_card(draft.config))
        if calibration is not None:
            (tmp / CALIBRATION_NAME).write_text(json.dumps(calibration, indent=2) + "\n")
    return directory


def from_pretrained(directory: str | Path, base_model: nn.Module, dtype: torch.dtype | None = None) -> EagleDraftModel:
    """A drafter saved by ``save_pretrained``, on ``base_model``'s device and dtype.

    Raises:
        FileNotFoundError: the directory or a file of it is missing.
        selfspec.runtime.identity.BaseModelMismatchError: it was trained for another base model.
        selfspec.runtime.io.DamagedDirectoryError: an incomplete or damaged directory (no completion marker, a file
            of another size or content than recorded, non-finite weights); the message names the file.
        ValueError: weights that do not match the config.
    """
    from selfspec.runtime.identity import check_base_model
    from selfspec.runtime.io import CONFIG_NAME, WEIGHTS_NAME, load_verified_weights

    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"eagle drafter directory {directory} does not exist")
    config = EagleConfig.load(directory / CONFIG_NAME)
    weights = directory / WEIGHTS_NAME
    state = load_verified_weights(directory, "eagle drafter")
    if config.base_model:
        check_base_model(config.base_model, base_model, what="eagle drafter", on_weights="warn")
    head = base_model.get_output_embeddings().weight
    draft = EagleDraftModel(config, base_model).to(device=head.device, dtype=dtype or head.dtype)
    try:
        draft.load_state_dict({k: v.to(head.device) for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights} does not match {directory / CONFIG_NAME}: {e}") from None
    draft.refresh_shared()
    return draft.eval().requires_grad_(False)
