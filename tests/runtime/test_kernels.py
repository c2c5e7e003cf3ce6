"""selfspec.runtime.kernels: the oneDNN linear backend changes how matmuls run, never what the model is or decodes."""

from __future__ import annotations

import pytest
import torch

from selfspec.runtime.kernels import linear_backend, linear_backend_of, onednn_available, set_linear_backend
from selfspec.testing import assert_linear_backend_is_exact_and_lossless, tiny_model

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")


def _prompt(vocab: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi3"])
def test_onednn_logits_match_stock_and_decoding_stays_lossless(arch, monkeypatch):
    import selfspec.runtime.kernels as K
    calls = []
    kernel = K.onednn_linear
    monkeypatch.setattr(K, "onednn_linear", lambda *a: calls.append(1) or kernel(*a))
    assert_linear_backend_is_exact_and_lossless(tiny_model(arch, dtype=torch.float32), "onednn", calls)


def test_training_and_other_dtypes_keep_the_stock_path():
    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "onednn")
    layer = model.model.layers[0].mlp.up_proj
    x = torch.randn(2, 5, layer.in_features)
    y = layer(x)  # gradients on: stock F.linear, differentiable
    assert y.requires_grad and torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))
    y.sum().backward()
    assert layer.weight.grad is not None
    double = tiny_model("llama", dtype=torch.float64)  # float64: oneDNN has no float64 kernels; the stock path must be taken
    set_linear_backend(double, "onednn")
    layer = double.model.layers[0].mlp.up_proj
    x = torch.randn(3, layer.in_features, dtype=torch.float64)
    with torch.no_grad():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_a_changed_weight_is_repacked():
    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "onednn")
    layer = model.model.layers[0].self_attn.q_proj
    x = torch.randn(4, layer.in_features)
    with torch.no_grad():
        before = layer(x)
        layer.weight.mul_(2.0)  # in place (an adapter merge does this): the packed copy is stale now
        after = layer(x)
        torch.testing.assert_close(after, 2 * before, rtol=1e-4, atol=1e-5)
        layer.weight = torch.nn.Parameter(torch.zeros_like(layer.weight))  # replaced
        assert torch.count_nonzero(layer(x) - (layer.bias if layer.bias is not None else 0)) == 0


def test_switching_back_and_the_context_manager_restore_the_stock_forward():
    model = tiny_model("llama", dtype=torch.float32)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with linear_backend(model, "onednn") as active:
        assert active == "onednn" and linear_backend_of(model) == "onednn"
        assert all("forward" in m.__dict__ for m in linears)
    assert linear_backend_of(model) == "stock" and not any("forward" in m.__dict__ for m in linears)
    assert set_linear_backend(model, "auto") in ("stock", "onednn", "skinny")
    with pytest.raises(ValueError, match="unknown linear backend"):
        set_linear_backend(model, "fast")


def test_bench_method_suffix_selects_a_backend():
    from selfspec.bench.methods import BackendMethod, GenSettings, parse_method

    method = parse_method("vanilla@stock")
    assert isinstance(method, BackendMethod) and method.name == "vanilla@stock" and method.backend == "stock"
    with pytest.raises(ValueError, match="unknown linear backend"):
        parse_method("vanilla@turbo")
    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "onednn")
    seen = []
    hook = model.model.layers[0].mlp.up_proj.register_forward_pre_hook(
        lambda module, args: seen.append("forward" in module.__dict__))
    prompt = _prompt(model.config.vocab_size, 5, 3)
    gen = parse_method("none@stock").generate(model, prompt, GenSettings(max_new_tokens=4))
    hook.remove()
    assert len(gen.tokens) == 4 and seen and not any(seen)  # ran on the stock path
    assert linear_backend_of(model) == "onednn"  # and the run's backend is back afterwards


@pytest.mark.parametrize("rows", [1, 3, 17])
def test_dense_pointwise_kernel_equals_the_converting_one(rows, monkeypatch):
    import selfspec.runtime.kernels as K
    if K._POINTWISE is None:
        pytest.skip("this PyTorch build has no mkldnn._linear_pointwise; only the converting kernel exists")
    weight, bias = torch.randn(40, 24), torch.randn(40)
    x = torch.randn(rows, 24)
    dense = K.onednn_linear(x, weight.to_mkldnn(), bias)
    monkeypatch.setattr(K, "_POINTWISE", None)
    converting = K.onednn_linear(x, weight.to_mkldnn(), bias)
    assert torch.equal(dense, converting)  # the same oneDNN primitive, bit for bit
    torch.testing.assert_close(dense, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_best_of_interleaves_the_settings_and_keeps_each_ones_fastest_round():
    import selfspec.runtime.kernels as K

    events, state = [], {}
    times = {("a", 1): [3.0, 1.0, 2.0], ("b", 1): [0.5, 4.0, 6.0]}

    def run(key):
        assert state["on"] == key  # each run happens under its own setting
        events.append(key)
        return times[key].pop(0)

    switches = {key: (lambda key=key: state.__setitem__("on", key)) for key in times}
    assert K.best_of(switches, run, rounds=3) == {("a", 1): 1.0, ("b", 1): 0.5}
    assert events == [("a", 1), ("b", 1)] * 3  # round by round, not one setting's rounds in a row
    assert K.seconds(lambda: None) >= 0.0


def test_auto_measures_the_step_sizes_once_per_machine_and_keeps_the_curve(tmp_path, monkeypatch):
    import json

    import selfspec.runtime.kernels as K

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    monkeypatch.delenv("SELFSPEC_REMEASURE", raising=False)
    calls = []
    real = K.measure_backends

    def counted(model, backends, sizes, **kwargs):
        calls.append(sizes)
        return real(model, backends, sizes, prefix=16, rounds=1)

    monkeypatch.setattr(K, "measure_backends", counted)
    model = tiny_model("llama", dtype=torch.float32)
    first = set_linear_backend(model, "auto", sizes=(4, 8))
    assert calls == [(1, 4, 8)]  # the plain step is always timed with the tree sizes
    assert set_linear_backend(model, "auto", sizes=(4, 8)) == first and len(calls) == 1  # cached
    set_linear_backend(model, "auto", sizes=(4, 8), remeasure=True)
    assert len(calls) == 2
    set_linear_backend(model, "auto", sizes=(16,))  # another tree size is another question
    assert calls[-1] == (1, 16)
    [entry, *_] = json.loads((tmp_path / "kernels" / "backend-choices.json").read_text()).values()
    assert entry["cpu"] == K.cpu_signature()["cpu"] and set(entry["ms"]) >= {"stock"}
    assert set(entry["ms"]["stock"]) == {"1", "4", "8"} and entry["backend"] in entry["ms"]
    assert min(entry["ms"], key=lambda b: sum(entry["ms"][b].values())) == entry["backend"]


@pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
def test_batch_backend_times_a_batch_on_both_gemms_once_per_machine_and_keeps_the_figures(tmp_path, monkeypatch):
    import json

    import selfspec.runtime.kernels as K

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    monkeypatch.delenv("SELFSPEC_REMEASURE", raising=False)
    monkeypatch.setattr(K, "BATCH_PROBE", (2, 8))
    switches = []
    real = K.set_linear_backend
    monkeypatch.setattr(K, "set_linear_backend", lambda model, b, **kw: switches.append(b) or real(model, b, **kw))
    model = tiny_model("llama", dtype=torch.float32)
    chosen = K.batch_backend(model)
    assert chosen in ("stock", "onednn") and set(switches) == {"stock", "onednn"}
    assert linear_backend_of(model) == "stock"  # measured, then left as it was
    [entry] = json.loads((tmp_path / "kernels" / "backend-choices.json").read_text()).values()
    assert entry["backend"] == chosen == min(entry["ms"], key=entry["ms"].get) and entry["batch"] == [2, 8]
    switches.clear()
    assert K.batch_backend(model) == chosen and switches == []  # remembered: nothing measured again
    K.batch_backend(model, remeasure=True)
    assert set(switches) == {"stock", "onednn"}
    # a model that is not float32 on the CPU has one choice, measured never
    switches.clear()
    assert K.batch_backend(tiny_model("llama", dtype=torch.float64)) == "stock" and switches == []


@pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
def test_onednn_gives_a_padded_batchs_features_and_teacher_as_stock_does():
    from selfspec.training import hidden_states

    model = tiny_model("llama", dtype=torch.float32)
    ids = torch.randint(2, 96, (3, 11), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    layers = [1, 2, -1]
    with torch.no_grad():
        stock = hidden_states(model, ids, mask, layers)
        set_linear_backend(model, "onednn")
        fast = hidden_states(model, ids, mask, layers)
        head = model.get_output_embeddings()
        logits = head(fast[-1])
        set_linear_backend(model, "stock")
    for layer in layers:
        valid = mask.bool()
        torch.testing.assert_close(fast[layer][valid], stock[layer][valid], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, head(stock[-1]), rtol=1e-5, atol=1e-5)
