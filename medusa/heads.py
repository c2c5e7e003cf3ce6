"""``MedusaHeads``: ResBlock heads on a frozen base model's last hidden state, each drafting one more token ahead.

Head ``k`` is ``num_layers`` ResBlocks ``x + SiLU(W x + b)`` followed by the LM head (by default the base model's
own). ``W`` and ``b`` start at zero, so before training every head returns exactly the base model's next-token
logits, and training starts from the base model's prediction rather than from noise.

All heads' ResBlock weights live in one stacked tensor, so a layer of every head is one batched matmul, and
``features`` returns every head's output at once for a single LM-head matmul (or a chunked one, in training).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from selfspec.adapters import copy_backbone_adapter, resolve_backbone
from selfspec.identity import base_model_identity
from selfspec.io import atomic_directory

from .card import render_readme
from .config import CONFIG_NAME, MedusaConfig

WEIGHTS_NAME = "model.safetensors"
README_NAME = "README.md"


class MedusaHeads(nn.Module):
    """Medusa heads for one base model.

    Args:
        config: the heads' shape; ``hidden_size`` and ``vocab_size`` must be set (``for_model`` fills them).
        lm_head: the base model's LM head (``model.get_output_embeddings()``). Required with ``share_lm_head``;
            with private heads it initialises every head's copy (left at zero when ``None``, to be loaded).

    Raises:
        ValueError: ``hidden_size`` / ``vocab_size`` unset, no LM head to share, or an LM head of another shape.
    """

    def __init__(self, config: MedusaConfig, lm_head: nn.Module | None = None):
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

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def features(self, hidden_states: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """``[batch, seq, hidden]`` base hidden states -> ``[num_heads, batch, seq, hidden]`` ResBlock outputs.

        ``num_heads`` computes only the first heads (a tree of depth ``d`` needs the first ``d``).
        """
        k = self.config.num_heads if num_heads is None else num_heads
        hidden = self.config.hidden_size
        lead = hidden_states.shape[:-1]
        x = hidden_states.to(self.resblock_weight.dtype).reshape(1, -1, hidden).expand(k, -1, -1)  # [k, tokens, hidden]
        for layer in range(self.config.num_layers):
            weight = self.resblock_weight[:k, layer].transpose(1, 2)  # [k, in, out]
            bias = self.resblock_bias[:k, layer].unsqueeze(1)  # [k, 1, out]
            x = x + F.silu(torch.baddbmm(bias, x, weight))
        return x.reshape(k, *lead, hidden)

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
        self._draft_weight = None

    def draft_logits(self, features: torch.Tensor) -> torch.Tensor:
        """``[k, ..., hidden]`` head features -> ``[k, ..., draft_vocab_size]`` logits over the draft vocabulary
        (column ``j`` is token ``draft_vocab[j]``); the full ``logits`` without a draft vocabulary."""
        if self.draft_vocab is None:
            return self.logits(features)
        head = self.shared_lm_head
        if self._draft_weight is None or self._draft_weight.device != features.device:
            # Gathered once: slicing the rows every step would cost as much as the product it saves.
            self._draft_weight = head.weight.detach()[self.draft_vocab].contiguous()
        flat = features.reshape(-1, features.shape[-1]).to(self._draft_weight.dtype)
        # weight @ x.T: for the few rows of a draft this GEMM shape is fast with every CPU BLAS (x @ weight.T is
        # not, for 2-3 rows); the drafter's rounding never affects what verification accepts.
        out = (self._draft_weight @ flat.T).T
        bias = getattr(head, "bias", None)
        if bias is not None:
            out = out + bias[self.draft_vocab]
        return out.reshape(*features.shape[:-1], -1)

    def forward(self, hidden_states: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """``[batch, seq, hidden]`` -> ``[num_heads, batch, seq, vocab]``: head ``k``'s logits for position
        ``t + k + 2`` from the hidden state at position ``t``."""
        return self.logits(self.features(hidden_states, num_heads))

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
        config = MedusaConfig.from_dict({**overrides, "hidden_size": int(hidden), "vocab_size": int(vocab),
                                         "base_model": base_model_identity(model)})
        heads = cls(config, lm_head)
        return heads.to(device=lm_head.weight.device, dtype=dtype or lm_head.weight.dtype)

    def save_pretrained(self, directory: str | Path, *, backbone_adapter: str | Path | None = None) -> Path:
        """Write ``config.json``, ``model.safetensors`` (the heads' own weights only) and ``README.md`` to
        ``directory``, atomically: a crash leaves either the old directory or the complete new one.

        ``backbone_adapter``: a folder written by ``selfspec.adapters.export_backbone_adapter`` (Medusa-2), copied
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
        return directory

    @classmethod
    def from_pretrained(cls, directory: str | Path, base_model: nn.Module, *, dtype: torch.dtype | None = None,
                        merge_adapter: bool = False) -> MedusaHeads:
        """Load heads saved by ``save_pretrained`` onto ``base_model`` (whose LM head they share).

        Medusa-2 heads belong to the base with their LoRA adapter merged: ``base_model`` must be that adapted
        model (``selfspec.models.load_model(directory)`` loads it), or the plain base with ``merge_adapter=True``,
        which merges the adapter into ``base_model`` in place.

        Raises:
            FileNotFoundError: the directory, its ``config.json``, its ``model.safetensors`` or its adapter does not
                exist.
            selfspec.identity.BaseModelMismatchError: the heads were trained for another base model (or for the
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
        resolve_backbone(base_model, directory, config.base_model, what=f"Medusa heads {directory}",
                         merge_adapter=merge_adapter)
        lm_head = _output_embeddings(base_model)
        # Cast before loading: loading first would round float64 weights through the float32 init.
        heads = cls(config, lm_head).to(device=lm_head.weight.device, dtype=dtype or lm_head.weight.dtype)
        try:
            heads.load_state_dict(load_file(str(weights)), strict=True)
        except RuntimeError as e:
            raise ValueError(f"{weights} does not match {directory / CONFIG_NAME}: {e}") from None
        return heads.eval()


def _output_embeddings(model: nn.Module) -> nn.Module:
    lm_head = model.get_output_embeddings()
    if lm_head is None or getattr(lm_head, "weight", None) is None:
        raise ValueError(f"{type(model).__name__} has no LM head (get_output_embeddings() returned {lm_head!r})")
    return lm_head
