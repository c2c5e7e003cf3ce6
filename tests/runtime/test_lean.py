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
from selfspec.runtime.tiny import tiny_gemma3
from selfspec.testing import RandomDrafter, assert_random_trees_decode_losslessly, tiny_model

pytestmark = pytest.mark.xdist_group("skinny")


def lean_calls(model) -> int:
    return sum(layer.forward.calls for layer in model.model.layers if "forward" in layer.__dict__)


def step_outputs(model, ids: torch.Tensor, tree, capacity: int, chain: bool = False) -> list[torch.Tensor]:
    """What a fused path must reproduce bitwise: the logits and hidden states of a one-token step after a 10-token
    prefill, then (rolled back) of a tree verification, with ``chain`` then a rollback to three of the tree's nodes and
    a 3-token chain under a 2-D mask; and every cache entry at the end."""
    from decoding.generate import verify_forward
    from selfspec.runtime.cache import crop, keep_accepted, new_cache

    cache = new_cache(model, capacity)
    outs = []
    with torch.inference_mode():
        model(ids[:, :10], cache=cache, use_cache=True)
        one = model(ids[:, 10:11], cache=cache, use_cache=True, output_hidden_states=True)
        outs += [one.logits, *one.hidden_states]
        crop(cache, 10)
        step = verify_forward(model, cache, int(ids[0, 10]), tree, output_hidden_states=True)
        outs += [step.logits, *step.hidden_states]
        if chain:
            keep_accepted(cache, 10, [0, 1, 3])
            more = model(ids[:, 11:14], cache=cache, use_cache=True, attention_mask=torch.ones(1, 17, dtype=torch.long))
            outs.append(more.logits)
        outs += [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return outs


def assert_drafted_rows_equal_generate(model, batched: bool) -> None:
    """Two prompts (3 and 11 tokens) decoded with random drafts, as one ragged batch or one at a time, equal
    ``model.generate``'s greedy rows."""
    from decoding import generate

    prompts = [torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 11)]
    drafters = [RandomDrafter(96, size=5, seed=r, hit_rate=0.6,
                              reference=model.generate(p, max_new_tokens=30, do_sample=False, min_new_tokens=30))
                for r, p in enumerate(prompts)]
    if batched:
        rows = generate_batch(model, drafters, prompts, max_new_tokens=12, eos_token_id=None).sequences
    else:
        rows = [generate(model, d, p, max_new_tokens=12, eos_token_id=None).sequences for p, d in zip(prompts, drafters)]
    for prompt, row in zip(prompts, rows):
        expected = model.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert row.reshape(-1).tolist() == expected.reshape(-1).tolist()


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
    assert_drafted_rows_equal_generate(model, batched=True)


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


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # qwen2: q/k/v biases through the fused call
def test_a_fused_layer_is_the_lean_layer_bitwise(arch, monkeypatch):
    """A layer whose keys and values go to a buffered cache and whose attention is the skinny kernel runs as one
    extension call (``skinny.decoder_layer``): its logits, hidden states and cache entries equal the twelve-call
    lean layer's bit for bit, for one token, a masked tree and a left-padded batch; decoding stays lossless; and
    a cache it does not know (transformers' own) goes the twelve-call way."""
    from transformers import DynamicCache

    from decoding.tree import DraftTree
    from selfspec.runtime import lean

    model = tiny_model(arch, dtype=torch.float32, head_dim=64)
    set_linear_backend(model, "skinny")
    monkeypatch.setattr(lean, "FUSED_STACK", False)  # the per-layer call (the whole stack's: the next test)
    fused = []
    layer_call = skinny.decoder_layer
    monkeypatch.setattr(skinny, "decoder_layer", lambda h, *a: fused.append(h.shape[0]) or layer_call(h, *a))
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (1, 13), generator=gen)
    tree = DraftTree(torch.randint(0, 96, (6,), generator=gen), torch.tensor([-1, 0, 0, 1, 3, 2]))

    def run(enabled: bool):
        monkeypatch.setattr(lean, "FUSED_LAYERS", enabled)
        return step_outputs(model, ids, tree, 32)

    plain = run(False)
    assert not fused
    together = run(True)
    assert sorted(set(fused)) == [1, 7]  # the one-token step and the 7-token tree
    assert len(plain) == len(together) and all(torch.equal(a, b) for a, b in zip(plain, together))
    fused.clear()
    with torch.inference_mode():
        model(ids[:, :3], cache=DynamicCache(config=model.config), use_cache=True)
    assert not fused
    assert_random_trees_decode_losslessly(model)
    prompts = [torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (4, 9)]
    out = generate_batch(model, None, prompts, max_new_tokens=8, eos_token_id=None)  # left-padded: masked rows
    for prompt, row in zip(prompts, out.sequences):
        assert row.tolist() == model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8).tolist()
    assert any(rows == 2 for rows in fused)  # the batch's one-token steps, two rows, went through it


def stack_calls(model) -> int:
    forward = model.model.__dict__.get("forward")
    return forward.calls if forward is not None else 0


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])  # qwen2: q/k/v biases; mistral: its window mask
def test_the_whole_stack_as_one_call_is_the_per_layer_path_bitwise(arch, monkeypatch):
    """A Llama-family decoder whose every layer would run as one extension call runs all of them as one
    (``skinny.DecoderStack``): logits, every hidden state and the cache entries equal the per-layer calls' bit for
    bit, for one token, a masked tree, a chain after a rollback and a left-padded batch; decoding stays lossless;
    what it does not take (a long prefill, gradients, hidden states selected by index, transformers' own cache,
    a weight changed in place until repacked) goes the per-layer way or is repacked."""
    from transformers import DynamicCache

    from decoding.tree import DraftTree
    from selfspec.runtime import lean
    from selfspec.runtime.cache import new_cache

    model = tiny_model(arch, dtype=torch.float32, head_dim=64)
    set_linear_backend(model, "skinny")
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 96, (1, 14), generator=gen)
    tree = DraftTree(torch.randint(0, 96, (7,), generator=gen), torch.tensor([-1, 0, 0, 1, 3, 2, -1]))

    def run(enabled: bool):
        monkeypatch.setattr(lean, "FUSED_STACK", enabled)
        return step_outputs(model, ids, tree, 40, chain=True)

    before = stack_calls(model)
    per_layer = run(False)
    assert stack_calls(model) == before
    whole = run(True)
    assert stack_calls(model) == before + 3  # the one-token step, the tree, the chain after the rollback
    assert len(per_layer) == len(whole) and all(torch.equal(a, b) for a, b in zip(per_layer, whole))
    calls = stack_calls(model)
    model.config.output_hidden_states = True  # the config's default for the call: hidden states come back too
    with torch.inference_mode():
        cache = new_cache(model, 16)
        model(ids[:, :4], cache=cache, use_cache=True)
        assert len(model(ids[:, 4:5], cache=cache, use_cache=True).hidden_states) == model.config.num_hidden_layers + 1
    model.config.output_hidden_states = False
    assert stack_calls(model) == calls + 1

    calls = stack_calls(model)
    with torch.inference_mode():
        cache = new_cache(model, 64)
        model(torch.randint(0, 96, (1, skinny.MAX_ROWS + 1), generator=gen), cache=cache, use_cache=True)
        model(ids[:, :1], cache=cache, use_cache=True, output_hidden_states=[2])  # selected by index
        model(ids[:, :3], cache=DynamicCache(config=model.config), use_cache=True)
    model(ids[:, :3], cache=new_cache(model, 8), use_cache=True).logits.sum().backward()  # gradients
    assert stack_calls(model) == calls
    seen = []
    handle = model.model.layers[2].register_forward_hook(lambda *_: seen.append(1))  # a hook sees every layer call
    with torch.inference_mode():
        cache = new_cache(model, 16)
        model(ids[:, :4], cache=cache, use_cache=True)
        model(ids[:, 4:5], cache=cache, use_cache=True)
    handle.remove()
    assert len(seen) == 2 and stack_calls(model) == calls
    cache = new_cache(model, 16)
    model.config.num_hidden_layers = 2  # HF's early-exit assistant runs the first layers only
    with torch.inference_mode():
        model(ids[:, :4], cache=cache, use_cache=True)
        model(ids[:, 4:5], cache=cache, use_cache=True)
    model.config.num_hidden_layers = len(model.model.layers)
    assert stack_calls(model) == calls and cache.layers[2].keys is None  # the other layers never ran
    counted = []

    def count(*_):
        counted.append(1)

    setattr(count, lean.COUNTS_ONLY, True)  # a hook that only counts (the benchmark's) leaves the stack on
    handle = model.model.layers[-1].register_forward_hook(count)
    with torch.inference_mode():
        cache = new_cache(model, 16)
        model(ids[:, :4], cache=cache, use_cache=True)
        model(ids[:, 4:5], cache=cache, use_cache=True)
    handle.remove()
    assert len(counted) == 1 and stack_calls(model) == calls + 1  # the prefill counted, the step ran whole
    calls += 1

    def step_logits():
        cache = new_cache(model, 16)
        with torch.inference_mode():
            model(ids[:, :4], cache=cache, use_cache=True)
            return model(ids[:, 4:5], cache=cache, use_cache=True).logits

    kept = step_logits()
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(0.5)  # in place: the stack is rebuilt on the repacked weight
    changed = step_logits()
    monkeypatch.setattr(lean, "FUSED_STACK", False)
    assert torch.equal(changed, step_logits()) and not torch.equal(kept, changed)
    monkeypatch.setattr(lean, "FUSED_STACK", True)
    norm = model.model.layers[2].post_attention_layernorm
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 1.5)  # a norm weight replaced: the stack is rebuilt
    replaced = step_logits()
    monkeypatch.setattr(lean, "FUSED_STACK", False)
    assert torch.equal(replaced, step_logits()) and not torch.equal(replaced, changed)
    monkeypatch.setattr(lean, "FUSED_STACK", True)

    assert_random_trees_decode_losslessly(model)
    prompts = [torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(n)) for n in (4, 9)]
    calls = stack_calls(model)
    out = generate_batch(model, None, prompts, max_new_tokens=8, eos_token_id=None)  # left-padded: masked rows
    for prompt, row in zip(prompts, out.sequences):
        assert row.tolist() == model.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8).tolist()
    assert stack_calls(model) > calls
    set_linear_backend(model, "stock")
    assert "forward" not in model.model.__dict__


def test_a_qwen2_decoder_with_sliding_window_layers_keeps_the_per_layer_path():
    """A Qwen2 decoder that mixes in sliding-window layers builds a mask per layer type, which the whole-stack call
    does not mirror: it keeps the per-layer calls, and decodes losslessly."""
    model = tiny_model("qwen2", dtype=torch.float32, head_dim=64, use_sliding_window=True, sliding_window=256,
                       max_window_layers=1)
    assert model.model.has_sliding_layers
    set_linear_backend(model, "skinny")
    assert_random_trees_decode_losslessly(model)
    assert stack_calls(model) == 0


@pytest.mark.parametrize("head_dim", [16, 64])  # 64: the attention kernel too
def test_gemma3_layers_run_lean_compute_the_layers_and_decode_losslessly(head_dim):
    """Gemma 3's layers (four norms of ``1 + w``, per-head q/k norms, tanh GELU, sliding-window layers) take their
    own lean forward on the skinny backend: the layer's result up to float rounding, every decode path lossless."""
    from selfspec.runtime.lean import _LeanGemma3Forward

    ids = torch.randint(0, 96, (1, 13), generator=torch.Generator().manual_seed(2))
    for window in (64, 6):  # 6: the sliding layers' mask cuts the 13-token prompt, and decoding runs past it
        model = tiny_gemma3(head_dim, window)
        with torch.inference_mode():
            stock = model(ids, output_hidden_states=True)
            set_linear_backend(model, "skinny")
            assert all(isinstance(layer.__dict__.get("forward"), _LeanGemma3Forward) for layer in model.model.layers)
            lean = model(ids, output_hidden_states=True)  # a prefill of 13 rows: lean too (up to skinny.MAX_ROWS)
        assert lean_calls(model) == 4
        torch.testing.assert_close(lean.logits, stock.logits, rtol=1e-4, atol=1e-4)
        for a, b in zip(lean.hidden_states, stock.hidden_states):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    # past the window: the sliding layers keep every entry and each tree row's mask drops what its position
    # no longer sees (decoding.generate._per_layer_type); HF's own sliding cache decodes the reference
    assert_random_trees_decode_losslessly(model)
    assert_drafted_rows_equal_generate(model, batched=False)  # sliding-window caches do not batch (ValueError)
    with torch.no_grad():  # a norm weight changed: its 1 + w follows
        model.model.layers[0].post_feedforward_layernorm.weight.add_(0.5)
        set_linear_backend(model, "stock")
        changed = model(ids).logits
        set_linear_backend(model, "skinny")
        torch.testing.assert_close(model(ids).logits, changed, rtol=1e-4, atol=1e-4)
