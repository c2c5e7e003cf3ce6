"""selfspec.runtime.skinny: the skinny-GEMM kernel computes F.linear for every shape it takes, and decoding on it stays
lossless. The kernel is compiled once per machine (first use, about a minute); these tests share one xdist group so
that one worker builds it while the other goes on with the rest of the suite."""

from __future__ import annotations

import json
import time

import pytest
import torch

from selfspec.runtime import kernels, skinny
from selfspec.runtime.kernels import (
    SKINNY_HALF,
    linear_backend_of,
    module_backend,
    set_draft_weights,
    set_linear_backend,
)
from selfspec.testing import (
    assert_linear_backend_is_exact_and_lossless,
    assert_random_trees_decode_losslessly,
    tiny_model,
)

pytestmark = pytest.mark.xdist_group("skinny")


@pytest.fixture(scope="module")
def built():
    assert skinny.available(), f"the skinny kernel did not build here: {skinny.unavailable_reason()}"
    return skinny.extension()


@pytest.mark.parametrize("rows", [*range(1, 26), 31, 32])  # every tile shape of both ISAs and their remainders
@pytest.mark.parametrize("out_features,in_features", [(1, 1), (15, 7), (16, 64), (17, 33), (100, 24), (320, 5)])
def test_kernel_equals_f_linear(built, rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    packed = skinny.pack(weight)
    assert packed.shape == (-(-out_features // built.lanes()), in_features, built.lanes())
    torch.testing.assert_close(skinny.linear(x, packed, out_features, bias), torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(skinny.linear(x, packed, out_features, None), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_kernel_runs_on_torch_threads_and_splits_outputs_exactly(built, threads):
    """The kernel's parallel loop is compiled into the extension: built without OpenMP it silently ran on one core.
    Every thread count must split the output panels without a gap or an overlap."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert built.parallel_threads() == threads
        gen = torch.Generator().manual_seed(threads)
        weight, x = torch.randn(1000, 96, generator=gen), torch.randn(11, 96, generator=gen)
        torch.testing.assert_close(skinny.linear(x, skinny.pack(weight), 1000, None), x @ weight.T, rtol=1e-5,
                                   atol=1e-5)
    finally:
        torch.set_num_threads(previous)


def test_kernel_takes_strided_rows_and_rejects_what_does_not_fit(built):
    weight = torch.randn(48, 20)
    x = torch.randn(20, 6).T  # [6, 20], not contiguous
    assert not x.is_contiguous()
    packed = skinny.pack(weight)
    torch.testing.assert_close(skinny.linear(x, packed, 48, None), x @ weight.T, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="does not fit"):
        skinny.linear(torch.randn(3, 21), packed, 48, None)
    with pytest.raises(RuntimeError, match="float32"):
        skinny.pack(weight.double())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gpt2"])
def test_skinny_backend_matches_stock_and_decoding_stays_lossless(built, arch, monkeypatch):
    calls = []
    kernel = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    # GPT-2's Conv1D layers are not nn.Linear: only its LM head runs on the kernel.
    assert_linear_backend_is_exact_and_lossless(tiny_model(arch, dtype=torch.float32), "skinny", calls)


def test_many_rows_and_training_take_the_stock_path(built, monkeypatch):
    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "skinny")
    calls = []
    kernel = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    layer = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        big = torch.randn(skinny.MAX_ROWS + 1, layer.in_features)
        assert torch.equal(layer(big), torch.nn.functional.linear(big, layer.weight, layer.bias))
        assert calls == []
        small = torch.randn(2, 3, layer.in_features)  # 6 rows: the kernel, and the leading shape comes back
        assert layer(small).shape == (2, 3, layer.out_features) and calls == [6]
    y = layer(torch.randn(2, layer.in_features))  # gradients on: stock and differentiable
    y.sum().backward()
    assert layer.weight.grad is not None and calls == [6]


def test_switching_backends_keeps_the_packed_weights_and_repacks_a_changed_one(built):
    model = tiny_model("llama", dtype=torch.float32)
    layer = model.model.layers[0].self_attn.q_proj
    set_linear_backend(model, "skinny")
    first = layer.forward
    x = torch.randn(4, layer.in_features)
    with torch.no_grad():
        before = layer(x)
        set_linear_backend(model, "stock")
        assert "forward" not in layer.__dict__ and linear_backend_of(model) == "stock"
        set_linear_backend(model, "skinny")
        assert layer.forward is first  # the same kernel object: nothing was repacked
        layer.weight.mul_(2.0)  # in place, as an adapter merge does: the packed copy is stale now
        torch.testing.assert_close(layer(x), 2 * before, rtol=1e-4, atol=1e-5)


def test_a_machine_that_cannot_build_it_gets_a_clear_error_and_auto_still_works(monkeypatch):
    monkeypatch.setattr(skinny, "_module", None)
    monkeypatch.setattr(skinny, "_error", None)

    def no_compiler():
        raise RuntimeError("Error building extension: g++: command not found")

    monkeypatch.setattr(skinny, "_build", no_compiler)
    model = tiny_model("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match="skinny kernel is not available here.*g\\+\\+: command not found.*ninja"):
        set_linear_backend(model, "skinny")
    assert set_linear_backend(model, "auto") in ("stock", "onednn")


def test_build_key_follows_the_cpu_and_the_source(monkeypatch):
    key = skinny.build_key()
    assert key == skinny.build_key()
    monkeypatch.setattr(skinny, "_cpu_flags", lambda: "flags : sse2")
    assert skinny.build_key() != key  # -march=native code is never reused on another CPU


def test_the_build_keeps_every_multiply_add_fused_on_every_compiler(monkeypatch, tmp_path):
    """GCC's tuning for AMD Zen splits some fused multiply-adds of a chain into two roundings, in some tile shapes
    only (it did in the one-row tile on a Zen 3): the build turns that off where the compiler is GCC, asks every
    compiler for contraction, and rebuilds when the flags change. (What the flags buy is tested bit for bit in
    tests/runtime/test_grids.py: every row equals its one-row call.)"""
    banners = {"fake-gcc": "g++ (Debian 12.2.0-14) 12.2.0\nCopyright (C) 2022 Free Software Foundation, Inc.",
               "fake-clang": "Debian clang version 14.0.6\nTarget: x86_64-pc-linux-gnu",
               "fake-apple": "Apple clang version 15.0.0 (clang-1500.1.0.2.5)"}
    for name, banner in banners.items():
        script = tmp_path / name
        script.write_text(f"#!/bin/sh\nprintf '{banner}\\n'\n")
        script.chmod(0o755)
    found = {}
    for name in banners:
        monkeypatch.setenv("CXX", str(tmp_path / name))
        skinny._compiler_is_gcc.cache_clear()
        found[name] = skinny._compiler_is_gcc()
    skinny._compiler_is_gcc.cache_clear()
    assert found == {"fake-gcc": True, "fake-clang": False, "fake-apple": False}
    keys = set()
    for gcc in (True, False):
        monkeypatch.setattr(skinny, "_compiler_is_gcc", lambda gcc=gcc: gcc)
        flags = skinny.cflags()
        assert "-ffp-contract=fast" in flags
        assert ("--param=avoid-fma-max-bits=0" in flags) == gcc
        keys.add(skinny.build_key())
    assert len(keys) == 2


def test_medusa_draft_vocabulary_head_follows_the_lm_head_onto_the_kernel(built, monkeypatch):
    from medusa import MedusaHeads

    monkeypatch.setattr(kernels, "_draft_weights", "float16")  # restored after the test
    model = tiny_model("llama", dtype=torch.float32)
    heads = MedusaHeads.for_model(model, num_heads=2, draft_vocab_size=40)
    heads.set_draft_vocab(torch.randperm(model.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40])
    features = torch.randn(2, 1, 3, model.config.hidden_size)
    with torch.inference_mode():
        stock, ids = heads.draft_logits(features)
        calls = []
        kernel = skinny.linear
        monkeypatch.setattr(skinny, "linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
        set_linear_backend(model, "skinny")
        fast, fast_ids = heads.draft_logits(features)
    assert calls == [6]  # one call for both heads' 3 rows, against the 40-token slice of the LM head
    # a draft head reads float16 panels of its weights (kernels.draft_backend): exactly those weights' product
    head = heads._draft_head
    assert module_backend(head) == SKINNY_HALF
    exact = torch.nn.functional.linear(features, head.weight.detach().half().float())
    torch.testing.assert_close(fast, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, stock, rtol=1e-2, atol=1e-2)
    set_draft_weights("float32")  # float32 drafts: stock's product again
    with torch.inference_mode():
        heads._draft_head = None
        full, _ = heads.draft_logits(features)
    assert module_backend(heads._draft_head) == "skinny"
    torch.testing.assert_close(full, stock, rtol=1e-5, atol=1e-5)
    assert fast.shape == (2, 1, 3, 40) and fast_ids is ids is heads.draft_vocab


# --- the few-query attention kernel (attention.SKINNY_ATTENTION on the skinny backend) ----------------------------

def _sdpa(q, k, v, mask, scale):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def _random_mask(batch, n, keys, kind, gen):
    """A mask every query row of which sees at least its own (last-n) key: random holes, and a left pad on row 1."""
    if kind == "none":
        return None
    seen = torch.rand(batch, 1, n, keys, generator=gen) < 0.7
    seen[..., torch.arange(n), keys - n + torch.arange(n)] = True
    if batch > 1:
        seen[1, :, :, :3] = False  # padding
    if kind == "bool":
        return seen
    return torch.zeros(batch, 1, n, keys).masked_fill(~seen, torch.finfo(torch.float32).min)


@pytest.mark.parametrize("n", [1, 2, 7, 16, 17, 32])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kind", ["none", "bool", "float"])
def test_attention_kernel_equals_sdpa(built, n, heads, kv_heads, head_dim, kind):
    # every build takes these (256, Gemma 3's, is 32 vectors on AVX2: its value columns are summed in chunks)
    assert skinny.attention_supported(head_dim)
    gen = torch.Generator().manual_seed(n * 100 + heads + head_dim)
    batch, keys, capacity = 2, 37 + n, 64 + n
    # the layouts of a real forward: queries transposed from [B, n, H, D], keys/values views of a larger cache buffer
    q = torch.randn(batch, n, heads, head_dim, generator=gen).transpose(1, 2)
    k = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen)[:, :, :keys]
    v = torch.randn(batch, kv_heads, capacity, head_dim, generator=gen)[:, :, :keys]
    mask = _random_mask(batch, n, keys, kind, gen)
    scale = head_dim ** -0.5
    torch.testing.assert_close(skinny.attention(q, k, v, mask, scale), _sdpa(q, k, v, mask, scale),
                               rtol=1e-5, atol=2e-6)


def test_attention_kernel_broadcasts_one_mask_over_the_batch_and_refuses_what_it_cannot_take(built):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, s, 64, generator=gen) for h, s in ((6, 5), (2, 20), (2, 20)))
    mask = _random_mask(1, 5, 20, "bool", gen)
    torch.testing.assert_close(skinny.attention(q, k, v, mask, 0.125), _sdpa(q, k, v, mask, 0.125),
                               rtol=1e-5, atol=2e-6)
    blind = mask.clone()
    blind[0, 0, 2] = False  # a query that sees no key (a padding row): zeros, as SDPA gives
    torch.testing.assert_close(skinny.attention(q, k, v, blind, 0.125), _sdpa(q, k, v, blind, 0.125),
                               rtol=1e-5, atol=2e-6)
    assert not skinny.attention(q, k, v, blind, 0.125)[:, 2].any()
    with pytest.raises(RuntimeError, match="mask"):
        skinny.attention(q, k, v, torch.ones(3, 6, 5, 20, dtype=torch.bool), 0.125)  # one mask per head
    with pytest.raises(RuntimeError, match="float32"):
        skinny.attention(q.double(), k, v, None, 0.125)
    assert not skinny.attention_supported(8) and not skinny.attention_supported(72)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma"])
def test_skinny_backend_attention_runs_few_query_forwards_and_stays_lossless(built, arch, monkeypatch):
    """With heads of a size the kernel takes, every decode step and tree verification on the skinny backend runs the
    attention kernel (the prefill and training do not), and decoding equals ``generate``, alone and in a padded
    batch."""
    from decoding.batch import generate_batch
    from selfspec.runtime.attention import SKINNY_ATTENTION

    model = tiny_model(arch, dtype=torch.float32, head_dim=64)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        stock = model(ids).logits
        set_linear_backend(model, "skinny")
        assert model.config._attn_implementation == SKINNY_ATTENTION
        torch.testing.assert_close(model(ids).logits, stock, rtol=1e-4, atol=1e-4)
    queries = []
    kernel, layer = skinny.attention, skinny.decoder_layer
    monkeypatch.setattr(skinny, "attention", lambda q, *a: queries.append(q.shape[2]) or kernel(q, *a))
    # a Llama layer runs the kernel inside its one fused call (selfspec.runtime.lean): rows / batch queries
    monkeypatch.setattr(skinny, "decoder_layer", lambda h, *a: queries.append(h.shape[0] // a[8].shape[0])
                        or layer(h, *a))
    stack = skinny.decoder_stack  # and a Llama decoder runs all its layers as one call: rows / batch queries
    monkeypatch.setattr(skinny, "decoder_stack", lambda s, h, c, sn, keys, *a: queries.append(h.shape[0] // keys[0].shape[0])
                        or stack(s, h, c, sn, keys, *a))
    assert_random_trees_decode_losslessly(model)
    assert queries and max(queries) <= 7 and 1 in queries and any(n > 1 for n in queries)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]  # the second is left-padded: a masked batch forward
    rows = generate_batch(model, None, prompts, max_new_tokens=8, eos_token_id=None).sequences
    for prompt, row in zip(prompts, rows):
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, min_new_tokens=8)
        assert row.tolist() == expected.tolist()
    queries.clear()
    model(ids[:, :1]).logits.sum()  # one query, grad enabled (training): transformers' path
    assert not queries
    set_linear_backend(model, "stock")
    assert model.config._attn_implementation == "sdpa"


def test_skinny_attention_takes_only_what_the_kernel_computes_exactly(built, monkeypatch):
    """Through the registered implementation: an expanded (stride-0) mask runs the kernel; a mask that only
    broadcasts over the queries, and more than 32 queries, go to SDPA; all three equal SDPA."""
    from types import SimpleNamespace

    from selfspec.runtime.attention import skinny_attention

    calls = []
    kernel = skinny.attention
    monkeypatch.setattr(skinny, "attention", lambda *a: calls.append(1) or kernel(*a))
    module = SimpleNamespace(num_key_value_groups=3, training=False)
    gen = torch.Generator().manual_seed(5)
    for n, mask_shape, expected_calls in ((6, "expanded", 1), (6, "broadcast over queries", 0), (33, "full", 0)):
        q, k, v = (torch.randn(2, h, s, 64, generator=gen) for h, s in ((6, n), (2, 30 + n), (2, 30 + n)))
        full = _random_mask(2, n, 30 + n, "bool", gen)
        mask = {"expanded": full[:1].expand(2, 1, n, 30 + n), "broadcast over queries": full[:, :, :1],
                "full": full}[mask_shape]
        calls.clear()
        with torch.inference_mode():
            out, _ = skinny_attention(module, q, k, v, mask, scaling=0.125)
        assert len(calls) == expected_calls, mask_shape
        torch.testing.assert_close(out, _sdpa(q, k, v, mask, 0.125), rtol=1e-5, atol=2e-6)


def test_batched_tree_verification_on_the_attention_kernel_is_lossless_per_row(built, monkeypatch):
    """Every row of a ragged batch drafts its own random tree; the batch's verification forwards (per-row 4D masks)
    run the attention kernel, and each row equals its own HF greedy continuation, EOS inside a tree included."""
    from decoding.batch import generate_batch
    from selfspec.testing import RandomDrafter

    model = tiny_model("llama", dtype=torch.float32, head_dim=64)
    set_linear_backend(model, "skinny")
    queries = []
    kernel = skinny.attention
    monkeypatch.setattr(skinny, "attention", lambda q, *a: queries.append((q.shape[0], q.shape[2])) or kernel(q, *a))
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 96, (1, n), generator=gen) for n in (3, 17, 9)]

    def greedy(prompt, new, eos=None):
        return model.generate(prompt, max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0,
                              **({} if eos is not None else {"min_new_tokens": new}))

    eos = int(greedy(prompts[1], 12)[0, 17 + 5])  # a token the second row emits: it stops early, inside a tree
    drafters = [RandomDrafter(96, size=6, seed=r, reference=greedy(p, 40), hit_rate=0.7)
                for r, p in enumerate(prompts)]
    out = generate_batch(model, drafters, prompts, max_new_tokens=20, eos_token_id=eos)
    for r, prompt in enumerate(prompts):
        assert out.sequences[r].tolist() == greedy(prompt, 20, eos).tolist(), r
    assert any(b > 1 and n > 1 for b, n in queries)  # batched tree forwards ran on the kernel


# ---- the decoder layer's small operations (selfspec.runtime.lean calls them between the kernels) ----


@pytest.mark.parametrize("rows", [1, 3, 16, 24])
def test_linear_adds_the_residual_last_exactly(built, rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(40, 33, generator=gen), torch.randn(40, generator=gen)
    x, residual = torch.randn(rows, 33, generator=gen), torch.randn(rows, 40, generator=gen)
    packed = skinny.pack(weight)
    # the same two float32 numbers added: bitwise what `residual + linear(x)` gives on the same kernel
    assert torch.equal(skinny.linear(x, packed, 40, bias, residual), residual + skinny.linear(x, packed, 40, bias))
    with pytest.raises(RuntimeError, match="residual"):
        skinny.linear(x, packed, 40, bias, torch.zeros(rows, 39))


@pytest.mark.parametrize("hidden", [576, 64, 37])  # SmolLM2's, one vector's multiple, a remainder
def test_rms_norm_equals_the_llama_norm_and_each_row_is_computed_alone(built, hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    x = torch.randn(20, hidden, generator=gen) * 3
    out = skinny.rms_norm(x, norm.weight.detach(), 1e-5)
    torch.testing.assert_close(out, norm(x).detach(), rtol=1e-5, atol=1e-5)
    for r in (0, 7, 19):  # a row's result does not depend on the rows beside it: a tree row = a one-token step
        assert torch.equal(skinny.rms_norm(x[r:r + 1].contiguous(), norm.weight.detach(), 1e-5), out[r:r + 1])
    with pytest.raises(RuntimeError, match="weight"):
        skinny.rms_norm(x, torch.ones(hidden + 1), 1e-5)


@pytest.mark.parametrize("head_dim", [64, 128, 20])
@pytest.mark.parametrize("batch,positions_batch", [(1, 1), (3, 3), (3, 1)])
def test_rope_equals_transformers_rotary_in_place(built, head_dim, batch, positions_batch):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(head_dim + batch)
    n, heads = 5, 3
    q = torch.randn(batch, n, heads * head_dim, generator=gen)
    angles = torch.rand(positions_batch, n, head_dim // 2, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected, _ = apply_rotary_pos_emb(q.view(batch, n, heads, head_dim).transpose(1, 2),
                                       q.view(batch, n, heads, head_dim).transpose(1, 2), cos, sin)
    rows = q.reshape(batch * n, -1).clone()
    out = skinny.rope_(rows, cos.reshape(-1, head_dim).contiguous(), sin.reshape(-1, head_dim).contiguous(), head_dim)
    assert out is rows  # in place
    got = rows.view(batch, n, heads, head_dim).transpose(1, 2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    one = q.reshape(batch * n, -1)[2:3].clone()  # the third token alone, with its own position row
    position = cos.reshape(-1, head_dim)[2 % (positions_batch * n):][:1].contiguous()
    position_sin = sin.reshape(-1, head_dim)[2 % (positions_batch * n):][:1].contiguous()
    assert torch.equal(skinny.rope_(one, position, position_sin, head_dim)[0], rows[2])
    with pytest.raises(RuntimeError, match="head dim"):
        short = cos.reshape(-1, head_dim)[:, :-2].contiguous()
        skinny.rope_(rows, short, short, head_dim)


@pytest.mark.parametrize("width", [1536, 16, 37, 5])
def test_silu_mul_equals_silu_times_up_at_every_magnitude(built, width):
    gen = torch.Generator().manual_seed(width)
    gate = torch.randn(7, width, generator=gen) * 6
    gate[0, : min(width, 4)] = torch.tensor([-200.0, -88.5, 90.0, 300.0])[: min(width, 4)]  # exp's range edges
    up = torch.randn(7, width, generator=gen)
    expected = torch.nn.functional.silu(gate) * up
    got = skinny.silu_mul_(gate.clone(), up)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-30)
    assert torch.isfinite(got).all()
    # element by element: a row alone (a one-token step) gets exactly what it gets among others (a tree)
    assert torch.equal(skinny.silu_mul_(gate[3:4].clone(), up[3:4].contiguous()), got[3:4])


# ---- float16 weights for drafters' layers (kernels.SKINNY_HALF) ----


@pytest.mark.parametrize("rows", [*range(1, 26)])
def test_half_panels_compute_the_float16_rounded_weights_product(built, rows):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(70, 45, generator=gen), torch.randn(70, generator=gen)
    x, residual = torch.randn(rows, 45, generator=gen), torch.randn(rows, 70, generator=gen)
    packed = skinny.pack(weight, half=True)
    assert packed.dtype == torch.float16 and packed.shape == skinny.pack(weight).shape
    rounded = weight.half().float()
    torch.testing.assert_close(skinny.linear(x, packed, 70, bias), torch.nn.functional.linear(x, rounded, bias),
                               rtol=1e-5, atol=1e-5)
    # float32 panels holding the rounded weights give the same sums (the kernel only widens on load; the compiler
    # may fuse a multiply-add differently in the two builds of the loop, hence not bitwise on every ISA)
    torch.testing.assert_close(skinny.linear(x, packed, 70, bias, residual),
                               skinny.linear(x, skinny.pack(rounded), 70, bias, residual), rtol=1e-6, atol=1e-5)


def test_a_weight_beyond_float16_keeps_float32_panels(built):
    layer = torch.nn.Linear(8, 20)
    with torch.no_grad():
        layer.weight[3, 2] = 1e6
    kernels.set_module_backend(layer, SKINNY_HALF)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=1e-5,
                                   atol=1e-3)
    assert layer.forward._weight.dtype == torch.float32


@pytest.mark.parametrize("draft", ["eagle", "early-exit"])
def test_drafters_draft_on_float16_or_grid_weights_and_stay_lossless(built, draft, monkeypatch):
    from decoding.generate import generate
    from eagle.drafter import EagleDrafter, EaglePolicy
    from early_exit.drafter import EarlyExitDrafter
    from selfspec.testing import attention_classifier, eagle_draft, greedy_reference, random_prompt

    monkeypatch.setattr(kernels, "_draft_weights", "float16")
    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "skinny")
    if draft == "eagle":
        module = eagle_draft(model, seed=7, draft_vocab_size=60)
        drafter = EagleDrafter(model, module, EaglePolicy(depth=4, nodes=8, top_k=2, width=2))
        layers = module.linear_layers
    else:
        classifier = attention_classifier(model, exit_layer=1)
        drafter = EarlyExitDrafter(model, classifier)
        layers = lambda: classifier.linear_layers(model)  # noqa: E731
    taus = {}
    for weights in ("float16", "float32", "q4_1", "q8_0", "float16"):  # float16 again: repacked back
        set_draft_weights(weights)
        for n, new in ((1, 9), (5, 30), (19, 17)):
            ids = random_prompt(n, seed=n)
            out = generate(model, drafter, ids, max_new_tokens=new)
            assert torch.equal(out.sequences, greedy_reference(model, ids, new)), (draft, weights, n)
            taus[weights, n] = out.stats.tau
        expected = "skinny" if weights == "float32" else SKINNY_HALF
        assert {module_backend(m) for m in layers()} == {expected}, weights
        formats = {skinny.packed_format(m.forward._weight) for m in layers() if m.in_features % 32 == 0}
        assert formats == {weights}, (weights, formats)  # blocks of 32 inputs: the chosen grid
        if draft == "early-exit" and weights == "float16":  # its shallow base layers drafted on float16 copies
            assert drafter._linears and all(SKINNY_HALF in m.__dict__[kernels._KERNEL_CACHE] for m in drafter._linears)
        assert all(module_backend(m) == "skinny" for m in model.modules() if isinstance(m, torch.nn.Linear))


@pytest.mark.parametrize("width", [None, 3 * 64], ids=["base-width", "wider-mlp"])
def test_feature_drafter_step_runs_one_lean_pass_equal_to_its_layer(built, monkeypatch, width):
    from eagle.model import DraftCache
    from selfspec.runtime import lean
    from selfspec.testing import eagle_draft

    model = tiny_model("llama", dtype=torch.float32)
    draft = eagle_draft(model, seed=3, draft_vocab_size=60, intermediate_size=width)
    assert draft.layer.mlp.down_proj.in_features == (width or model.config.intermediate_size)
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    features, ids = torch.randn(1, 5, hidden, generator=gen), torch.randint(0, 60, (1, 5), generator=gen)
    positions = torch.arange(5)[None]
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]

    def run():
        cache = DraftCache()
        with torch.inference_mode():
            out = draft.step(features, ids, positions, mask, cache)
            return out, draft.logits(out), cache.keys.clone()

    stock = run()
    calls = []
    block = lean.block
    monkeypatch.setattr(lean, "block", lambda *a, **k: calls.append(1) or block(*a, **k))
    monkeypatch.setattr(kernels, "_draft_weights", "float32")  # the same float32 weights on both sides
    set_linear_backend(model, "skinny")
    kernels.follow_backend(model, draft.linear_layers, "stock")  # what the drafter's begin does
    fast = run()
    assert calls == [1]
    for a, b in zip(fast, stock):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_gemma3_feature_drafter_steps_run_its_lean_layer_and_decode_losslessly(built, monkeypatch):
    """A Gemma 3 feature drafter on the skinny backend drafts through the base's lean Gemma 3 layer (from its two
    normed halves, ``1 + w`` norms) and ranks with ``head_top``: outputs, logits, top-k and cache entries as its
    modules compute them, and greedy decoding past the base's sliding window stays equal to generate."""
    from decoding.generate import generate
    from eagle.drafter import EagleDrafter, EaglePolicy
    from eagle.model import DraftCache
    from selfspec.runtime import lean
    from selfspec.runtime.tiny import tiny_gemma3
    from selfspec.testing import eagle_draft, greedy_reference, random_prompt

    model = tiny_gemma3()
    draft = eagle_draft(model, seed=3, draft_vocab_size=60)
    with torch.no_grad():  # trained norms are not zero: give the draft's own norms weights (Gemma's 1 + w)
        for name, parameter in draft.named_parameters():
            if "norm" in name:
                parameter.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    features, ids = torch.randn(1, 8, hidden, generator=gen), torch.randint(0, 60, (1, 8), generator=gen)
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])

    def run():
        cache = DraftCache()
        with torch.inference_mode():
            first = draft.step(features[:, :5], ids[:, :5], torch.arange(5)[None],
                               torch.ones(5, 5, dtype=torch.bool).tril()[None, None], cache)
            mask = torch.cat([torch.ones(3, 5, dtype=torch.bool), tree], dim=1)[None, None]
            three = draft.step(features[:, 5:8], ids[:, 5:8], torch.tensor([[5, 6, 6]]), mask, cache)
            values, columns = draft.top(three[0], 4)
            return [first, three, draft.logits(three), values, cache.keys.clone(), cache.values.clone()], columns

    stock, stock_columns = run()
    calls, tops = [], []
    block = lean._LeanGemma3Forward.block
    monkeypatch.setattr(lean._LeanGemma3Forward, "block", lambda *a, **k: calls.append(1) or block(*a, **k))
    head_top = skinny.head_top
    monkeypatch.setattr(skinny, "head_top", lambda *a: tops.append(1) or head_top(*a))
    monkeypatch.setattr(kernels, "_draft_weights", "float32")  # the same float32 weights on both sides
    set_linear_backend(model, "skinny")
    kernels.follow_backend(model, draft.linear_layers, "stock")  # what the drafter's begin does
    fast, fast_columns = run()
    assert calls == [1, 1] and tops == [1]
    assert torch.equal(fast_columns, stock_columns)
    for a, b in zip(fast, stock):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    drafter = EagleDrafter(model, draft, EaglePolicy(depth=3, nodes=6, top_k=3, width=2))
    for n, new in ((2, 12), (9, 20)):  # past the window of 6
        prompt = random_prompt(n, seed=n)
        out = generate(model, drafter, prompt, max_new_tokens=new)
        assert torch.equal(out.sequences, greedy_reference(model, prompt, new)), n


def test_feature_drafter_steps_over_its_cache_run_as_one_call_bitwise_equal_to_the_lean_pass(built, monkeypatch):
    """Once its cache holds buffers, a draft step on the skinny backend runs the draft layer as one extension call
    (``lean.fused_block`` with the two normed halves as the attention input): outputs, logits and cache entries
    equal the twelve-call lean pass bit for bit, for a single token and a masked tree step."""
    from eagle.model import DraftCache
    from selfspec.runtime import lean
    from selfspec.testing import eagle_draft

    model = tiny_model("llama", dtype=torch.float32, head_dim=64)
    set_linear_backend(model, "skinny")  # before the drafter is built, as loading one onto a model does: its layer
    draft = eagle_draft(model, seed=4, draft_vocab_size=60)  # takes the base's (skinny) attention from its config
    kernels.follow_backend(model, draft.linear_layers, "stock")
    hidden = model.config.hidden_size
    gen = torch.Generator().manual_seed(1)
    features, ids = torch.randn(1, 9, hidden, generator=gen), torch.randint(0, 60, (1, 9), generator=gen)
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])
    fused = []
    layer_call = skinny.decoder_layer
    monkeypatch.setattr(skinny, "decoder_layer", lambda h, *a: fused.append(h.shape[0]) or layer_call(h, *a))

    def run(enabled: bool):
        monkeypatch.setattr(lean, "FUSED_LAYERS", enabled)
        cache = DraftCache()
        with torch.inference_mode():
            draft.step(features[:, :5], ids[:, :5], torch.arange(5)[None],
                       torch.ones(5, 5, dtype=torch.bool).tril()[None, None], cache)  # the verified prefix
            one = draft.step(features[:, 5:6], ids[:, 5:6], torch.tensor([[5]]), None, cache)
            mask = torch.cat([torch.ones(3, 6, dtype=torch.bool), tree], dim=1)[None, None]
            three = draft.step(features[:, 6:9], ids[:, 6:9], torch.tensor([[6, 7, 7]]), mask, cache)
            return [one, draft.logits(one), three, draft.logits(three), cache.keys.clone(), cache.values.clone()]

    plain = run(False)
    assert not fused
    together = run(True)
    assert fused == [1, 3]  # the prefix step finds no buffers yet: the twelve-call pass fills them
    assert all(torch.equal(a, b) for a, b in zip(plain, together))


@pytest.mark.parametrize("mlp", [0, 40])
def test_early_exit_attention_adapter_runs_one_lean_pass_equal_to_its_modules(built, monkeypatch, mlp):
    from early_exit.adapter import AttentionAdapter
    from early_exit.layers import additive_mask
    from selfspec.runtime.attention import LayerCache
    from selfspec.testing import attention_classifier

    model = tiny_model("llama", dtype=torch.float32)
    adapter = attention_classifier(model, exit_layer=1, adapter_mlp_size=mlp).attention
    width = model.config.hidden_size
    gen = torch.Generator().manual_seed(mlp)
    prefix, new = torch.randn(1, 7, width, generator=gen), torch.randn(1, 3, width, generator=gen)
    allowed = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])  # a draft tree

    def run():
        cache = LayerCache()
        with torch.inference_mode():
            adapter.extend(prefix, model, torch.arange(7)[None], cache)
            out = adapter(new, model, position_ids=torch.tensor([[7, 8, 8]]),
                          attention_mask=additive_mask(allowed, 7, torch.float32), cache=cache)
            one = adapter(new[:, :1], model, position_ids=torch.tensor([[10]]), cache=cache)  # one token, no mask
        return out, one, cache.keys.clone(), cache.values.clone()

    stock = run()
    calls = []
    lean_forward = AttentionAdapter._lean_forward
    monkeypatch.setattr(AttentionAdapter, "_lean_forward", lambda *a: calls.append(1) or lean_forward(*a))
    monkeypatch.setattr(kernels, "_draft_weights", "float32")  # the same float32 weights on both sides
    set_linear_backend(model, "skinny")
    kernels.follow_backend(model, lambda: [m for m in adapter.modules() if isinstance(m, torch.nn.Linear)], "stock")
    fast = run()
    assert calls == [1, 1]
    for a, b in zip(fast, stock):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def auto_with_clock(monkeypatch, model, setting, wins) -> list:
    """``set_linear_backend(model, "auto")`` (asserted to pick skinny) with ``kernels``' clock replaced: a probe's
    forward run while ``wins(setting())`` takes one tick, any other a hundred, whichever order they run in. Returns
    ``setting()`` at every clock reading."""
    clock = iter(range(10**6))
    seen = []

    def timed():
        current = setting()
        seen.append(current)
        return next(clock) * (1 if wins(current) else 100)

    real = time.perf_counter
    monkeypatch.setattr(kernels.time, "perf_counter", timed)
    try:
        assert set_linear_backend(model, "auto") == "skinny"
    finally:
        monkeypatch.setattr(kernels.time, "perf_counter", real)
    return seen


@pytest.mark.parametrize("faster", ["skinny", "stock"])
def test_auto_lets_the_kernel_take_prefills_where_it_measured_faster(built, monkeypatch, tmp_path, faster):
    from selfspec.runtime.io import cache_home

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_choose", lambda *a, **k: "skinny")  # what auto picks for decoding
    model = tiny_model("llama", dtype=torch.float32)
    seen = auto_with_clock(monkeypatch, model, lambda: skinny.MAX_ROWS,
                           lambda rows: (rows == skinny.PREFILL_ROWS) == (faster == "skinny"))
    expected = skinny.PREFILL_ROWS if faster == "skinny" else skinny.DECODE_ROWS
    assert skinny.MAX_ROWS == expected and set(seen) == {skinny.DECODE_ROWS, skinny.PREFILL_ROWS}
    entries = json.loads((cache_home() / "kernels" / "backend-choices.json").read_text())
    assert [e["rows"] for k, e in entries.items() if k.endswith("-prefill")] == [expected]


def test_a_prefill_on_the_kernel_decodes_exactly_like_one_on_pytorch(built, monkeypatch):
    from selfspec.testing import greedy_reference, random_prompt

    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "skinny")
    ids = random_prompt(40, seed=3)
    with torch.inference_mode():
        stock_prefill = model(ids).logits
    reference = greedy_reference(model, ids, 20)
    calls = []
    kernel = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    monkeypatch.setattr(skinny, "MAX_ROWS", skinny.PREFILL_ROWS)
    with torch.inference_mode():
        fast_prefill = model(ids).logits
    assert 40 in calls  # the 40-row prefill ran on the kernel
    torch.testing.assert_close(fast_prefill, stock_prefill, rtol=1e-4, atol=1e-4)
    # a prompt's rows get what one-token steps would: greedy output as with PyTorch's prefill, trees lossless
    assert torch.equal(greedy_reference(model, ids, 20), reference)
    assert_random_trees_decode_losslessly(model)


@pytest.mark.parametrize("draft", ["eagle", "early-exit", "medusa"])
def test_drafters_stay_lossless_with_prompts_prefilled_on_the_kernel(built, monkeypatch, draft):
    from decoding.generate import generate
    from eagle.drafter import EagleDrafter, EaglePolicy
    from early_exit.drafter import EarlyExitDrafter
    from medusa.drafter import MedusaDrafter
    from selfspec.testing import attention_classifier, eagle_draft, greedy_reference, random_prompt, sequential_heads

    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "skinny")
    monkeypatch.setattr(skinny, "MAX_ROWS", skinny.PREFILL_ROWS)  # what auto sets where the kernel wins prefills
    if draft == "eagle":  # its begin() also runs its layer over the whole prompt: a lean pass of 40+ rows
        drafter = EagleDrafter(model, eagle_draft(model, seed=7, draft_vocab_size=60), EaglePolicy(depth=3, nodes=6))
    elif draft == "early-exit":
        drafter = EarlyExitDrafter(model, attention_classifier(model, exit_layer=1))
    else:
        drafter = MedusaDrafter(sequential_heads(model))
    rows = []
    kernel = skinny.linear
    monkeypatch.setattr(skinny, "linear", lambda *a: rows.append(a[0].shape[0]) or kernel(*a))
    for n in (33, 47):
        ids = random_prompt(n, seed=n)
        out = generate(model, drafter, ids, max_new_tokens=24)
        assert torch.equal(out.sequences, greedy_reference(model, ids, 24)), (draft, n)
    assert max(rows) >= 32  # the prompts' prefill ran on the kernel


def test_the_two_tile_shapes_for_15_and_16_rows_give_the_same_bits(built):
    """15-16 rows run as one 16-row tile per panel or a 12-row tile over two panels and the rest: which is faster
    differs between CPUs, the results never do (every output is the same K-ordered sum)."""
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(100, 72, generator=gen), torch.randn(100, generator=gen)
    packed = skinny.pack(weight)
    try:
        for rows in (13, 15, 16, 17):
            x = torch.randn(rows, 72, generator=gen)
            assert skinny.set_wide_tiles("16x1") == "16x1"
            tall = skinny.linear(x, packed, 100, bias)
            wide = skinny.set_wide_tiles("12x2")
            assert wide == ("12x2" if built.lanes() == 16 else "16x1")  # no choice without AVX-512
            assert torch.equal(skinny.linear(x, packed, 100, bias), tall)
            torch.testing.assert_close(tall, torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    finally:
        skinny.set_wide_tiles("16x1")
    with pytest.raises(ValueError, match="tile shape"):
        skinny.set_wide_tiles("8x3")


@pytest.mark.parametrize("faster", ["16x1", "12x2"])
def test_auto_picks_the_tile_shape_that_ran_faster_and_remembers_it(built, monkeypatch, tmp_path, faster):
    from selfspec.runtime.io import cache_home

    if built.lanes() != 16:
        pytest.skip("one tile shape without AVX-512: nothing to choose")
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_choose", lambda *a, **k: "skinny")
    monkeypatch.setattr(kernels, "_prefill_rows", lambda *a, **k: skinny.DECODE_ROWS)
    model = tiny_model("llama", dtype=torch.float32)
    shapes = auto_with_clock(monkeypatch, model, skinny.wide_tiles, lambda shape: shape == faster)
    assert set(shapes) == set(skinny.WIDE_TILES) and skinny.wide_tiles() == faster
    entries = json.loads((cache_home() / "kernels" / "backend-choices.json").read_text())
    assert [e["tiles"] for k, e in entries.items() if k.endswith("-wide-tiles")] == [faster]
    skinny.set_wide_tiles("16x1" if faster == "12x2" else "12x2")
    set_linear_backend(model, "auto")  # remembered: no probe, the recorded shape set again
    assert skinny.wide_tiles() == faster
    skinny.set_wide_tiles("16x1")


def test_small_tiles_give_the_same_bits_with_and_without_prefetch(built):
    """Tiles of 1-4 rows software-prefetch the next tile's weights or leave it to the CPU (a per-machine choice):
    a prefetch moves no arithmetic, so every panel kind (float32, float16, the Q4_1 / Q8_0 grids) gives the same
    bits either way, over several tiles and a remainder panel, on every thread count."""
    gen = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(200, 96, generator=gen) * 0.05, torch.randn(200, generator=gen)
    packs = {"float32": skinny.pack(weight), "float16": skinny.pack(weight, half=True),
             "q4_1": skinny.pack_quantized(weight, "q4_1"), "q8_0": skinny.pack_quantized(weight, "q8_0")}
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows in (1, 2, 3, 4, 5):
                x = torch.randn(rows, 96, generator=gen)
                for kind, packed in packs.items():
                    assert skinny.set_small_prefetch(False) is False
                    plain = skinny.linear(x, packed, 200, bias)
                    assert skinny.set_small_prefetch(True) is True and skinny.small_prefetch()
                    assert torch.equal(skinny.linear(x, packed, 200, bias), plain), (kind, rows, n_threads)
                    if kind == "float32":
                        torch.testing.assert_close(plain, torch.nn.functional.linear(x, weight, bias), rtol=1e-5,
                                                   atol=1e-5)
    finally:
        torch.set_num_threads(threads)
        skinny.set_small_prefetch(skinny.SMALL_PREFETCH_DEFAULT)
    with pytest.raises(ValueError, match="True or False"):
        skinny.set_small_prefetch(1)


def test_small_tile_prefetch_starts_at_its_documented_default(built):
    import subprocess
    import sys

    code = "from selfspec.runtime import skinny; print(skinny.small_prefetch(), skinny.SMALL_PREFETCH_DEFAULT)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == out[1]  # the kernel's own initial setting is the documented one


@pytest.mark.parametrize("faster", [False, True])
def test_auto_turns_small_tile_prefetch_on_only_where_it_ran_faster_and_remembers_it(built, monkeypatch, tmp_path,
                                                                                      faster):
    from selfspec.runtime.io import cache_home

    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path))
    monkeypatch.setattr(kernels, "_choose", lambda *a, **k: "skinny")
    monkeypatch.setattr(kernels, "_prefill_rows", lambda *a, **k: skinny.DECODE_ROWS)
    monkeypatch.setattr(kernels, "_wide_tiles", lambda *a, **k: "16x1")
    model = tiny_model("llama", dtype=torch.float32)
    try:
        seen = auto_with_clock(monkeypatch, model, skinny.small_prefetch, lambda on: on == faster)
        assert set(seen) == {False, True} and skinny.small_prefetch() is faster
        entries = json.loads((cache_home() / "kernels" / "backend-choices.json").read_text())
        recorded = [e for k, e in entries.items() if k.endswith("-small-prefetch")]
        assert [e["prefetch"] for e in recorded] == [faster]
        assert set(recorded[0]["ms"]) == {"off", "on"} and recorded[0]["tokens"] == list(kernels.SMALL_PREFETCH_PROBE)
        skinny.set_small_prefetch(not faster)
        monkeypatch.setattr(kernels, "time_forwards", lambda *a, **k: pytest.fail("measured again"))
        set_linear_backend(model, "auto")  # remembered: no probe, the recorded setting again
        assert skinny.small_prefetch() is faster
    finally:
        skinny.set_small_prefetch(skinny.SMALL_PREFETCH_DEFAULT)


def test_a_feature_drafter_built_before_the_backend_follows_its_attention(built, monkeypatch):
    """A drafter's layer copies the base's config when it is built; built before ``set_linear_backend``, it takes
    the base's attention on ``begin`` (the skinny kernel, so its steps run as one call) and back to SDPA when the
    base goes back to stock; decoding equals ``generate`` throughout."""
    from decoding.generate import generate
    from eagle.drafter import EagleDrafter, EaglePolicy
    from selfspec.runtime.attention import SKINNY_ATTENTION
    from selfspec.testing import eagle_draft, greedy_reference, random_prompt

    model = tiny_model("llama", dtype=torch.float32, head_dim=64)
    drafter = EagleDrafter(model, eagle_draft(model, seed=5, draft_vocab_size=60), EaglePolicy(depth=3, nodes=5))
    config = drafter.draft.layer.self_attn.config
    assert config._attn_implementation == "sdpa"
    fused = []
    layer_call = skinny.decoder_layer
    monkeypatch.setattr(skinny, "decoder_layer", lambda h, *a: fused.append(a[15] is not None) or layer_call(h, *a))
    ids = random_prompt(6, seed=3)
    set_linear_backend(model, "skinny")
    out = generate(model, drafter, ids, max_new_tokens=12)
    assert torch.equal(out.sequences, greedy_reference(model, ids, 12))
    assert config._attn_implementation == SKINNY_ATTENTION and any(fused)  # draft steps (their normed input) too
    set_linear_backend(model, "stock")
    out = generate(model, drafter, ids, max_new_tokens=12)
    assert torch.equal(out.sequences, greedy_reference(model, ids, 12)) and config._attn_implementation == "sdpa"


def test_top_log_probs_ranks_as_log_softmax_topk(built):
    """``skinny.top_log_probs`` (a drafter's ranking, ``head_top``'s last part) gives ``log_softmax(x).topk(k)``:
    the same columns in the same order, the same log-probabilities up to exp's rounding, over vector tails; equal
    values keep the earlier column first, NaN is never chosen, and k beyond the width is clipped."""
    gen = torch.Generator().manual_seed(9)
    for rows, width, k in ((1, 12288, 4), (3, 1001, 8), (2, 7, 3), (1, 40, 40)):
        x = torch.randn(rows, width, generator=gen) * 3
        values, indices = skinny.top_log_probs(x, k)
        top = torch.log_softmax(x, dim=-1).topk(k, dim=-1)
        assert torch.equal(indices, top.indices)
        torch.testing.assert_close(values, top.values, rtol=1e-5, atol=1e-5)
    tied = torch.tensor([[1.0, float("nan"), 3.0, 3.0, -2.0, 3.0]])
    values, indices = skinny.top_log_probs(tied, 9)
    assert indices[0, :5].tolist() == [2, 3, 5, 0, 4] and values.shape == (1, 6)
    assert values[0, 0] == values[0, 1] == values[0, 2] and values[0, 5] == float("-inf")  # 5 numbers for 6 slots
    expected = torch.log_softmax(torch.tensor([1.0, 3.0, 3.0, -2.0, 3.0]), dim=0)
    torch.testing.assert_close(values[0, :5], expected[[1, 2, 4, 0, 3]])
    w = torch.randn(50, 64, generator=gen) * 0.1
    h, norm = torch.randn(2, 64, generator=gen), torch.rand(64, generator=gen) + 0.5
    values, indices = skinny.head_top(h, norm, 1e-6, skinny.pack(w), 50, None, 5)
    logits = skinny.linear(skinny.rms_norm(h, norm, 1e-6), skinny.pack(w), 50, None)
    assert torch.equal((values, indices)[1], torch.log_softmax(logits, -1).topk(5, -1).indices)


def test_a_feature_drafters_policy_chooses_its_own_draft_weights(built, monkeypatch, tmp_path):
    """``EaglePolicy(draft_weights="q4_1")`` (or ``eagle:DIR[draft_weights=q4_1]``): its layers pack on Q4_1 while
    the process-wide choice stays float16 for every other drafter; lossless; a bad name is refused."""
    from decoding.generate import generate
    from decoding.registry import make_drafter
    from eagle.drafter import EagleDrafter, EaglePolicy
    from eagle.model import save_pretrained
    from selfspec.testing import eagle_draft, greedy_reference, random_prompt

    monkeypatch.setattr(kernels, "_draft_weights", "float16")
    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "skinny")
    module = eagle_draft(model, seed=7, draft_vocab_size=60)
    drafter = EagleDrafter(model, module, EaglePolicy(depth=3, nodes=6, top_k=2, width=2, draft_weights="q4_1"))
    ids = random_prompt(5, seed=5)
    out = generate(model, drafter, ids, max_new_tokens=20)
    assert torch.equal(out.sequences, greedy_reference(model, ids, 20))
    assert kernels.draft_weights() == "float16"  # restored after every call
    with kernels.using_draft_weights(None):  # a drafter without its own: the process-wide choice, untouched
        assert kernels.draft_weights() == "float16"
    formats = {skinny.packed_format(m.forward._weight) for m in module.linear_layers() if m.in_features % 32 == 0}
    assert formats == {"q4_1"}
    save_pretrained(eagle_draft(model, seed=7, draft_vocab_size=60), tmp_path / "e")
    from_spec = make_drafter(f"eagle:{tmp_path / 'e'}[draft_weights=q8_0]", model)
    assert from_spec.policy.draft_weights == "q8_0"
    with pytest.raises(ValueError, match="draft_weights must be one of float16, float32, q8_0, q4_1"):
        EaglePolicy(draft_weights="q5")


def test_medusa_heads_choose_their_own_draft_weights(built, monkeypatch, tmp_path):
    """``MedusaDrafter(..., draft_weights="q4_1")`` (or ``medusa:DIR[draft_weights=q4_1]``): the heads' draft head
    packs on Q4_1 while the process-wide choice stays float16; lossless; a bad name is refused."""
    from decoding.generate import generate
    from decoding.registry import make_drafter
    from medusa.drafter import MedusaDrafter
    from medusa.heads import MedusaHeads
    from selfspec.testing import greedy_reference, random_prompt, randomize_heads

    monkeypatch.setattr(kernels, "_draft_weights", "float16")
    model = tiny_model("llama", dtype=torch.float32)
    set_linear_backend(model, "skinny")
    heads = randomize_heads(MedusaHeads.for_model(model, num_heads=2, draft_vocab_size=64), scale=0.05)
    drafter = MedusaDrafter(heads, tree=8, draft_weights="q4_1")
    ids = random_prompt(5, seed=5)
    out = generate(model, drafter, ids, max_new_tokens=20)
    assert torch.equal(out.sequences, greedy_reference(model, ids, 20))
    assert kernels.draft_weights() == "float16"  # restored after every call
    assert skinny.packed_format(heads._draft_head.forward._weight) == "q4_1"
    plain = MedusaDrafter(heads, tree=8)  # the process-wide choice: float16 panels again
    assert torch.equal(generate(model, plain, ids, max_new_tokens=20).sequences, out.sequences)
    assert skinny.packed_format(heads._draft_head.forward._weight) == "float16"
    assert not any(key.startswith("_draft_head") for key in heads.state_dict())  # heads used on skinny still save
    heads.save_pretrained(tmp_path / "m")
    assert make_drafter(f"medusa:{tmp_path / 'm'}[draft_weights=q8_0]", model).draft_weights == "q8_0"
    with pytest.raises(ValueError, match="draft_weights must be one of float16, float32, q8_0, q4_1"):
        MedusaDrafter(heads, draft_weights="q5")


def test_a_lock_left_by_a_killed_build_is_cleared_and_a_live_one_is_kept(tmp_path):
    """cpp_extension waits forever on a ``lock`` file whose builder was killed; compile_extension clears it first."""
    import os
    import subprocess
    import sys
    import time

    from selfspec.runtime.skinny import clear_stale_build_lock

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "lock").touch()
    (tmp_path / f"building-{dead.pid}").touch()
    with pytest.warns(UserWarning, match="removed a stale build lock"):
        assert clear_stale_build_lock(tmp_path)
    assert not (tmp_path / "lock").exists() and not list(tmp_path.glob("building-*"))
    (tmp_path / "lock").touch()
    (tmp_path / f"building-{os.getpid()}").touch()  # a build still running (this process)
    assert not clear_stale_build_lock(tmp_path) and (tmp_path / "lock").exists()
    (tmp_path / f"building-{os.getpid()}").unlink()
    assert not clear_stale_build_lock(tmp_path)  # no announcement: a fresh lock may be another tool's build
    old = time.time() - 2 * 3600
    os.utime(tmp_path / "lock", (old, old))
    with pytest.warns(UserWarning):
        assert clear_stale_build_lock(tmp_path)  # ... but not one an hour old
    assert not clear_stale_build_lock(tmp_path)  # nothing to clear
