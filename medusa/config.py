"""``MedusaConfig``: the shape of a set of Medusa heads, the base model they belong to, and what training measured.

It is saved as ``config.json`` beside the head weights, so a heads directory is self-describing: it can be
rebuilt, checked against a base model, and its default tree recalibrated without the training run.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from decoding import by_machine
from selfspec.runtime.io import CONFIG_NAME

#: the fields a Medusa drafting policy sets (a ``drafting_by_machine`` entry's policy)
DRAFTING_FIELDS = ("tree", "dynamic_tree")


@dataclass
class MedusaConfig:
    """Configuration of a set of Medusa heads.

    Attributes:
        num_heads: number of heads; head ``k`` (0-based) predicts the token ``k + 2`` positions after its input
            hidden state, i.e. ``k + 1`` steps beyond the base model's own next token.
        num_layers: ResBlocks per head.
        share_lm_head: heads reuse the base model's LM head (not saved with the heads). ``False`` gives every head
            a private copy, which is trained and saved (vocab x hidden parameters per head).
        hidden_size: the base model's hidden size (input and output width of every ResBlock).
        vocab_size: rows of the base model's LM head.
        base_model: identity of the base model the heads were trained on (``selfspec.runtime.identity``).
        tree: default draft tree in Medusa's choices format (``[[0], [0, 0], [1], ...]``), or ``None``.
        head_accuracy: ``[num_heads][top_k]``: P(the rank-``r`` candidate of head ``k`` is the target token), measured
            on held-out data. Not cumulative: the top-5 accuracy of head ``k`` is ``sum(head_accuracy[k][:5])``.
        training: recipe and metrics of the run that made the heads (written into the heads' README).
        draft_vocab_size: draft from only this many LM-head rows (the most frequent tokens of the training data,
            saved with the weights): the heads' top-k costs ``draft_vocab_size / vocab_size`` of a full LM-head
            product. ``None``: the full vocabulary. Verification always scores the full vocabulary.
        sequential: Hydra-style heads: head ``k`` also reads the embedding of the token drafted at depth ``k`` (the
            root for head 0) and the state head ``k - 1`` produced for it, so each depth conditions on the path
            above it (``MedusaHeads.step``). ``False``: Medusa's independent heads, all from the one hidden state.
        prefix_attention: start the heads from one causal attention block over the base's last hidden states,
            each position also reading its next token (``medusa.context.PrefixAttention``; Hydra++'s prefix
            attention with EAGLE's token-conditioned input). Its KV cache holds only verified positions.
        prefix_mlp_size: inner size of the prefix block's SwiGLU MLP (0: attention only).
        prefix_num_heads, prefix_head_dim: the prefix block's attention shape (filled from the base model: its
            rotary embedding sets the head size).
        dynamic_tree: the default drafting when no tree is asked for, chosen by calibration: ``{"size": N,
            "width": W, "top_k": K}`` verifies the ``N`` most probable nodes per step (sequential heads grow them;
            parallel heads pick them from ``tree``). ``None``: the static ``tree``.
        backbone_adapter: set by Medusa-2: the LoRA adapter saved beside the heads and the identity of the adapted
            model (``selfspec.runtime.adapters``); the heads decode that model, not the plain ``base_model``.
        drafting_by_machine: drafting calibrated per kind of machine (``decoding.by_machine``), each policy
            ``{"tree": [...], "dynamic_tree": {...} or None}``: where the machine running the heads has an entry,
            it replaces ``tree`` and ``dynamic_tree`` (``drafting_for``).

    Raises:
        ValueError: ``num_heads`` or ``num_layers`` below 1, a negative size, or ``head_accuracy`` / ``tree`` that
            do not fit ``num_heads``.
    """

    num_heads: int = 4
    num_layers: int = 1
    share_lm_head: bool = True
    hidden_size: int | None = None
    vocab_size: int | None = None
    base_model: dict[str, Any] = field(default_factory=dict)
    tree: list[list[int]] | None = None
    head_accuracy: list[list[float]] | None = None
    training: dict[str, Any] = field(default_factory=dict)
    backbone_adapter: dict[str, Any] | None = None
    draft_vocab_size: int | None = None
    sequential: bool = False
    prefix_attention: bool = False
    prefix_mlp_size: int = 0
    prefix_num_heads: int | None = None
    prefix_head_dim: int | None = None
    dynamic_tree: dict[str, int] | None = None
    drafting_by_machine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_heads", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MedusaConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("hidden_size", "vocab_size", "draft_vocab_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"MedusaConfig.{name} must be a positive integer or None, got {value!r}")
        for name in ("sequential", "prefix_attention"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"MedusaConfig.{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("prefix_num_heads", "prefix_head_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"MedusaConfig.{name} must be a positive integer or None, got {value!r}")
        if isinstance(self.prefix_mlp_size, bool) or not isinstance(self.prefix_mlp_size, int) \
                or self.prefix_mlp_size < 0:
            raise ValueError(f"MedusaConfig.prefix_mlp_size must be an integer >= 0, got {self.prefix_mlp_size!r}")
        if self.dynamic_tree is not None:
            keys = {"size", "width", "top_k"}
            if not isinstance(self.dynamic_tree, dict) or not set(self.dynamic_tree) <= keys or \
                    "size" not in self.dynamic_tree or any(
                        isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in self.dynamic_tree.values()):
                raise ValueError(f"MedusaConfig.dynamic_tree must be {{'size': N, 'width': W, 'top_k': K}} with "
                                 f"positive integers, got {self.dynamic_tree!r}")
        if self.draft_vocab_size is not None:
            if self.vocab_size is not None and self.draft_vocab_size > self.vocab_size:
                raise ValueError(f"MedusaConfig.draft_vocab_size {self.draft_vocab_size} exceeds the vocabulary of "
                                 f"{self.vocab_size}")
            if not self.share_lm_head:
                raise ValueError("MedusaConfig.draft_vocab_size needs share_lm_head=True (private heads score their "
                                 "own full LM heads)")
        if self.head_accuracy is not None:
            self.head_accuracy = [[float(p) for p in row] for row in self.head_accuracy]
            if len(self.head_accuracy) != self.num_heads:
                raise ValueError(
                    f"MedusaConfig.head_accuracy has {len(self.head_accuracy)} rows for {self.num_heads} heads"
                )
            if any(not 0.0 <= p <= 1.0 for row in self.head_accuracy for p in row):
                raise ValueError("MedusaConfig.head_accuracy holds probabilities; every value must be in [0, 1]")
        if self.tree is not None:
            self.tree = [[int(r) for r in path] for path in self.tree]
            too_deep = [path for path in self.tree if len(path) > self.num_heads]
            if too_deep:
                raise ValueError(
                    f"MedusaConfig.tree path {too_deep[0]} is {len(too_deep[0])} deep, but there are only "
                    f"{self.num_heads} heads (one per depth)"
                )

        by_machine.check_entries(self.drafting_by_machine, "MedusaConfig.drafting_by_machine")
        for machine, entry in (self.drafting_by_machine or {}).items():
            policy = entry["policy"]
            if set(policy) != set(DRAFTING_FIELDS):
                raise ValueError(f"MedusaConfig.drafting_by_machine[{machine!r}] must set exactly "
                                 f"{list(DRAFTING_FIELDS)} (a policy is used whole), got {sorted(policy)}; fix the "
                                 "entry or recalibrate with `selfspec calibrate`")
            try:  # the entry's tree and dynamic tree must be valid for these heads, as the defaults must
                checked = replace(self, drafting_by_machine={}, **policy)
            except ValueError as e:
                raise ValueError(f"MedusaConfig.drafting_by_machine[{machine!r}]: {e}") from None
            policy["tree"] = checked.tree  # normalised as the default is

    def drafting_for(self, machine: str) -> tuple[dict[str, Any], str]:
        """``(drafting, where)``: ``{"tree", "dynamic_tree"}`` saved for machines of class ``machine``, else the
        defaults (``decoding.by_machine.policy_for``)."""
        default = {name: getattr(self, name) for name in DRAFTING_FIELDS}
        return by_machine.policy_for(default, self.drafting_by_machine, machine,
                                     ("tree/dynamic_tree", "drafting_by_machine"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MedusaConfig:
        """Build a config from a dict (e.g. a parsed ``config.json``).

        Raises:
            ValueError: a key that is not a ``MedusaConfig`` field (the message lists the known ones), or an
                invalid value.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown MedusaConfig key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**data)

    def save(self, directory: str | Path) -> Path:
        """Write ``config.json`` into ``directory`` (which must exist); returns the file's path."""
        path = Path(directory) / CONFIG_NAME
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> MedusaConfig:
        """Read a config from a heads directory or a ``config.json`` file.

        Raises:
            FileNotFoundError: no such directory or file (the message names the path).
            ValueError: the file is not valid JSON or holds an invalid config.
        """
        path = Path(path)
        if path.is_dir():
            path = path / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"Medusa config {path} does not exist")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
