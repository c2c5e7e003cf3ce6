"""The decoder-layer stack of any transformers causal LM, found one way for every caller."""

from __future__ import annotations

import torch


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: ``get_decoder().layers`` (``.h`` for GPT-2 style models), else the
    first ``ModuleList`` as long as ``config.num_hidden_layers``.

    Raises:
        ValueError: no such stack (not a decoder-only transformer).
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for name in ("layers", "h"):
        layers = getattr(decoder, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def num_decoder_layers(model) -> int:
    return len(decoder_layers(model))
