"""The exit classifier at layer E: turns the hidden state after ``layers[:E]`` into next-token logits.

Always the base model's shared LM head (never saved with the classifier), preceded by the base final norm
(LayerSkip: training-free) or a trained copy of it (``own_norm``), and optionally by a small trained adapter
(``early_exit.adapter``): zero-initialised ResBlocks ``x + SiLU(W x)``, or one attention-only block over the
previous positions' exit-layer states (Kangaroo); zero init means an untrained adapter is exactly the
training-free classifier. An optional reduced draft vocabulary scores only the LM-head rows of the most frequent
tokens, which cuts the dominant cost of a shallow draft on CPU; token ids are mapped back to the full vocabulary.

A classifier trained together with a LoRA adapter on the backbone (LayerSkip fine-tuning, ``method: layerskip``)
carries that adapter in ``backbone_adapter/`` and belongs to the adapted model (``selfspec.runtime.adapters``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from decoding import by_machine
from early_exit.adapter import ADAPTER_KINDS, AdapterCache, AttentionAdapter, ResBlock
from early_exit.layers import check_supported
from selfspec.runtime.adapters import copy_backbone_adapter, resolve_backbone
from selfspec.runtime.identity import base_model_identity
from selfspec.runtime.io import CALIBRATION_NAME, CONFIG_NAME, WEIGHTS_NAME, atomic_directory, load_verified_weights
from selfspec.runtime.layers import num_decoder_layers

KIND = "early-exit"


@dataclass
class ExitClassifierConfig:
    """What an exit classifier is; written to ``config.json`` beside the weights.

    Attributes:
        exit_layer: E, the number of base decoder layers the draft runs (1..L-1).
        adapter_layers: adapter blocks before the norm (0 = none, the training-free LayerSkip classifier); the
            attention adapter is exactly one block.
        adapter: ``resblock`` (position-wise ResBlocks) or ``attention`` (one causal attention-only block with
            its own KV cache at decode time).
        adapter_heads: attention heads of the attention adapter (None = the base model's head count).
        adapter_mlp_size: inner size of a SwiGLU MLP after the attention adapter's attention (0 = attention only).
        own_norm: train a copy of the base final norm instead of reusing it.
        draft_vocab_size: number of LM-head rows the draft scores (None = the full vocabulary).
        base_model: identity of the base model the classifier was trained on (see ``selfspec.runtime.identity``); with a
            backbone adapter, the identity of the model before the adapter.
        backbone_adapter: set by LayerSkip fine-tuning: ``{"path", "adapted_model"}`` of the LoRA adapter saved
            beside the classifier (``selfspec.runtime.adapters``); None for a classifier on a frozen base.
        metrics: free-form evaluation numbers (top-1 agreement with the full model, ...).
        policy: default draft policy options (``max_depth``, ``threshold``...); callers may override them.
        policy_by_machine: draft policies calibrated per kind of machine (``decoding.by_machine``): where the
            machine running the classifier has an entry, its policy replaces ``policy``.
    """

    exit_layer: int
    adapter_layers: int = 0
    adapter: str = "resblock"
    adapter_heads: int | None = None
    adapter_mlp_size: int = 0
    own_norm: bool = False
    draft_vocab_size: int | None = None
    base_model: dict[str, Any] = field(default_factory=dict)
    backbone_adapter: dict[str, Any] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    policy: dict[str, Any] = field(default_factory=dict)
    policy_by_machine: dict[str, Any] = field(default_factory=dict)
    kind: str = KIND

    def __post_init__(self) -> None:
        check_adapter(self.adapter, self.adapter_layers, self.adapter_heads, self.adapter_mlp_size)
        by_machine.check_entries(self.policy_by_machine, "early-exit config: policy_by_machine")

    def policy_for(self, machine: str) -> tuple[dict[str, Any], str]:
        """``(options, where)``: the draft policy saved for machines of class ``machine``, else the default
        (``decoding.by_machine.policy_for``)."""
        return by_machine.policy_for(self.policy, self.policy_by_machine, machine, ("policy", "policy_by_machine"))

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ExitClassifierConfig:
        """Raises: ValueError: not an early-exit config, unknown keys, or a bad adapter."""
        if data.get("kind", KIND) != KIND:
            raise ValueError(f"config is for a {data.get('kind')!r} drafter, not an early-exit classifier")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown early-exit config keys: {', '.join(unknown)}")
        return cls(**data)


def check_exit_layer(exit_layer: int, model) -> None:
    """Raises: ValueError: ``exit_layer`` is not in 1..L-1 (L = the base model's number of decoder layers)."""
    total = num_decoder_layers(model)
    if not isinstance(exit_layer, int) or not 1 <= exit_layer <= total - 1:
        raise ValueError(f"exit_layer must be an integer in 1..{total - 1} for this {total}-layer model, got {exit_layer!r}")


def check_adapter(adapter: str, adapter_layers: int, adapter_heads: int | None = None, adapter_mlp_size: int = 0) -> None:
    """Raises: ValueError: an unknown adapter kind, a negative block count, an attention adapter that is not
    exactly one block, a bad head count, or an MLP size on a non-attention adapter."""
    if isinstance(adapter_mlp_size, bool) or not isinstance(adapter_mlp_size, int) or adapter_mlp_size < 0:
        raise ValueError(f"adapter_mlp_size must be an integer >= 0, got {adapter_mlp_size!r}")
    if adapter_mlp_size and adapter != "attention":
        raise ValueError("adapter_mlp_size applies to the attention adapter only (adapter: attention)")
    if adapter not in ADAPTER_KINDS:
        raise ValueError(f"unknown adapter kind {adapter!r}; known: {', '.join(ADAPTER_KINDS)}")
    if isinstance(adapter_layers, bool) or not isinstance(adapter_layers, int) or adapter_layers < 0:
        raise ValueError(f"adapter_layers must be an integer >= 0, got {adapter_layers!r}")
    if adapter == "attention" and adapter_layers != 1:
        raise ValueError(f"the attention adapter is one block: adapter_layers must be 1, got {adapter_layers}")
    if adapter_heads is not None:
        if adapter != "attention":
            raise ValueError("adapter_heads applies to the attention adapter only (adapter: attention)")
        if isinstance(adapter_heads, bool) or not isinstance(adapter_heads, int) or adapter_heads < 1:
            raise ValueError(f"adapter_heads must be an integer >= 1 or null, got {adapter_heads!r}")


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
        resblocks = config.adapter_layers if config.adapter == "resblock" else 0
        self.adapter = nn.ModuleList(ResBlock(hidden_size) for _ in range(resblocks))
        self.attention = None
        if config.adapter == "attention":
            self.attention = AttentionAdapter(model, config.exit_layer, config.adapter_heads, config.adapter_mlp_size)
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

    @property
    def exit_layer(self) -> int:
        return self.config.exit_layer

    @property
    def needs_context(self) -> bool:
        """Whether the logits at a position depend on earlier positions (the attention adapter): drafting then
        keeps an :class:`AdapterCache` fed with the accepted tokens' exit-layer states."""
        return self.attention is not None

    def extend_cache(self, cache: AdapterCache, hidden: torch.Tensor, model, position_ids: torch.Tensor) -> None:
        """Append the attention adapter's keys and values of accepted positions ``hidden`` ``[1, m, hidden]``."""
        if self.attention is not None:
            self.attention.extend(hidden, model, position_ids, cache)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Raises: ValueError: wrong number of ids, or repeated ids."""
        token_ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)
        if token_ids.numel() != self.draft_vocab.numel():
            raise ValueError(f"draft vocabulary: expected {self.draft_vocab.numel()} ids, got {token_ids.numel()}")
        if token_ids.unique().numel() != token_ids.numel():
            raise ValueError("draft vocabulary: token ids repeat")
        self.draft_vocab.copy_(token_ids)
        self.__dict__.pop("_draft_linear", None)  # gathered again from the new rows

    def features(self, hidden: torch.Tensor, model, **context) -> torch.Tensor:
        """``[..., hidden]`` after adapter and norm: what the LM head reads.

        ``context`` (attention adapter only; see ``AttentionAdapter.forward``): ``position_ids``,
        ``attention_mask``, ``cache``. Without it ``hidden`` ``[b, s, hidden]`` is a whole sequence from position 0,
        attended causally (training, teacher-forced evaluation); position-wise adapters ignore it.
        """
        if self.attention is not None:
            hidden = self.attention(hidden, model, **context)
        for block in self.adapter:
            hidden = block(hidden)
        norm = self.norm if self.norm is not None else model.model.norm
        return norm(hidden)

    def forward(self, hidden: torch.Tensor, model, features_only: bool = False, **context) -> torch.Tensor:
        """Full-vocabulary logits ``[..., vocab]``, or with ``features_only`` what the LM head reads (training
        goes through ``forward`` so that DDP sees the call, and computes the logits in chunks itself)."""
        features = self.features(hidden, model, **context)
        return features if features_only else model.get_output_embeddings()(features)

    def draft_logits(self, hidden: torch.Tensor, model, **context) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits the draft ranks, and the full-vocabulary id of each column (None: columns are the ids)."""
        features = self.features(hidden, model, **context)
        head = model.get_output_embeddings()
        if not self.draft_vocab.numel():
            return head(features), None
        return self.draft_head(model)(features), self.draft_vocab

    def draft_head(self, model) -> nn.Linear:
        """The LM-head rows of the draft vocabulary as one linear layer, gathered once (slicing 49152 rows every step
        would cost as much as the product it saves) and kept out of the state dict; a decoder may put it on other
        kernels (``selfspec.runtime.kernels.set_module_backend``)."""
        head = model.get_output_embeddings()
        linear = self.__dict__.get("_draft_linear")
        if linear is None or linear.weight.device != head.weight.device:
            bias = getattr(head, "bias", None)
            rows = head.weight.detach()[self.draft_vocab]
            linear = nn.Linear(rows.shape[1], rows.shape[0], bias=bias is not None, device=rows.device, dtype=rows.dtype)
            with torch.no_grad():
                linear.weight.copy_(rows)
                if bias is not None:
                    linear.bias.copy_(bias.detach()[self.draft_vocab])
            linear.requires_grad_(False)
            self.__dict__["_draft_linear"] = linear  # not a submodule: never saved, never trained
        return linear

    def linear_layers(self, model) -> list[nn.Linear]:
        """Every linear layer a draft step runs (adapter, and the draft head when there is a draft vocabulary)."""
        layers = [m for m in self.modules() if isinstance(m, nn.Linear)]
        return layers + ([self.draft_head(model)] if self.draft_vocab.numel() else [])

    def save_pretrained(self, directory: str | Path, model, notes: str = "", *, base_identity: dict | None = None,
                        backbone_adapter: str | Path | None = None, calibration: dict | None = None,
                        dtype: torch.dtype | None = None) -> Path:
        """Write ``config.json`` (stamped with the base model's identity, which loading checks),
        ``model.safetensors`` (only the classifier's own tensors) and a README (the config and metrics, then
        ``notes``), atomically: a crash leaves the old directory or the complete new one.

        Args:
            model: the base model the classifier reads; its identity is recorded unless ``base_identity`` is given.
            base_identity: the identity to record instead (LayerSkip: the base *before* its adapter was merged).
            backbone_adapter: a folder written by ``selfspec.runtime.adapters.export_backbone_adapter``, copied into
                ``backbone_adapter/`` in the same atomic write; ``config.backbone_adapter`` must describe it.
            calibration: how ``config.policy`` was chosen (``selfspec calibrate``), written to calibration.json.
            dtype: storage dtype of the floating-point weights (e.g. ``torch.float16`` halves a committed
                classifier); loading casts them to the model's dtype.

        Raises:
            ValueError: an adapter folder without ``config.backbone_adapter`` (or the other way round), or an
                adapter without ``base_identity`` (the adapted model given is not the base to record).
        """
        from safetensors.torch import save_file

        if (backbone_adapter is None) != (self.config.backbone_adapter is None):
            raise ValueError("save_pretrained: pass the adapter folder exactly when config.backbone_adapter is set")
        if backbone_adapter is not None and base_identity is None:
            raise ValueError("save_pretrained: with a backbone adapter, pass base_identity (the model before the "
                             "adapter); the identity of the adapted model goes into config.backbone_adapter")
        self.config.base_model = dict(base_identity) if base_identity is not None else base_model_identity(model)
        with atomic_directory(directory) as tmp:
            tmp = Path(tmp)
            if backbone_adapter is not None:
                copy_backbone_adapter(backbone_adapter, tmp)
            (tmp / CONFIG_NAME).write_text(self.config.to_json())
            tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
                       for k, v in self.state_dict().items()}
            save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "kind": KIND})
            (tmp / "README.md").write_text(default_readme(self.config) + notes)
            if calibration is not None:
                (tmp / CALIBRATION_NAME).write_text(json.dumps(calibration, indent=2) + "\n")
        return Path(directory)

    @classmethod
    def from_pretrained(cls, directory: str | Path, model, *, merge_adapter: bool = False) -> ExitClassifier:
        """Load a classifier saved by :meth:`save_pretrained` onto ``model``.

        A classifier trained with a backbone adapter (LayerSkip) belongs to the adapted model: ``model`` must be
        that model (``selfspec.runtime.models.load_model(directory)`` loads it), or the plain base with
        ``merge_adapter=True``, which merges the adapter into ``model`` in place.

        Raises:
            FileNotFoundError: ``directory`` lacks config.json, model.safetensors or its backbone adapter.
            selfspec.runtime.identity.BaseModelMismatchError: the classifier was trained for another base model (or for the
                adapted one, and the plain base was given without ``merge_adapter``).
            ValueError: a bad config, or its exit layer does not fit ``model``.
        """
        directory = Path(directory)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (directory / name).is_file():
                raise FileNotFoundError(f"{directory} is not an early-exit classifier directory: no {name}")
        config = ExitClassifierConfig.from_dict(json.loads((directory / CONFIG_NAME).read_text()))
        model = resolve_backbone(model, directory, config.base_model, what=f"early-exit classifier {directory}",
                                 merge_adapter=merge_adapter)
        classifier = cls(config, model)
        tensors = load_verified_weights(directory, "early-exit classifier")
        classifier.load_state_dict(tensors)
        return classifier.eval()


def new_classifier(model, exit_layer: int, *, adapter_layers: int = 0, adapter: str = "resblock",
                   adapter_heads: int | None = None, adapter_mlp_size: int = 0, own_norm: bool = False,
                   draft_vocab: torch.Tensor | None = None) -> ExitClassifier:
    """A fresh classifier for ``model`` (with no adapter: the training-free one). ``adapter="attention"`` with
    ``adapter_layers=1``: the one-block attention adapter (zero output projection: still the training-free one).

    Raises:
        ValueError: ``exit_layer`` outside 1..L-1, an unsupported architecture, or a bad adapter.
    """
    check_exit_layer(exit_layer, model)
    size = None if draft_vocab is None else int(torch.as_tensor(draft_vocab).numel())
    config = ExitClassifierConfig(exit_layer=exit_layer, adapter_layers=adapter_layers, adapter=adapter,
                                  adapter_heads=adapter_heads, adapter_mlp_size=adapter_mlp_size, own_norm=own_norm,
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
    adapter = {"resblock": f"{config.adapter_layers} ResBlock(s)",
               "attention": f"one attention block ({config.adapter_heads or 'base'} heads"
                            f"{f', MLP {config.adapter_mlp_size}' if config.adapter_mlp_size else ''})"}[config.adapter]
    lines = [f"# Early-exit classifier for {name}", "",
             f"Exit layer {config.exit_layer}; adapter: {adapter if config.adapter_layers else 'none'}; own norm: "
             f"{config.own_norm}; draft vocabulary: {config.draft_vocab_size or 'full'}.", "",
             "Use: `selfspec generate --draft early-exit --heads DIR`.", ""]
    if config.backbone_adapter:
        lines += [f"Trained with a LoRA adapter on the backbone, saved in `{config.backbone_adapter.get('path')}/`: "
                  "it decodes the adapted model, which `selfspec.runtime.models.load_model(DIR)` (or `--model DIR`) loads.", ""]
    if config.metrics:
        lines += ["## Metrics", "", "```json", json.dumps(config.metrics, indent=2, sort_keys=True), "```", ""]
    if config.policy:
        lines += ["## Default draft policy", "", f"`{json.dumps(config.policy, sort_keys=True)}`", ""]
    lines += by_machine.card_lines(config.policy_by_machine)
    return "\n".join(lines)
