"""Backbone adapters saved with a draft module: when training changed the base model (Medusa-2, LayerSkip).

Medusa-1 heads and exit classifiers read a frozen base, so the base model given at load time must be the one
they were trained on. Recipes that fine-tune the backbone with LoRA (``peft``) produce heads that belong to the
*adapted* model instead. Such a draft-module directory carries the adapter in ``backbone_adapter/`` (peft's own
format) and its ``config.json`` records::

    "base_model":       identity of the model the run started from (what to load),
    "backbone_adapter": {"path": "backbone_adapter", "adapted_model": identity of base + merged adapter}

Decoding is lossless with respect to the adapted model: its own greedy output is what the drafter reproduces.
``apply_backbone_adapter`` merges the adapter into a base model in place (one-time cost; no per-token LoRA
overhead); ``resolve_backbone`` decides, for a model handed to a loader, whether it already is the adapted model,
is the plain base that may be adapted, or is neither.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from torch import nn

from selfspec.runtime.identity import BaseModelMismatchError, base_model_identity, check_base_model
from selfspec.runtime.io import CONFIG_NAME

ADAPTER_DIR = "backbone_adapter"


def export_backbone_adapter(peft_model: Any, staging: str | Path) -> tuple[dict, nn.Module]:
    """Save ``peft_model``'s adapter to ``staging`` (peft format), then merge it into the backbone in place.

    Call it once training is over: afterwards the peft wrapper is gone and the returned model carries the merged
    weights. Returns ``(spec, merged_model)``; ``spec`` is the ``backbone_adapter`` entry for the config.
    """
    staging = Path(staging)
    peft_model.save_pretrained(str(staging))
    merged = peft_model.merge_and_unload()
    return {"path": ADAPTER_DIR, "adapted_model": base_model_identity(merged)}, merged


def copy_backbone_adapter(staging: str | Path, directory: str | Path) -> None:
    """Copy the adapter files written by ``export_backbone_adapter`` into ``directory/backbone_adapter``."""
    shutil.copytree(staging, Path(directory) / ADAPTER_DIR)


def _read_config(directory: str | Path) -> dict:
    """The draft module's ``config.json`` as a dict (empty when missing or not a JSON object)."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    return data if isinstance(data, dict) else {}


def adapter_spec(directory: str | Path) -> dict | None:
    """The ``backbone_adapter`` entry of the draft module in ``directory``, or ``None`` (no adapter, no config)."""
    return _read_config(directory).get("backbone_adapter") or None


def adapted_model_source(directory: str | Path) -> tuple[str, dict, dict] | None:
    """``(base model name, base identity, adapter spec)`` of a draft module trained with a backbone adapter, read
    from one ``config.json``; ``None`` when it has no adapter.

    Raises:
        ValueError: the config records no base-model name (``base_model.name_or_path``).
    """
    data = _read_config(directory)
    spec = data.get("backbone_adapter")
    if not spec:
        return None
    identity = data.get("base_model") or {}
    if not identity.get("name_or_path"):
        raise ValueError(f"{directory}/{CONFIG_NAME} does not name its base model (base_model.name_or_path)")
    return identity["name_or_path"], identity, spec


def apply_backbone_adapter(model: nn.Module, directory: str | Path, spec: dict, base_identity: dict,
                           what: str) -> nn.Module:
    """Merge the adapter saved in ``directory`` into ``model`` (the plain base), in place; returns the model.

    Raises:
        FileNotFoundError: the adapter files are missing.
        BaseModelMismatchError: ``model`` is not the base the adapter was trained on, or the merged result is not
            the adapted model that was recorded (the adapter files and the config disagree).
    """
    from peft import PeftModel

    adapter_dir = Path(directory) / spec.get("path", ADAPTER_DIR)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{what} needs the backbone adapter in {adapter_dir}, which is missing "
                                "(adapter_config.json not found); copy the whole directory the training run wrote")
    check_base_model(base_identity, model, what=what)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    if spec.get("adapted_model"):
        check_base_model(spec["adapted_model"], merged, what=f"{what} (after merging {adapter_dir})")
    return merged


def resolve_backbone(model: nn.Module, directory: str | Path, base_identity: dict, what: str, *,
                     merge_adapter: bool = False) -> nn.Module:
    """Check ``model`` against the draft module in ``directory``; returns the model to decode with.

    Without an adapter this is ``check_base_model``. With one, the model must already be the adapted model, or be
    the plain base and ``merge_adapter`` allows merging the adapter into it (in place).

    Raises:
        BaseModelMismatchError: the model fits neither, or it is the plain base and ``merge_adapter`` is off (the
            message says how to load the adapted model).
    """
    spec = adapter_spec(directory)
    if spec is None:
        check_base_model(base_identity, model, what=what, on_weights="warn")
        return model
    try:
        check_base_model(spec.get("adapted_model") or {}, model, what=what)
        return model  # already adapted
    except BaseModelMismatchError:
        pass
    check_base_model(base_identity, model, what=what)  # neither adapted nor the base: this error says why
    if merge_adapter:
        return apply_backbone_adapter(model, directory, spec, base_identity, what)
    raise BaseModelMismatchError(
        f"{what} were trained together with a LoRA adapter on the backbone ({Path(directory) / ADAPTER_DIR}); the "
        f"model given is the plain base, whose outputs differ. Load the adapted model with "
        f"selfspec.runtime.models.load_model({str(directory)!r}) (or --model {directory} on the command line), or pass "
        "merge_adapter=True to merge the adapter into this model in place")
