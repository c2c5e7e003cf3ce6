"""selfspec.runtime.lean: on the skinny backend, Llama-family decoder layers run a lean forward over the same kernels.
It computes what the layer class computes (float rounding aside), keeps every decode path lossless, and hands every
call it cannot take (prefill, training, changed weights are repacked, other architectures) to the class forward."""

from __future__ import annotations

import pytest
import torch

from decoding.batch import generate_batch
from selfspec.runtime import skinny
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.lean import supported
from selfspec.testing import RandomDrafter, assert_random_trees_decode_losslessly, tiny_model

pytestmark = pytest.mark.xdist_group("skinny")


def lean_calls(model) -> int:
    return sum(layer.forward.calls for layer in model.model.layers if "forward" in layer.__dict__)


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # qwen2: q/k/v biases, sliding-window kwargs
@pytest.mark.parametrize("head_dim", [None, 64])  # 64: the attention kernel too
def test_lean_layers_compute_the_layers_and_decode_losslessly(arch, head_dim):
    model = tiny_model(arch, dtype=torch.float32, **({"head_dim": head_dim} if head_dim else {}))
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        stock = model(ids, output_hidden_states=True)
        set_linear_backend(model, "skinny")
        lean = model(ids, output_hidden_states=True)
    assert len(supported(model)) == model.config.num_hidden_layers and lean_calls(model) == 4
    torch.testing.assert_close(lean.logits, stock.logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(lean.hidden_states, stock.hidden_states):  # what the feature drafter reads
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert_random_trees_decode_losslessly(model)
    prompts = [torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 11)]
    drafters = [RandomDrafter(96, size=5, seed=r, hit_rate=0.6,
                              reference=model.generate(p, max_new_tokens=30, do_sample=False, min_new_tokens=30))
                for r, p in enumerate(prompts)]
    out = generate_batch(model, drafters, prompts, max_new_tokens=12, eos_token_id=None)
    for prompt, row in zip(prompts, out.sequences):
        expected = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert row.tolist() == expected.tolist()


def test_what_the_lean_forward_does_not_take_goes_to_the_layer_class():
    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "skinny")
    ids = torch.randint(0, 96, (1, skinny.MAX_ROWS + 1), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model(ids)  # a prefill longer than the kernel's rows
    assert lean_calls(model) == 0
    model(ids[:, :4]).logits.sum().backward()  # training
    assert lean_calls(model) == 0
    layer = model.model.layers[0]
    with torch.inference_mode():
        before = model(ids[:, :4]).logits
        assert lean_calls(model) == 4
    with torch.no_grad():
        layer.mlp.down_proj.weight.mul_(0.5)  # changed in place: repacked, as the linear backend does
    with torch.inference_mode():
        changed = model(ids[:, :4]).logits
        set_linear_backend(model, "stock")
        assert "forward" not in layer.__dict__ and lean_calls(model) == 0
        torch.testing.assert_close(changed, model(ids[:, :4]).logits, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, changed)


@pytest.mark.parametrize("arch", ["qwen3", "gemma", "gpt2"])
def test_other_architectures_keep_their_layers(arch):
    model = tiny_model(arch, dtype=torch.float32)
    assert supported(model) == []
    set_linear_backend(model, "skinny")
    assert not any("forward" in m.__dict__ and not hasattr(m, "weight") for m in model.modules()
                   if m.__class__.__name__.endswith("DecoderLayer"))


def test_an_older_transformers_keeps_its_own_layers(monkeypatch):
    from selfspec.runtime import lean

    model = tiny_model("llama", dtype=torch.float32)
    assert supported(model)
    monkeypatch.setattr(lean, "_transformers_version", lambda: (5, 24))
    assert supported(model) == []
