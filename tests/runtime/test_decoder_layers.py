"""``selfspec.runtime.layers``: the one way every caller finds a model's decoder layers."""

from __future__ import annotations

import pytest
import torch

from selfspec.runtime.layers import decoder_layers, num_decoder_layers
from selfspec.testing import ARCHITECTURES, tiny_model


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_decoder_layers_are_the_models_own_stack(arch):
    model = tiny_model(arch)
    layers = decoder_layers(model)
    assert num_decoder_layers(model) == model.config.num_hidden_layers == len(layers)
    # The very modules a forward runs, in order: a hook on layer i fires i-th.
    order = []
    hooks = [layer.register_forward_hook(lambda *_, i=i: order.append(i)) for i, layer in enumerate(layers)]
    try:
        model(torch.tensor([[3, 4, 5]]))
    finally:
        for hook in hooks:
            hook.remove()
    assert order == list(range(len(layers)))


def test_a_model_without_decoder_layers_is_refused():
    with pytest.raises(ValueError, match="cannot find the decoder layers of Linear"):
        decoder_layers(torch.nn.Linear(2, 2))
