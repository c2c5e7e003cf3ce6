"""The exit classifier at layer E: turns the hidden state after ``layers[:E]`` into next-token logits.

Always the base model's shared LM head (never saved with the classifier), preceded by the base final norm
(LayerSkip: training-free) or a trained copy of it (``own_norm``), and optionally by a small trained adapter of
zero-initialised ResBlocks ``x + SiLU(W x)`` (Kangaroo-style; zero init means an untrained adapter is exactly the
training-free classifier). An optional reduced draft vocabulary scores only the LM-head rows of the most frequent
tokens, which cuts the dominant cost of a shallow draft on CPU; token ids are mapped back to the full vocabulary.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .layers import check_supported, num_layers

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
KIND = "early-exit"


@dataclass
class ExitClassifierConfig:
    """What an exit classifier is; written to ``config.json`` beside the weights.

    Attributes:
        exit_layer: E, the number of base decoder layers the draft runs (1..L-1).
        adapter_layers: ResBlocks before the norm (0 = none, the training-free LayerSkip classifier).
        own_norm: train a copy of the base final norm instead of reusing it.
        draft_vocab_size: number of LM-head rows the draft scores (None = the full vocabulary).
        base_model: identity of the base model the classifier was trained on (see ``selfspec.identity``).
        metrics: free-form evaluation numbers (top-1 agreement with the full model, ...).
        policy: default draft policy options (``max_depth``, ``threshold``...); callers may override them.
    """

    exit_layer: int
    adapter_layers: int = 0
    own_norm: bool = False
    draft_vocab_size: int | None = None
    base_model: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    policy: dict[str, Any] = field(default_factory=dict)
    kind: str = KIND

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExitClassifierConfig:
        """Raises: ValueError: not an early-exit config, or unknown keys."""
        if data.get("kind", KIND) != KIND:
            raise ValueError(f"config is for a {data.get('kind')!r} drafter, not an early-exit classifier")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown early-exit config keys: {', '.join(unknown)}")
        return cls(**data)


def check_exit_layer(exit_layer: int, model) -> None:
    """Raises: ValueError: ``exit_layer`` is not in 1..L-1 (L = the base model's number of decoder layers)."""
    total = num_layers(model)
    if not isinstance(exit_layer, int) or not 1 <= exit_layer <= total - 1:
        raise ValueError(f"exit_layer must be an integer in 1..{total - 1} for this {total}-layer model, got {exit_layer!r}")


class ResBlock(nn.Module):
    """``x + SiLU(W x)`` with W zero-initialised: starts as the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class ExitClassifier(nn.Module):
    """Trainable parts of an exit classifier; the base norm and LM head are passed in as ``model`` at call time so
    they are shared, never copied or saved."""

    def __init__(self, config: ExitClassifierConfig, model):
        super().__init__()
        check_supported(model)
        check_exit_layer(config.exit_layer, model)
        self.config = config
        base = next(model.parameters())
        hidden_size = model.config.hidden_size
        self.adapter = nn.ModuleList(ResBlock(hidden_size) for _ in range(config.adapter_layers))
        self.norm = None
        if config.own_norm:
            self.norm = _copy_module(model.model.norm)
        vocab = model.get_output_embeddings().weight.shape[0]
        if config.draft_vocab_size is not None and not 1 <= config.draft_vocab_size <= vocab:
            raise ValueError(f"draft_vocab_size must be in 1..{vocab}, got {config.draft_vocab_size}")
        # Token ids of the reduced draft vocabulary, most frequent first (filled by training or set_draft_vocab).
        size = config.draft_vocab_size or 0
        self.register_buffer("draft_vocab", torch.arange(size, dtype=torch.long))
        self.to(device=base.device, dtype=base.dtype)
        self._draft_weight: torch.Tensor | None = None

    @property
    def exit_layer(self) -> int:
        return self.config.exit_layer

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Raises: ValueError: wrong number of ids, or repeated ids."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if token_ids.numel() != self.draft_vocab.numel():
            raise ValueError(f"draft vocabulary: expected {self.draft_vocab.numel()} ids, got {token_ids.numel()}")
        if token_ids.unique().numel() != token_ids.numel():
            raise ValueError("draft vocabulary: token ids repeat")
        self.draft_vocab.copy_(token_ids)
        self._draft_weight = None

    def features(self, hidden: torch.Tensor, model) -> torch.Tensor:
        """``[..., hidden]`` after adapter and norm: what the LM head reads."""
        for block in self.adapter:
            hidden = block(hidden)
        norm = self.norm if self.norm is not None else model.model.norm
        return norm(hidden)

    def forward(self, hidden: torch.Tensor, model, features_only: bool = False) -> torch.Tensor:
        """Full-vocabulary logits ``[..., vocab]``, or with ``features_only`` what the LM head reads (training
        goes through ``forward`` so that DDP sees the call, and computes the logits in chunks itself)."""
        features = self.features(hidden, model)
        return features if features_only else model.get_output_embeddings()(features)

    def draft_logits(self, hidden: torch.Tensor, model) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits the draft ranks, and the full-vocabulary id of each column (None: columns are the ids)."""
        features = self.features(hidden, model)
        head = model.get_output_embeddings()
        if not self.draft_vocab.numel():
            return head(features), None
        if self._draft_weight is None or self._draft_weight.device != features.device:
            # Gathered once: slicing 49152 rows every step would cost as much as the product it saves.
            self._draft_weight = head.weight.detach()[self.draft_vocab]
        bias = head.bias[self.draft_vocab] if getattr(head, "bias", None) is not None else None
        return nn.functional.linear(features, self._draft_weight, bias), self.draft_vocab

    def save_pretrained(self, directory: str | Path, model, notes: str = "") -> Path:
        """Write ``config.json`` (stamped with ``model``'s identity, which loading checks), ``model.safetensors``
        (only the classifier's own tensors) and a README (the config and metrics, then ``notes``)."""
        from safetensors.torch import save_file

        from selfspec.identity import base_model_identity
        from selfspec.io import atomic_directory

        self.config.base_model = base_model_identity(model)
        with atomic_directory(directory) as tmp:
            tmp = Path(tmp)
            (tmp / CONFIG_NAME).write_text(self.config.to_json())
            tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "kind": KIND})
            (tmp / "README.md").write_text(default_readme(self.config) + notes)
        return Path(directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, model) -> ExitClassifier:
        """Load a classifier saved by :meth:`save_pretrained` onto ``model``.

        Raises:
            FileNotFoundError: ``directory`` lacks config.json or model.safetensors.
            ValueError: the classifier was trained for another base model, or its exit layer does not fit ``model``.
        """
        from safetensors.torch import load_file

        from selfspec.identity import check_base_model

        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory} is not an early-exit classifier directory: no {name}")
        config = ExitClassifierConfig.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
        check_base_model(config.base_model, model, what=f"early-exit classifier {directory}")
        classifier = cls(config, model)
        tensors = load_file(str(directory / WEIGHTS_NAME))
        classifier.load_state_dict(tensors)
        return classifier.eval()


def new_classifier(model, exit_layer: int, *, adapter_layers: int = 0, own_norm: bool = False,
                   draft_vocab: torch.Tensor | None = None) -> ExitClassifier:
    """A fresh classifier for ``model`` (with no adapter: the training-free one).

    Raises:
        ValueError: ``exit_layer`` outside 1..L-1, or an unsupported architecture.
    """
    check_exit_layer(exit_layer, model)
    size = None if draft_vocab is None else int(torch.as_tensor(draft_vocab).numel())
    config = ExitClassifierConfig(exit_layer=exit_layer, adapter_layers=adapter_layers, own_norm=own_norm,
                                  draft_vocab_size=size)
    classifier = ExitClassifier(config, model)
    if draft_vocab is not None:
        classifier.set_draft_vocab(draft_vocab)
    return classifier


def _copy_module(module: nn.Module) -> nn.Module:
    import copy

    clone = copy.deepcopy(module)
    for p in clone.parameters():
        p.requires_grad_(True)
    return clone


def default_readme(config: ExitClassifierConfig) -> str:
    name = config.base_model.get("name_or_path") or "the base model"
    lines = [f"# Early-exit classifier for {name}", "",
             f"Exit layer {config.exit_layer}; adapter ResBlocks: {config.adapter_layers}; own norm: {config.own_norm}; "
             f"draft vocabulary: {config.draft_vocab_size or 'full'}.", "",
             "Use: `selfspec generate --draft early-exit --heads DIR`.", ""]
    if config.metrics:
        lines += ["## Metrics", "", "```json", json.dumps(config.metrics, indent=2, sort_keys=True), "```", ""]
    return "\n".join(lines)
