"""Medusa heads in the directory format vLLM's Medusa drafter loads, and back.

    selfspec export --format vllm-medusa --heads heads/smollm2-135m-instruct-medusa --out OUT
    vllm serve BASE --speculative-config '{"model": "OUT", "num_speculative_tokens": 3}'

vLLM runs parallel heads only (``vllm/model_executor/models/medusa.py``: each head is ``num_hidden_layers``
residual blocks ``x + SiLU(W x + b)`` on the last hidden state, then an LM head). Written:

- ``config.json``: ``model_type: medusa``, ``architectures: [MedusaModel]``, ``hidden_size``, ``vocab_size``,
  ``num_heads``, ``num_hidden_layers``, ``medusa_fc_bias: true``, ``original_lm_head`` (true when the heads share
  the base LM head, which is then copied in once as ``lm_heads.0.weight``: vLLM reads it from the draft folder),
  ``truncated_vocab_size`` (the draft vocabulary's size, or the vocabulary's);
- ``model.safetensors``: ``blocks.{h}.layers.{l}.weight|bias``, ``lm_heads.{h}.weight`` (one, or one per head),
  and ``token_map`` (the draft vocabulary's token ids) when the vocabulary is truncated.

Sequential heads, prefix attention and exit classifiers have no vLLM Medusa equivalent and are refused; a feature
drafter (``selfspec train eagle``) exports to vLLM as EAGLE-3 (``--format speculators``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from medusa.heads import MedusaHeads
from selfspec.runtime.io import WEIGHTS_NAME, atomic_directory


def check_exportable(heads: MedusaHeads) -> None:
    """Raises: ValueError: heads vLLM's Medusa drafter cannot run, naming the alternative."""
    config = heads.config
    if config.sequential or config.prefix_attention:
        kind = "sequential heads" if config.sequential else "prefix attention"
        raise ValueError(f"vLLM's Medusa drafter runs parallel heads only; these use {kind}. Export parallel "
                         "heads, or train a feature drafter (`selfspec train eagle`) and export it with "
                         "--format speculators (EAGLE-3, which vLLM serves)")


def vllm_medusa_state(heads: MedusaHeads) -> dict[str, torch.Tensor]:
    check_exportable(heads)
    config = heads.config
    state: dict[str, torch.Tensor] = {}
    for h in range(config.num_heads):
        for layer in range(config.num_layers):
            state[f"blocks.{h}.layers.{layer}.weight"] = heads.resblock_weight[h, layer]
            state[f"blocks.{h}.layers.{layer}.bias"] = heads.resblock_bias[h, layer]
        if heads.shared_lm_head is None:
            state[f"lm_heads.{h}.weight"] = heads.lm_head_weight[h]
    if heads.shared_lm_head is not None:
        state["lm_heads.0.weight"] = heads.shared_lm_head.weight
    if heads.draft_vocab is not None:
        state["token_map"] = heads.draft_vocab
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def vllm_medusa_config(heads: MedusaHeads) -> dict:
    config = heads.config
    return {"model_type": "medusa", "architectures": ["MedusaModel"], "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "num_heads": config.num_heads, "num_hidden_layers": config.num_layers,
            "medusa_fc_bias": True, "original_lm_head": heads.shared_lm_head is not None,
            "truncated_vocab_size": config.draft_vocab_size or config.vocab_size,
            "selfspec": {"base_model": config.base_model, "head_accuracy": config.head_accuracy}}


def export_vllm_medusa(heads: MedusaHeads, out: str | Path) -> Path:
    """Write ``heads`` to ``out`` in vLLM's Medusa format, atomically (see the module docstring).

    Raises:
        ValueError: heads vLLM's Medusa cannot run (``check_exportable``).
    """
    from safetensors.torch import save_file

    state = vllm_medusa_state(heads)
    out = Path(out)
    with atomic_directory(out) as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(vllm_medusa_config(heads), indent=2) + "\n")
        save_file(state, str(Path(tmp) / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def import_vllm_medusa(directory: str | Path, base_model: nn.Module) -> MedusaHeads:
    """Heads in vLLM's Medusa format as ``MedusaHeads`` on ``base_model`` (sharing its LM head when the directory
    holds the base's own, ``original_lm_head``).

    Raises:
        FileNotFoundError: no config.json or model.safetensors.
        ValueError: not a Medusa directory, or shapes that do not fit ``base_model``.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in ("config.json", WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"vLLM Medusa file {directory / name} does not exist")
    config = json.loads((directory / "config.json").read_text())
    if config.get("model_type") != "medusa":
        raise ValueError(f"{directory / 'config.json'}: model_type {config.get('model_type')!r} is not 'medusa'")
    state = load_file(str(directory / WEIGHTS_NAME))
    num_heads, num_layers = int(config["num_heads"]), int(config["num_hidden_layers"])
    truncated = int(config.get("truncated_vocab_size") or config["vocab_size"])
    shared = bool(config.get("original_lm_head"))
    heads = MedusaHeads.for_model(base_model, dtype=torch.float32, num_heads=num_heads, num_layers=num_layers,
                                  share_lm_head=shared,
                                  draft_vocab_size=truncated if truncated < int(config["vocab_size"]) else None)
    try:
        with torch.no_grad():
            for h in range(num_heads):
                for layer in range(num_layers):
                    heads.resblock_weight[h, layer].copy_(state[f"blocks.{h}.layers.{layer}.weight"])
                    heads.resblock_bias[h, layer].copy_(state.get(f"blocks.{h}.layers.{layer}.bias",
                                                                  torch.zeros(heads.config.hidden_size)))
                if not shared:
                    weight = state[f"lm_heads.{h}.weight"]
                    if weight.shape[0] != heads.config.vocab_size:
                        raise ValueError(f"lm_heads.{h}.weight has {weight.shape[0]} rows: selfspec keeps full-"
                                         "vocabulary private heads")
                    heads.lm_head_weight[h].copy_(weight)
            if heads.draft_vocab is not None:
                heads.set_draft_vocab(state["token_map"])
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"{directory / WEIGHTS_NAME} does not fit this base model as Medusa heads: {e}") from None
    dtype = base_model.get_output_embeddings().weight.dtype
    return heads.to(dtype).eval().requires_grad_(False)


# ---------------------------------------------------------------- FasterDecoding's Medusa checkpoints
#: weight files of FasterDecoding/Medusa heads (Medusa-1 and Medusa-2), newest first
FASTERDECODING_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")


def is_fasterdecoding_dir(directory: str | Path) -> bool:
    """Whether ``directory`` holds heads in FasterDecoding/Medusa's own layout (no selfspec config)."""
    return any((Path(directory) / name).is_file() for name in FASTERDECODING_WEIGHTS)


def import_fasterdecoding(directory: str | Path, base_model: nn.Module) -> MedusaHeads:
    """Heads published in FasterDecoding/Medusa's layout as ``MedusaHeads`` on ``base_model``.

    That layout: ``config.json`` with ``medusa_num_heads`` and ``medusa_num_layers``; ``medusa_lm_head.safetensors``
    (or ``.pt``) with, per head ``h``, ``{h}.{l}.linear.weight|bias`` for its ResBlocks ``x + SiLU(W x + b)`` and
    ``{h}.{num_layers}.weight``, its own LM head; Medusa-2 checkpoints prefix every key with ``medusa_head.``.

    Raises:
        FileNotFoundError: no config.json or weight file.
        ValueError: a config without the Medusa fields, or weights that do not fit ``base_model``.
    """
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"Medusa checkpoint {directory}: no config.json")
    config = json.loads(config_path.read_text())
    if "medusa_num_heads" not in config:
        raise ValueError(f"{config_path} has no medusa_num_heads: not a FasterDecoding Medusa checkpoint")
    num_heads, num_layers = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
    weights = next((directory / n for n in FASTERDECODING_WEIGHTS if (directory / n).is_file()), None)
    if weights is None:
        raise FileNotFoundError(f"Medusa checkpoint {directory}: none of {', '.join(FASTERDECODING_WEIGHTS)}")
    if weights.suffix == ".safetensors":
        from safetensors.torch import load_file
        state = load_file(str(weights))
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    heads = MedusaHeads.for_model(base_model, dtype=torch.float32, num_heads=num_heads, num_layers=num_layers,
                                  share_lm_head=False)
    try:
        with torch.no_grad():
            for h in range(num_heads):
                for layer in range(num_layers):
                    heads.resblock_weight[h, layer].copy_(state[f"{h}.{layer}.linear.weight"])
                    heads.resblock_bias[h, layer].copy_(state[f"{h}.{layer}.linear.bias"])
                heads.lm_head_weight[h].copy_(state[f"{h}.{num_layers}.weight"])
    except (KeyError, RuntimeError) as e:
        raise ValueError(f"{weights} does not fit this base model as {num_heads} Medusa heads x {num_layers} "
                         f"layer(s): {type(e).__name__}: {e}") from None
    dtype = base_model.get_output_embeddings().weight.dtype
    return heads.to(dtype).eval().requires_grad_(False)
