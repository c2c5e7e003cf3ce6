"""LayerSkip's layer dropout: while training, each decoder layer is skipped for a random subset of the batch's rows,
deeper layers more often, so that the shallow layers learn to carry the prediction on their own.

LayerSkip (Elhoushi et al., 2024) skips layer ``l`` (0-based, of ``L``) of each sequence with probability::

    p_l = p_max * D(l),   D(l) = exp(l * ln 2 / (L - 1)) - 1     ("exp": 0 at the first layer, 1 at the last)

(the paper also scales by a time curriculum S(t); for fine-tuning a frozen model's adapter a constant is its
choice, and the one here). ``linear`` (``D(l) = l / (L - 1)``) and ``uniform`` (``D(l) = 1``) are the other common
scales (torchtune offers the same three).

A skipped layer passes its input through unchanged for that row: a forward hook replaces the layer's output by its
input where the row is dropped, so no modeling code is patched and module names (hence LoRA and checkpoint keys)
stay those of the model. Layers still compute on every row (a 135M model gains nothing from gathering rows), and
hooks act only in training mode: evaluation and decoding see the whole model. Which rows drop is a pure function of
``(seed, step, layer, process)``, so a run resumed from a checkpoint drops exactly what the straight run would.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

SCALES = ("exp", "linear", "uniform")


def dropout_rates(num_layers: int, p_max: float, scale: str = "exp") -> list[float]:
    """Skip probability of each of ``num_layers`` decoder layers.

    Raises:
        ValueError: ``p_max`` outside [0, 1), an unknown ``scale``, or fewer than one layer.
    """
    if scale not in SCALES:
        raise ValueError(f"layer dropout scale must be one of {', '.join(SCALES)}, got {scale!r}")
    if isinstance(p_max, bool) or not isinstance(p_max, (int, float)) or not 0.0 <= p_max < 1.0:
        raise ValueError(f"layer dropout must be a probability in [0, 1), got {p_max!r}")
    if num_layers < 1:
        raise ValueError(f"layer dropout needs at least one layer, got {num_layers}")
    if num_layers == 1:
        return [float(p_max) if scale == "uniform" else 0.0]
    last = num_layers - 1
    shape = {"exp": lambda l: math.exp(l * math.log(2) / last) - 1.0, "linear": lambda l: l / last,
             "uniform": lambda l: 1.0}[scale]
    return [float(p_max) * shape(layer) for layer in range(num_layers)]


class LayerDropout:
    """Hooks on ``layers`` that skip each one per row with its rate while the layer is in training mode.

    Call :meth:`set_step` before each optimizer step (the recipe does) and :meth:`remove` to take the hooks off.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], rates: Sequence[float], *, seed: int = 0,
                 process_index: int = 0):
        if len(layers) != len(rates):
            raise ValueError(f"layer dropout: {len(rates)} rates for {len(layers)} layers")
        self.rates = list(rates)
        self.seed, self.process_index, self.step = seed, process_index, 0
        self.dropped = [0] * len(layers)  # rows skipped per layer, for tests and logs
        self._calls = 0  # forward calls within the step (micro-batches): each draws anew
        # The first hooked layer counts the calls (it runs first in every forward).
        self._first = next((i for i, rate in enumerate(self.rates) if rate > 0), None)
        self._handles = [layer.register_forward_hook(self._hook(i), with_kwargs=True)
                         for i, (layer, rate) in enumerate(zip(layers, self.rates)) if rate > 0]

    def set_step(self, step: int) -> None:
        self.step, self._calls = step, 0

    def _keep(self, layer: int, rows: int, device) -> torch.Tensor:
        generator = torch.Generator().manual_seed(
            hash((self.seed, self.step, self._calls, layer, self.process_index)) & 0x7FFF_FFFF_FFFF)
        return torch.rand(rows, generator=generator) >= self.rates[layer]

    def _hook(self, index: int):
        def hook(module, args, kwargs, output):
            if not module.training:
                return None
            if index == self._first:
                self._calls += 1
            hidden = args[0] if args else kwargs["hidden_states"]
            out = output[0] if isinstance(output, tuple) else output
            keep = self._keep(index, hidden.shape[0], hidden.device)
            self.dropped[index] += int((~keep).sum())
            mixed = torch.where(keep.to(hidden.device)[:, None, None], out, hidden)
            return (mixed, *output[1:]) if isinstance(output, tuple) else mixed
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
