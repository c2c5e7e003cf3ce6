"""LayerSkip fine-tuning: train the backbone (through LoRA) so that shallow layers predict the next token through
the model's own final norm and LM head, making the training-free exit classifier at layer E a good draft.

The early-exit loss sums, over a set of *loss layers* ``l`` (1..L, HF hidden-state indexing: ``l`` = after
decoder layer ``l``; ``L`` = the final layer, whose hidden state HF returns already normed), the next-token cross
entropy of ``lm_head(norm(h_l))`` on the data, each weighted by ``w_l``::

    loss = sum_l w_l * CE(lm_head(norm(h_l)), next token)      (mean over trained positions per layer)

Which layers: an explicit list (it must contain the exit layer), or the rule "every k-th layer, plus the exit
layer and the final layer". Weights: an explicit list (one per layer, in order), or a rule: ``linear``
(``w_l = l / L``: deeper layers weigh more and the final layer weighs 1, in the spirit of LayerSkip's scale that
grows with depth) or ``uniform`` (every ``w_l = 1``). Weights are used as given, not normalised.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from selfspec.training import chunked_cross_entropy

WEIGHT_RULES = ("linear", "uniform")


def resolve_loss_layers(exit_layer: int, num_layers: int, *, loss_layers: Sequence[int] | None = None,
                        loss_every: int = 4, layer_weights: Sequence[float] | None = None,
                        weight_rule: str = "linear") -> list[tuple[int, float]]:
    """``[(layer, weight), ...]`` in increasing layer order.

    Raises:
        ValueError: a layer outside 1..L or repeated, the exit layer missing from ``loss_layers``, a
            ``loss_every`` below 1, weights that do not match the layers or are negative, an unknown rule.
    """
    if weight_rule not in WEIGHT_RULES:
        raise ValueError(f"weight_rule must be one of {', '.join(WEIGHT_RULES)}, got {weight_rule!r}")
    if loss_layers is None:
        if layer_weights is not None:
            raise ValueError("layer_weights needs an explicit loss_layers list (one weight per layer)")
        if isinstance(loss_every, bool) or not isinstance(loss_every, int) or loss_every < 1:
            raise ValueError(f"loss_every must be an integer >= 1, got {loss_every!r}")
        layers = sorted(set(range(loss_every, num_layers + 1, loss_every)) | {exit_layer, num_layers})
    else:
        layers = list(loss_layers)
        bad = [x for x in layers if isinstance(x, bool) or not isinstance(x, int) or not 1 <= x <= num_layers]
        if bad:
            raise ValueError(f"loss_layers must be integers in 1..{num_layers} (the final layer is {num_layers}), "
                             f"got {bad}")
        if len(set(layers)) != len(layers):
            raise ValueError(f"loss_layers repeat a layer: {layers}")
        if exit_layer not in layers:
            raise ValueError(f"the exit layer {exit_layer} must be one of the loss layers {layers}: it is the layer "
                             "the draft reads")
    if layer_weights is not None:
        if len(layer_weights) != len(layers) or any(float(w) < 0 for w in layer_weights):
            raise ValueError(f"layer_weights must be {len(layers)} non-negative numbers (one per loss layer "
                             f"{layers}), got {list(layer_weights)}")
        pairs = sorted(zip(layers, map(float, layer_weights)))
    else:
        pairs = [(x, x / num_layers if weight_rule == "linear" else 1.0) for x in sorted(layers)]
    return pairs


class EarlyExitBackbone(nn.Module):
    """The (LoRA-adapted) decoder as one module returning every hidden state, so DDP/FSDP see the trained
    parameters; the frozen final norm and LM head are applied outside by :func:`early_exit_losses`."""

    def __init__(self, decoder: nn.Module):
        super().__init__()
        self.decoder = decoder

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """``L + 1`` states ``[b, s, hidden]``: the embeddings, then after each layer (the last one normed)."""
        return self.decoder(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states


def early_exit_losses(hidden_states: Sequence[torch.Tensor], model, valid: torch.Tensor, targets: torch.Tensor,
                      loss_layers: Sequence[tuple[int, float]], chunk_size: int = 1024) -> list[torch.Tensor]:
    """Summed next-token cross entropy of each loss layer (unweighted), in ``loss_layers`` order.

    Args:
        hidden_states: from :class:`EarlyExitBackbone`, ``L + 1`` tensors ``[b, s, hidden]``.
        model: the causal LM whose final norm and LM head read every layer.
        valid: ``[b, s - 1]`` bool, positions whose next token is trained.
        targets: ``[n]`` those next tokens (``n = valid.sum()``).
    """

    final = len(hidden_states) - 1
    head, norm = model.get_output_embeddings(), model.model.norm
    losses = []
    for layer, _ in loss_layers:
        hidden = hidden_states[layer][:, :-1][valid]  # [n, hidden]
        features = hidden if layer == final else norm(hidden)  # HF returns the last state after the norm
        losses.append(chunked_cross_entropy(features, head.weight, targets, chunk_size, getattr(head, "bias", None)))
    return losses
