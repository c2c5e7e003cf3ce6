"""selfspec.training.hidden: the hidden states a recipe caches are the base model's own (every layer, with the
partial forward stopping early), are computed once per model, example and layer, are shared between recipes and
data mixes, and a killed pass resumes."""

from __future__ import annotations

import pytest
import torch

from selfspec import training as T
from selfspec.testing import tiny_model


def _examples(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(2, 96, (int(k),), generator=g).tolist(), "loss_mask": [1] * int(k)}
            for k in torch.randint(3, 12, (n,), generator=g)]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma"])
def test_hidden_states_are_the_models_own(arch):
    model = tiny_model(arch, dtype=torch.float64)
    ids = torch.randint(2, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    total = model.config.num_hidden_layers
    for layers in ([-1], [0], [2], [1, total - 1], [0, 2, -1]):
        out = T.hidden_states(model, ids, mask, layers)
        for layer in layers:
            torch.testing.assert_close(out[layer], reference[layer], rtol=0, atol=0)


def test_partial_forward_stops_after_the_deepest_layer_asked_for():
    model = tiny_model("llama")
    calls = []
    hooks = [layer.register_forward_hook(lambda *_, i=i: calls.append(i)) for i, layer in enumerate(model.model.layers)]
    T.hidden_states(model, torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.long), [2])
    for hook in hooks:
        hook.remove()
    assert calls == [0, 1]


def test_cached_once_per_layer_and_shared(tmp_path, monkeypatch):
    model = tiny_model("llama")
    examples = _examples(5)
    computed = []
    real = T.hidden.hidden_states
    monkeypatch.setattr(T.hidden, "hidden_states", lambda *a, **k: computed.append(tuple(a[3])) or real(*a, **k))
    first = T.cached_hidden_states(model, examples, [2, -1], tmp_path, batch_size=2)
    assert computed == [(2, -1)] * 3 and [t.shape[0] for t in first[-1]] == [len(e["input_ids"]) for e in examples]
    # Another recipe on the same data: the last layer is read back, only the new layer is computed.
    second = T.cached_hidden_states(model, examples, [-1, 1], tmp_path, batch_size=4)
    assert computed[3:] == [(1,)] * 2
    assert all(torch.equal(a, b) for a, b in zip(first[-1], second[-1]))
    with torch.no_grad():
        ids = torch.tensor([examples[3]["input_ids"]])
        expected = model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(second[1][3], expected[1][0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(first[2][3], expected[2][0], rtol=1e-6, atol=1e-6)
    # Other data: other files.
    T.cached_hidden_states(model, _examples(5, seed=1), [-1], tmp_path)
    assert len(list(tmp_path.glob("states-*"))) == 4


def test_more_layers_are_stored_in_the_same_pass_for_later_recipes(tmp_path, monkeypatch):
    """``also``: an exit-layer sweep computes every layer it will train on in one pass; later recipes on those
    layers read them back without running the model. Batches group examples of similar lengths, and each example's
    states land under its own index whatever batch it ran in."""
    model = tiny_model("llama")
    examples = _examples(7, seed=2)
    computed = []
    real = T.hidden.hidden_states
    monkeypatch.setattr(T.hidden, "hidden_states", lambda *a, **k: computed.append(a[1].shape) or real(*a, **k))
    first = T.cached_hidden_states(model, examples, [2, -1], tmp_path, batch_size=3, also=[1, 3, 2])
    assert set(first) == {2, -1} and len(computed) == 3
    # Length-sorted batches pad little: at most the spread of lengths within each batch of 3.
    lengths = sorted(len(e["input_ids"]) for e in examples)
    assert [shape[1] for shape in computed] == [lengths[2], lengths[5], lengths[6]]
    later = T.cached_hidden_states(model, examples, [1, 3, -1], tmp_path, batch_size=3)
    assert len(computed) == 3  # nothing recomputed
    with torch.no_grad():
        for i, e in enumerate(examples):
            expected = model(input_ids=torch.tensor([e["input_ids"]]), output_hidden_states=True).hidden_states
            for layer in (1, 3):
                torch.testing.assert_close(later[layer][i], expected[layer][0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(first[2][i], expected[2][0], rtol=1e-5, atol=1e-5)


def _direct(model, example, layer):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([example["input_ids"]]), output_hidden_states=True).hidden_states
    return out[layer][0]


def _counting(monkeypatch, fail_after=None):
    rows = []
    real = T.hidden.hidden_states

    def counted(*a, **k):
        if fail_after is not None and len(rows) >= fail_after:
            raise KeyboardInterrupt  # as if the pass were killed here
        rows.append(a[1].shape[0])
        return real(*a, **k)
    monkeypatch.setattr(T.hidden, "hidden_states", counted)
    return rows


def test_a_data_mix_that_shares_examples_computes_only_the_new_ones(tmp_path, monkeypatch):
    model = tiny_model("llama")
    old, new = _examples(6, seed=3), _examples(4, seed=4)
    T.cached_hidden_states(model, old, [2, -1], tmp_path, batch_size=4)
    rows = _counting(monkeypatch)
    mix = [new[0], old[4], new[1], old[0], new[2], new[3], old[1]]
    states = T.cached_hidden_states(model, mix, [2, -1], tmp_path, batch_size=4)
    assert sum(rows) == 4  # only the new examples ran through the model
    for i, e in enumerate(mix):
        torch.testing.assert_close(states[2][i], _direct(model, e, 2), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[-1][i], _direct(model, e, -1), rtol=1e-5, atol=1e-5)


def test_a_killed_pass_resumes_after_its_last_written_chunk(tmp_path, monkeypatch):
    model = tiny_model("llama")
    examples = _examples(9, seed=5)
    rows = _counting(monkeypatch, fail_after=3)
    with pytest.raises(KeyboardInterrupt):
        T.cached_hidden_states(model, examples, [-1], tmp_path, batch_size=2, chunk_examples=4)
    assert sum(rows) == 6 and len(list(tmp_path.glob("states-*"))) == 1  # one chunk of 4 was written
    monkeypatch.undo()
    rows = _counting(monkeypatch)
    states = T.cached_hidden_states(model, examples, [-1], tmp_path, batch_size=2, chunk_examples=4)
    assert sum(rows) == 5
    for i, e in enumerate(examples):
        torch.testing.assert_close(states[-1][i], _direct(model, e, -1), rtol=1e-5, atol=1e-5)
    # a byte budget bounds what is held in memory: here every batch is written as soon as it is computed
    T.cached_hidden_states(model, examples, [2], tmp_path / "small", batch_size=2, chunk_bytes=1)
    assert len(list((tmp_path / "small").glob("states-*"))) == 5


def test_a_cache_of_the_first_format_is_converted_and_reused(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    model = tiny_model("llama")
    examples = _examples(4, seed=6)
    fingerprint = T.hidden.base_model_identity(model)["fingerprint"]
    legacy = {str(i): _direct(model, e, -1).contiguous() for i, e in enumerate(examples)}
    save_file(legacy, str(tmp_path / f"hidden-{fingerprint}-{T.examples_digest(examples)}-last.safetensors"))
    rows = _counting(monkeypatch)
    states = T.cached_hidden_states(model, examples, [-1], tmp_path)
    assert sum(rows) == 0 and not list(tmp_path.glob("hidden-*"))
    assert all(torch.equal(states[-1][i], legacy[str(i)]) for i in range(4))
    # Keyed by example now: another order, or a subset, is read back too.
    states = T.cached_hidden_states(model, examples[3:] + examples[:2], [-1], tmp_path)
    assert sum(rows) == 0 and torch.equal(states[-1][0], legacy["3"])


def test_states_can_be_held_in_a_narrower_dtype_and_an_overflow_is_refused(tmp_path):
    model = tiny_model("llama")
    examples = _examples(4)
    full = T.cached_hidden_states(model, examples, [1, -1], tmp_path, batch_size=2)
    half = T.cached_hidden_states(model, examples, [1, -1], tmp_path, batch_size=2, dtype=torch.bfloat16)
    for layer in (1, -1):
        assert all(torch.equal(a.bfloat16(), b) for a, b in zip(full[layer], half[layer]))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(1e6)  # a residual stream beyond float16's 65504
    loud = T.cached_hidden_states(model, examples, [1], tmp_path / "loud", batch_size=2, dtype=torch.bfloat16)
    assert max(float(t.float().abs().max()) for t in loud[1]) > 65504
    with pytest.raises(ValueError, match="overflow torch.float16 .*hold them in bfloat16"):
        T.cached_hidden_states(model, examples, [1], tmp_path / "loud", batch_size=2, dtype=torch.float16)
