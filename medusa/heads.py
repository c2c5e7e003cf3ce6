"""``MedusaHeads``: ResBlock heads on a frozen base model's last hidden state, each drafting one more token ahead.

Head ``k`` is ``num_layers`` ResBlocks ``x + SiLU(W x + b)`` followed by the LM head (by default the base model's
own). ``W`` and ``b`` start at zero, so before training every head returns exactly the base model's next-token
logits, and training starts from the base model's prediction rather than from noise.

All heads' ResBlock weights live in one stacked tensor, so a layer of every head is one batched matmul, and
``features`` returns every head's output at once for a single LM-head matmul (or a chunked one, in training).

Sequential heads (``config.sequential``, after Hydra, Ankner et al. 2024) make each depth see the path above it:
head ``k`` starts from the state head ``k - 1`` produced (head 0 from the base hidden state) and adds, in its first
ResBlock, a projection of the embedding of the token at depth ``k`` (the root for head 0)::

    s_0 = h_t
    s_{k+1} = ResBlocks_k(s_k, E[x_{t+k+1}]),  first block: s + SiLU(W s + U e + b)
    head k's logits = LM_head(s_{k+1})   -> token t + k + 2

so drafting runs one small step per depth (``step``) instead of one for all depths, and a head no longer has to
guess the tokens between its input and its target. The embedding table is the base model's (shared, not saved).

With ``config.prefix_attention`` the heads start from ``p_t``, the output of one causal attention block over the
base's hidden states with each position's next token (``medusa.context``), instead of from ``h_t``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from medusa.card import render_readme
from medusa.config import MedusaConfig
from medusa.context import PrefixAttention
from selfspec.runtime.adapters import copy_backbone_adapter, resolve_backbone
from selfspec.runtime.attention import rotary_of
from selfspec.runtime.identity import base_model_identity
from selfspec.runtime.io import (
    CALIBRATION_NAME,
    CONFIG_NAME,
    README_NAME,
    WEIGHTS_NAME,
    atomic_directory,
    load_verified_weights,
)
from selfspec.runtime.kernels import draft_backend, module_backend, set_module_backend


class MedusaHeads(nn.Module):
    """Medusa heads for one base model.

    Args:
        config: the heads' shape; ``hidden_size`` and ``vocab_size`` must be set (``for_model`` fills them).
        lm_head: the base model's LM head (``model.get_output_embeddings()``). Required with ``share_lm_head``;
            with private heads it initialises every head's copy (left at zero when ``None``, to be loaded).
        embeddings: the base model's input embeddings (``model.get_input_embeddings()``); required by sequential
            heads and prefix attention, which embed the drafted (or next) tokens with them.
        rotary: the base model's rotary embedding (``selfspec.runtime.attention.rotary_of``), used by prefix attention.

    Raises:
        ValueError: ``hidden_size`` / ``vocab_size`` unset, no LM head to share, an LM head of another shape, or
            sequential heads without (or with mis-shaped) embeddings.
    """

    def __init__(self, config: MedusaConfig, lm_head: nn.Module | None = None,
                 embeddings: nn.Module | None = None, rotary: nn.Module | None = None):
        super().__init__()
        if config.hidden_size is None or config.vocab_size is None:
            raise ValueError("MedusaHeads needs config.hidden_size and config.vocab_size; "
                             "MedusaHeads.for_model(model) fills them from the base model")
        heads, layers, hidden, vocab = config.num_heads, config.num_layers, config.hidden_size, config.vocab_size
        if lm_head is not None and tuple(lm_head.weight.shape) != (vocab, hidden):
            raise ValueError(f"LM head has shape {tuple(lm_head.weight.shape)}, the heads expect {(vocab, hidden)}")
        self.config = config
        # [head, layer, out, in] and [head, layer, out]: distinct weights per layer and head.
        self.resblock_weight = nn.Parameter(torch.zeros(heads, layers, hidden, hidden))
        self.resblock_bias = nn.Parameter(torch.zeros(heads, layers, hidden))
        if config.sequential or config.prefix_attention:
            weight = getattr(embeddings, "weight", None)
            if weight is None or weight.dim() != 2 or weight.shape[1] != hidden:
                raise ValueError("sequential Medusa heads and prefix attention need the base model's input embeddings "
                                 f"(model.get_input_embeddings()) of width {hidden}, got {embeddings!r}")
        object.__setattr__(self, "shared_embeddings", embeddings if config.sequential or config.prefix_attention
                           else None)  # the base's, like the shared LM head
        object.__setattr__(self, "shared_rotary", rotary if config.prefix_attention else None)
        # [head, out, embedding]: the drafted token's embedding enters head k's first ResBlock.
        self.token_weight = nn.Parameter(torch.zeros(heads, hidden, hidden)) if config.sequential else None
        self.prefix = None
        if config.prefix_attention:
            if not config.prefix_num_heads or not config.prefix_head_dim:
                raise ValueError("prefix attention needs config.prefix_num_heads and prefix_head_dim "
                                 "(MedusaHeads.for_model fills them from the base model)")
            self.prefix = PrefixAttention(hidden, config.prefix_num_heads, config.prefix_head_dim,
                                          config.prefix_mlp_size)
        if config.share_lm_head:
            if lm_head is None:
                raise ValueError("share_lm_head=True needs the base model's LM head (model.get_output_embeddings())")
            # Kept out of the module tree on purpose: parameters() and state_dict() then hold exactly the heads'
            # own weights, so the optimizer and save_pretrained never touch (or duplicate) the base model's head.
            object.__setattr__(self, "shared_lm_head", lm_head)
            self.lm_head_weight = self.lm_head_bias = None
        else:
            object.__setattr__(self, "shared_lm_head", None)
            base_bias = getattr(lm_head, "bias", None) if lm_head is not None else None
            # [head, vocab, hidden], copied in the base head's own dtype so that the copy is exact.
            weight = torch.zeros(heads, vocab, hidden) if lm_head is None else (
                lm_head.weight.detach().unsqueeze(0).repeat(heads, 1, 1))
            self.lm_head_weight = nn.Parameter(weight)
            self.lm_head_bias = None
            if base_bias is not None:
                self.lm_head_bias = nn.Parameter(base_bias.detach().unsqueeze(0).repeat(heads, 1))  # [head, vocab]
        if config.draft_vocab_size:
            # Token ids of the reduced draft vocabulary, most frequent first (set by training; saved with the heads).
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size, dtype=torch.long))
        else:
            self.draft_vocab = None
        self._draft_weight: torch.Tensor | None = None
        self._draft_head: nn.Linear | None = None  # _draft_weight as a layer, when it runs on the skinny kernel

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def features(self, hidden_states: torch.Tensor, num_heads: int | None = None,
                 tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``[batch, seq, hidden]`` base hidden states -> ``[num_heads, batch, seq, hidden]`` head outputs.

        ``num_heads`` computes only the first heads (a tree of depth ``d`` needs the first ``d``). Sequential heads
        (and prefix attention) also need ``tokens`` ``[batch, seq, num_heads]``: ``tokens[b, t, k]`` is the token
        head ``k`` reads, i.e. ``x_{t+k+1}`` (teacher forcing; ``path_tokens`` builds it from input ids). Prefix
        attention runs causally over the ``seq`` positions (right padding needs no mask).

        Raises:
            ValueError: sequential heads or prefix attention without ``tokens`` (or with too few of them).
        """
        k = self.config.num_heads if num_heads is None else num_heads
        needed = k if self.config.sequential else 1 if self.prefix is not None else 0
        if needed and (tokens is None or tokens.shape[-1] < needed or tokens.shape[:-1] != hidden_states.shape[:-1]):
            raise ValueError(f"sequential Medusa heads / prefix attention need tokens "
                             f"[{', '.join(map(str, hidden_states.shape[:-1]))}, >= {needed}] (the path each head "
                             f"reads), got {None if tokens is None else tuple(tokens.shape)}")
        if self.prefix is not None:
            hidden_states = self.context(hidden_states, tokens[..., 0])
        return self.head_features(hidden_states, k, tokens)

    def head_features(self, states: torch.Tensor, num_heads: int | None = None,
                      tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``features`` after the prefix attention: ``[batch, seq, hidden]`` start states (``h_t``, or ``p_t`` with
        prefix attention) -> ``[num_heads, batch, seq, hidden]``."""
        k = self.config.num_heads if num_heads is None else num_heads
        hidden_states = states
        if self.config.sequential:
            out, state = [], hidden_states
            for head in range(k):
                state = self.step(state, tokens[..., head], head)
                out.append(state)
            return torch.stack(out)
        hidden = self.config.hidden_size
        lead = hidden_states.shape[:-1]
        x = hidden_states.to(self.resblock_weight.dtype).reshape(1, -1, hidden).expand(k, -1, -1)  # [k, tokens, hidden]
        for layer in range(self.config.num_layers):
            weight = self.resblock_weight[:k, layer].transpose(1, 2)  # [k, in, out]
            bias = self.resblock_bias[:k, layer].unsqueeze(1)  # [k, 1, out]
            x = x + F.silu(torch.baddbmm(bias, x, weight))
        return x.reshape(k, *lead, hidden)

    def context(self, hidden_states: torch.Tensor, next_tokens: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache=None) -> torch.Tensor:
        """Prefix attention (``config.prefix_attention``): ``[b, q, hidden]`` base hidden states and ``[b, q]`` ids of
        each position's next token -> ``[b, q, hidden]`` states the heads start from. ``cache``
        (``selfspec.runtime.attention.LayerCache``) holds earlier positions at decode time; the new ones are appended."""
        if self.prefix is None:
            raise ValueError("these heads have no prefix attention (config.prefix_attention is false)")
        dtype = self.resblock_weight.dtype
        embedded = F.embedding(next_tokens, self.shared_embeddings.weight).to(dtype)
        return self.prefix(hidden_states.to(dtype), embedded, self.shared_rotary, position_ids, cache)

    def step(self, state: torch.Tensor, tokens: torch.Tensor, head: int) -> torch.Tensor:
        """Sequential heads: head ``head``'s output state from the previous state ``[..., hidden]`` (the base hidden
        state for head 0) and the token ids ``[...]`` at its depth. Its logits are ``logits(result[None])[0]``."""
        if not self.config.sequential:
            raise ValueError("step() is for sequential heads; these heads all read the one hidden state (features)")
        embedding = F.embedding(tokens, self.shared_embeddings.weight).to(self.resblock_weight.dtype)
        x = state.to(self.resblock_weight.dtype)
        for layer in range(self.config.num_layers):
            pre = F.linear(x, self.resblock_weight[head, layer], self.resblock_bias[head, layer])
            if layer == 0:
                pre = pre + F.linear(embedding, self.token_weight[head])
            x = x + F.silu(pre)
        return x

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[k, ..., hidden]`` head features (the first ``k`` heads) -> ``[k, ..., vocab]`` logits."""
        if self.shared_lm_head is not None:
            head = self.shared_lm_head
            # One matmul for all heads: the LM head broadcasts over the leading head axis.
            return head(features.to(head.weight.dtype))
        k, lead = features.shape[0], features.shape[1:-1]
        flat = features.reshape(k, -1, features.shape[-1]).to(self.lm_head_weight.dtype)
        weight = self.lm_head_weight[:k].transpose(1, 2)  # [k, hidden, vocab]
        out = torch.bmm(flat, weight) if self.lm_head_bias is None else torch.baddbmm(
            self.lm_head_bias[:k].unsqueeze(1), flat, weight)
        return out.reshape(k, *lead, -1)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Set the reduced draft vocabulary (``config.draft_vocab_size`` distinct ids, most frequent first).

        Raises:
            ValueError: the heads have no draft vocabulary, or the ids are the wrong number, repeat, or fall outside
                the vocabulary.
        """
        if self.draft_vocab is None:
            raise ValueError("these heads draft from the full vocabulary (config.draft_vocab_size is None)")
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if token_ids.numel() != self.draft_vocab.numel() or token_ids.unique().numel() != token_ids.numel():
            raise ValueError(f"draft vocabulary: need {self.draft_vocab.numel()} distinct ids, got "
                             f"{token_ids.numel()} ({token_ids.unique().numel()} distinct)")
        if token_ids.min() < 0 or token_ids.max() >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary: ids must be in 0..{self.config.vocab_size - 1}")
        self.draft_vocab.copy_(token_ids)
        self._draft_weight = self._draft_head = None

    def draft_logits(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[k, ..., hidden]`` head features -> ``(logits [k, ..., columns], column token ids)``, the draft-logits
        contract every drafter keeps (``decoding.drafter``): with a draft vocabulary, column ``j`` is token
        ``draft_vocab[j]``; without one, the full-vocabulary ``logits`` and ``None``."""
        if self.draft_vocab is None:
            return self.logits(features), None
        head = self.shared_lm_head
        if self._draft_weight is None or self._draft_weight.device != features.device:
            # Gathered once: slicing the rows every step would cost as much as the product it saves.
            self._draft_weight = head.weight.detach()[self.draft_vocab].contiguous()
            self._draft_head = None
        flat = features.reshape(-1, features.shape[-1]).to(self._draft_weight.dtype)
        bias = getattr(head, "bias", None)
        bias = None if bias is None else bias[self.draft_vocab]
        if module_backend(head) == "skinny":
            # The base's LM head runs on the skinny kernel: its draft slice is the same few-row product, so it
            # runs there too, through the same per-layer mechanism (repacking, fallbacks for grad and many rows).
            if self._draft_head is None:
                # kept out of the module tree: a view of the shared LM head's rows, not a weight of these heads
                # (registered, it entered state_dict and the saved heads no longer loaded)
                object.__setattr__(self, "_draft_head", _linear_of(self._draft_weight, bias))
            set_module_backend(self._draft_head, draft_backend("skinny"))  # float16 panels unless turned off
            out = self._draft_head(flat)
        else:
            # weight @ x.T: for the few rows of a draft this GEMM shape is fast with every CPU BLAS (x @ weight.T is
            # not, for 2-3 rows); the drafter's rounding never affects what verification accepts.
            out = (self._draft_weight @ flat.T).T
            if bias is not None:
                out = out + bias
        return out.reshape(*features.shape[:-1], -1), self.draft_vocab

    def head_draft_logits(self, features: torch.Tensor, head: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[rows, hidden]`` outputs of one head -> ``(logits [rows, columns], column token ids or None)`` through
        that head's LM head (the shared one, restricted to the draft vocabulary when there is one)."""
        if self.shared_lm_head is not None:
            logits, ids = self.draft_logits(features.unsqueeze(0))
            return logits[0], ids
        bias = None if self.lm_head_bias is None else self.lm_head_bias[head]
        return F.linear(features.to(self.lm_head_weight.dtype), self.lm_head_weight[head], bias), None

    def forward(self, hidden_states: torch.Tensor, num_heads: int | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
        """``[batch, seq, hidden]`` -> ``[num_heads, batch, seq, vocab]``: head ``k``'s logits for position
        ``t + k + 2`` from the hidden state at position ``t`` (sequential heads: and ``tokens``, see ``features``)."""
        return self.logits(self.features(hidden_states, num_heads, tokens))

    @classmethod
    def for_model(cls, model: nn.Module, *, dtype: torch.dtype | None = None, **overrides) -> MedusaHeads:
        """Fresh (zero-initialised) heads for ``model``; ``overrides`` are ``MedusaConfig`` fields.

        ``hidden_size``, ``vocab_size`` and ``base_model`` are read from the model. The heads live on the LM head's
        device, in ``dtype`` (default: the LM head's dtype).

        Raises:
            ValueError: an unknown or invalid config field, or a field that is read from the model.
        """
        filled = sorted({"hidden_size", "vocab_size", "base_model"} & set(overrides))
        if filled:
            raise ValueError(f"MedusaHeads.for_model reads {filled} from the base model; do not pass them")
        lm_head = _output_embeddings(model)
        vocab, hidden = lm_head.weight.shape
        if overrides.get("prefix_attention"):
            text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
            num_heads = overrides.get("prefix_num_heads") or text.num_attention_heads
            head_dim = overrides.get("prefix_head_dim") or getattr(text, "head_dim", None) or int(hidden) // num_heads
            overrides = {**overrides, "prefix_num_heads": num_heads, "prefix_head_dim": head_dim}
        config = MedusaConfig.from_dict({**overrides, "hidden_size": int(hidden), "vocab_size": int(vocab),
                                         "base_model": base_model_identity(model)})
        heads = cls(config, lm_head, *_shared_inputs(model, config))
        return heads.to(device=lm_head.weight.device, dtype=dtype or lm_head.weight.dtype)

    def save_pretrained(self, directory: str | Path, *, backbone_adapter: str | Path | None = None,
                        calibration: dict | None = None) -> Path:
        """Write ``config.json``, ``model.safetensors`` (the heads' own weights only) and ``README.md`` to
        ``directory``, atomically: a crash leaves either the old directory or the complete new one. The only
        writer of a heads directory: training saves through it, and so does tree calibration, with its report in
        ``calibration`` (written to ``calibration.json``).

        ``backbone_adapter``: a folder written by ``selfspec.runtime.adapters.export_backbone_adapter`` (Medusa-2), copied
        into the directory in the same atomic write; ``config.backbone_adapter`` must describe it.

        Raises:
            ValueError: an adapter folder without ``config.backbone_adapter``, or the other way round.
        """
        directory = Path(directory)
        if (backbone_adapter is None) != (self.config.backbone_adapter is None):
            raise ValueError("save_pretrained: pass the adapter folder exactly when config.backbone_adapter is set")
        state = {name: tensor.detach().cpu().contiguous() for name, tensor in self.state_dict().items()}
        with atomic_directory(directory) as tmp:
            tmp = Path(tmp)
            if backbone_adapter is not None:
                copy_backbone_adapter(backbone_adapter, tmp)
            self.config.save(tmp)
            save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            (tmp / README_NAME).write_text(render_readme(self.config))
            if calibration is not None:
                (tmp / CALIBRATION_NAME).write_text(json.dumps(calibration, indent=2) + "\n")
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, base_model: nn.Module, *, dtype: torch.dtype | None = None,
                        merge_adapter: bool = False) -> MedusaHeads:
        """Load heads saved by ``save_pretrained`` onto ``base_model`` (whose LM head they share).

        Medusa-2 heads belong to the base with their LoRA adapter merged: ``base_model`` must be that adapted
        model (``selfspec.runtime.models.load_model(directory)`` loads it), or the plain base with ``merge_adapter=True``,
        which merges the adapter into ``base_model`` in place.

        Raises:
            FileNotFoundError: the directory, its ``config.json``, its ``model.safetensors`` or its adapter does not
                exist.
            selfspec.runtime.identity.BaseModelMismatchError: the heads were trained for another base model (or for the
                adapted one, and the plain base was given without ``merge_adapter``).
            ValueError: an invalid config, or weights that do not match it.
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise FileNotFoundError(f"Medusa heads directory {directory} does not exist")
        config = MedusaConfig.load(directory / CONFIG_NAME)
        weights = directory / WEIGHTS_NAME
        if not weights.is_file():
            raise FileNotFoundError(f"Medusa heads weights {weights} do not exist")
        state = load_verified_weights(directory, "Medusa heads")
        resolve_backbone(base_model, directory, config.base_model, what=f"Medusa heads {directory}",
                         merge_adapter=merge_adapter)
        lm_head = _output_embeddings(base_model)
        # Cast before loading: loading first would round float64 weights through the float32 init.
        heads = cls(config, lm_head, *_shared_inputs(base_model, config))
        heads = heads.to(device=lm_head.weight.device, dtype=dtype or lm_head.weight.dtype)
        try:
            heads.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise ValueError(f"{weights} does not match {directory / CONFIG_NAME}: {e}") from None
        return heads.eval()


def path_tokens(input_ids: torch.Tensor, num_heads: int, pad_id: int = 0) -> torch.Tensor:
    """``[batch, seq]`` ids -> ``[batch, seq, num_heads]``: entry ``[b, t, k]`` is ``input_ids[b, t + k + 1]``, the
    token sequential head ``k`` reads at position ``t`` under teacher forcing (``pad_id`` past the end, where no
    head has a target anyway)."""
    batch, seq = input_ids.shape
    out = torch.full((batch, seq, num_heads), pad_id, dtype=input_ids.dtype, device=input_ids.device)
    for k in range(num_heads):
        if seq > k + 1:
            out[:, :seq - k - 1, k] = input_ids[:, k + 1:]
    return out


def _shared_inputs(model: nn.Module, config: MedusaConfig) -> tuple[nn.Module | None, nn.Module | None]:
    """``(embeddings, rotary)`` of the base model that heads of this config read (None where they read nothing)."""
    embeddings = model.get_input_embeddings() if config.sequential or config.prefix_attention else None
    return embeddings, rotary_of(model) if config.prefix_attention else None


def _linear_of(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """A frozen ``nn.Linear`` around ``weight`` ``[out, in]`` (and ``bias``), sharing their storage."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return layer


def _output_embeddings(model: nn.Module) -> nn.Module:
    lm_head = model.get_output_embeddings()
    if lm_head is None or getattr(lm_head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} has no LM head (get_output_embeddings() returned {lm_head!r})")
    return lm_head
