"""Exact grids (selfspec.runtime.skinny.pack_grid): float32 weights that a Q4_1 or Q8_0 GGUF file was dequantized to
are streamed as that block grid and rebuilt on load, bit for bit. Every output must equal the float32 panels'
exactly, a weight a single bit off the grid must keep float32 panels, and decoding stays lossless."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from selfspec.runtime import skinny
from selfspec.runtime.io import cache_home
from selfspec.runtime.kernels import set_linear_backend
from selfspec.testing import assert_random_trees_decode_losslessly, tiny_model

pytestmark = pytest.mark.xdist_group("skinny")

KINDS = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
GGUF_TYPES = {**KINDS, "q5_0": GGMLQuantizationType.Q5_0, "q4_0": GGMLQuantizationType.Q4_0}


@pytest.fixture(scope="module")
def built():
    assert skinny.available(), f"the skinny kernel did not build here: {skinny.unavailable_reason()}"
    return skinny.extension()


def through_gguf(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight`` quantized and dequantized by gguf-py, the code transformers loads GGUF files with: what a model
    loaded from a ``kind`` file holds."""
    array = weight.detach().float().numpy()
    blocks = gguf_quants.quantize(array, GGUF_TYPES[kind])
    return torch.from_numpy(np.ascontiguousarray(gguf_quants.dequantize(blocks, GGUF_TYPES[kind]))).reshape(weight.shape)


def on_grid(model: torch.nn.Module, kind: str = "q4_1", head: str = "q8_0") -> torch.nn.Module:
    """``model`` with every linear weight replaced by its GGUF round trip (the LM head by ``head``'s)."""
    output = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(through_gguf(module.weight, head if module is output else kind))
    return model


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("out_features,in_features", [(1, 32), (17, 64), (48, 96), (100, 160)])
def test_the_grid_of_a_gguf_weight_is_found_and_rebuilds_every_bit(built, kind, out_features, in_features):
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = through_gguf(torch.randn(out_features, in_features, generator=gen) * 0.05, kind)
    if kind == "q4_1":
        d, m, q = skinny.q4_1_grid(weight)
        assert q.dtype == torch.uint8 and int(q.max()) <= 15
        rebuilt = d.repeat_interleave(32, 1) * q.float() + m.repeat_interleave(32, 1)
        assert torch.equal(m.half().float(), m)
    else:
        assert skinny.q4_1_grid(weight) is None or kind == "q4_1"
        d, q = skinny.q8_0_grid(weight)
        assert q.dtype == torch.int8 and int(q.abs().max()) <= 127
        rebuilt = d.repeat_interleave(32, 1) * q.float()
    assert torch.equal(d.half().float(), d)
    assert torch.equal(rebuilt.view(torch.int32), weight.view(torch.int32))
    found, packed = skinny.pack_grid(weight)
    assert found == kind and skinny.packed_format(packed) == kind


def q4_k_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """A float32 weight as a model loaded from a Q4_K GGUF file holds it (gguf-py, which transformers loads GGUF
    files with, has no Q4_K quantizer, so the blocks are made directly): 256-input super-blocks of random d, dmin,
    6-bit scales and mins and 4-bit levels, dequantized by gguf-py. Every sub-block's lowest level is 0-3 (real
    files hold a 0 in nearly all), and some top out below 15."""
    rng = np.random.default_rng(seed)
    n = out_features * in_features // 256
    raw = np.zeros((n, 144), dtype=np.uint8)
    raw[:, 0:2] = rng.uniform(1e-4, 1e-2, n).astype(np.float16)[:, None].view(np.uint8)  # d
    raw[:, 2:4] = rng.uniform(1e-4, 1e-2, n).astype(np.float16)[:, None].view(np.uint8)  # dmin
    raw[:, 4:16] = rng.integers(0, 256, (n, 12))  # 6-bit scales and mins, packed
    levels = rng.integers(0, 16, (n, 8, 32))
    levels[:, :, 0] = rng.integers(0, 4, (n, 8))
    levels[:, ::3] = np.minimum(levels[:, ::3], 12)
    for j in range(4):  # qs: 32 bytes per 64 inputs, sub-block 2j in the low nibbles, 2j + 1 in the high
        raw[:, 16 + 32 * j:48 + 32 * j] = levels[:, 2 * j] | (levels[:, 2 * j + 1] << 4)
    weight = gguf_quants.dequantize(raw, GGMLQuantizationType.Q4_K)
    return torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)).reshape(out_features, in_features)


def q6_k_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    """As ``q4_k_weight``, for Q6_K: 256-input super-blocks of a float16 d, sixteen signed 8-bit scales (some
    negative, one zero) and 6-bit levels, dequantized by gguf-py (``D * (q - 32)``, D = d * scale, one rounding)."""
    rng = np.random.default_rng(seed)
    n = out_features * in_features // 256
    raw = np.zeros((n, 210), dtype=np.uint8)
    raw[:, :192] = rng.integers(0, 256, (n, 192))  # ql, qh: the levels' low 4 and high 2 bits
    scales = rng.integers(-128, 128, (n, 16)).astype(np.int8)
    scales[0, 3] = 0
    raw[:, 192:208] = scales.view(np.uint8)
    raw[:, 208:210] = rng.uniform(1e-4, 1e-2, n).astype(np.float16)[:, None].view(np.uint8)
    weight = gguf_quants.dequantize(raw, GGMLQuantizationType.Q6_K)
    return torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)).reshape(out_features, in_features)


@pytest.mark.parametrize("kind", ["q5_0", "q4_0", "q4_k", "q6_k"])
def test_the_other_gguf_grids_gemma_uses_are_found_in_the_kernels_two_layouts(built, kind):
    """Gemma 3's Q4_K_M file holds Q5_0, Q4_K, Q8_0 and Q6_K matrices. Q5_0 and Q4_0 are symmetric grids (``d *
    level``, levels -16..15 / -8..7, ``d`` of either sign) and stream in the Q8_0 layout; Q6_K (a 19-bit ``D`` per
    16 inputs, levels -32..31, the product rounded once) in a layout of its own; Q4_K's 32-input
    sub-blocks are ``D * q - M`` with 17-bit ``D`` and ``M`` and stream in the Q4_1 layout with float32 scales. Either
    way every weight is rebuilt bit for bit and the outputs are the float32 panels' exactly."""
    gen = torch.Generator().manual_seed(5)
    if kind == "q4_k":
        weight, layout = q4_k_weight(48, 512, seed=5), "q4_1"
    elif kind == "q6_k":
        weight, layout = q6_k_weight(48, 512, seed=5), "q6_k"
    else:
        array = (torch.randn(48, 512, generator=gen) * 0.05).numpy()
        kind_id = {"q5_0": GGMLQuantizationType.Q5_0, "q4_0": GGMLQuantizationType.Q4_0}[kind]
        weight = torch.from_numpy(np.ascontiguousarray(
            gguf_quants.dequantize(gguf_quants.quantize(array, kind_id), kind_id))).reshape(48, 512)
        # Q4_0's levels -8..7 fit Q4_1's layout too, but not a block whose d < 0 rebuilds -0.0 weights
        layout = "q8_0"
    assert skinny.pack_grid(weight)[0] == layout
    if layout == "q4_1":
        d, m, q = skinny.q4_1_grid(weight)
        rebuilt = d.repeat_interleave(32, 1) * q.float() + m.repeat_interleave(32, 1)
    elif layout == "q6_k":
        d, q = skinny.q6_k_grid(weight)
        rebuilt = d.repeat_interleave(16, 1) * q.float()
    else:
        d, q = skinny.q8_0_grid(weight)
        rebuilt = d.repeat_interleave(32, 1) * q.float()
    assert torch.equal(rebuilt.view(torch.int32), weight.view(torch.int32))
    found, grid = skinny.pack_grid(weight)
    assert found == layout
    panels = skinny.pack(weight)
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17):
        x = torch.randn(rows, 512, generator=gen)
        assert torch.equal(skinny.linear(x, grid, 48, None, None), skinny.linear(x, panels, 48, None, None)), rows
    off = weight.clone()
    off[7, 100] = torch.nextafter(off[7, 100], torch.tensor(1.0))  # one bit off the grid
    assert skinny.pack_grid(off) is None or skinny.pack_grid(off)[0] != layout


def test_weights_off_every_grid_keep_float32_panels(built):
    gen = torch.Generator().manual_seed(1)
    plain = torch.randn(64, 96, generator=gen)
    assert skinny.pack_grid(plain) is None
    assert skinny.packed_format(skinny.pack_exact(plain)) == "float32"
    for kind in KINDS:
        weight = through_gguf(plain, kind)
        assert skinny.pack_grid(weight)[0] == kind
        off = weight.clone()
        off[5, 37] = torch.nextafter(off[5, 37], torch.tensor(1.0))  # one bit off the grid
        assert skinny.pack_grid(off) is None or skinny.pack_grid(off)[0] != kind, kind
    with_zeros = plain.clone()
    with_zeros[0, :32] = 0.0  # a block of zeros is on every grid (d = 0)
    for kind in KINDS:  # a negative zero in a block of zeros: equal to +0.0 as a float, not as bits
        signed = through_gguf(with_zeros, kind)
        assert skinny.pack_grid(signed)[0] == kind
        signed[0, 5] = -0.0
        found = skinny.pack_grid(signed)
        if kind == "q4_1":  # d * q + m rebuilds +0.0 there
            assert found is None or found[0] != kind
        else:  # a zero scale's levels carry the signs (0 * -1 is -0.0, as a file's 0 * q was)
            assert found[0] == kind
            d, q = skinny.q8_0_grid(signed)
            rebuilt = d.repeat_interleave(32, 1) * q.float()
            assert torch.equal(rebuilt.view(torch.int32), signed.view(torch.int32))
            x = torch.randn(3, 96, generator=gen)
            panels = skinny.pack(signed)
            assert torch.equal(skinny.linear(x, found[1], 64, None, None), skinny.linear(x, panels, 64, None, None))
    assert skinny.pack_grid(torch.randn(16, 40, generator=gen)) is None  # inputs not a multiple of 32
    assert skinny.pack_grid(through_gguf(plain, "q4_1").double()) is None


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (37, 96), (130, 64)])
def test_grid_panels_give_the_float32_panels_outputs_bit_for_bit(built, kind, out_features, in_features):
    gen = torch.Generator().manual_seed(out_features + in_features)
    weight = through_gguf(torch.randn(out_features, in_features, generator=gen) * 0.1, kind)
    grid, panels = skinny.pack_grid(weight)[1], skinny.pack(weight)
    bias = torch.randn(out_features, generator=gen)
    for rows in [*range(1, 18), 24, 33]:  # every tile shape of both ISAs and their remainders
        x = torch.randn(rows, in_features, generator=gen)
        residual = torch.randn(rows, out_features, generator=gen)
        for b, r in ((None, None), (bias, None), (bias, residual)):
            fast, reference = skinny.linear(x, grid, out_features, b, r), skinny.linear(x, panels, out_features, b, r)
            assert torch.equal(fast, reference), (rows, (fast - reference).abs().max())
        torch.testing.assert_close(skinny.linear(x, grid, out_features, bias, None), x @ weight.T + bias,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packing", ["float32", "float16", "q4_1", "q8_0", "q4_k", "q6_k"])
def test_every_row_gets_the_bits_it_gets_alone_whatever_the_rows_beside_it(built, packing):
    """What lossless verification rests on: a token's outputs are the same bits in a one-row call (a plain step), in a
    tree's call and in a batch's, for every row count and so every tile shape and remainder. It failed on a Zen 3,
    where GCC's tuning split the one-row tile's multiply-adds into a multiply and an add (two roundings) and kept
    them fused in the others."""
    out_features, in_features = 37, 256  # a partial last panel; 8 grid blocks of K
    gen = torch.Generator().manual_seed(11)
    if packing in ("q4_k", "q6_k"):
        weight = (q4_k_weight if packing == "q4_k" else q6_k_weight)(out_features, in_features, seed=5)
    else:
        weight = torch.randn(out_features, in_features, generator=gen) * 0.1
        if packing in KINDS:
            weight = through_gguf(weight, packing)
    if packing in ("float32", "float16"):
        packed = skinny.pack(weight, half=packing == "float16")
    else:
        found = skinny.pack_grid(weight)
        assert found is not None and found[0] == {"q4_k": "q4_1"}.get(packing, packing)
        packed = found[1]
    x = torch.randn(40, in_features, generator=gen)
    bias, residual = torch.randn(out_features, generator=gen), torch.randn(40, out_features, generator=gen)
    alone = torch.cat([skinny.linear(x[i:i + 1], packed, out_features, bias, residual[i:i + 1]) for i in range(40)])
    for n in range(1, 41):
        together = skinny.linear(x[:n], packed, out_features, bias, residual[:n])
        assert torch.equal(together, alone[:n]), (packing, n, (together - alone[:n]).abs().max())


def test_the_grid_tiles_of_the_other_vector_width_are_bitwise_too(built):
    """On an AVX-512 machine the AVX2 tiles (8 lanes, 16 registers, their own shapes) are built and checked too: they
    are what AVX2-only CPUs run."""
    module = built
    if built.lanes() == 16:
        flags = [*skinny.cflags(), "-mno-avx512f"]
        directory = cache_home() / "kernels" / f"skinny-{skinny.build_key()}-avx2"
        directory.mkdir(parents=True, exist_ok=True)
        module = skinny.compile_extension("selfspec_skinny_linear_avx2", skinny.SOURCE, flags, directory)
    assert module.lanes() == 8
    gen = torch.Generator().manual_seed(3)
    made = {"q4_1": lambda o, i: q4_k_weight(o, i, seed=o), "q6_k": lambda o, i: q6_k_weight(o, i, seed=o)}
    for kind, make in [*((k, None) for k in KINDS), *made.items()]:
        for out_features, in_features in ((16, 256), (37, 256), (130, 512)) if make else ((16, 32), (37, 96), (130, 64)):
            weight = make(out_features, in_features) if make else through_gguf(
                torch.randn(out_features, in_features, generator=gen) * 0.1, kind)
            found, grid = skinny.pack_grid(weight, module)
            panels = module.pack(weight, False)
            assert found == kind
            for rows in [*range(1, 18), 24, 33]:
                x = torch.randn(rows, in_features, generator=gen)
                bias, residual = torch.randn(out_features, generator=gen), torch.randn(rows, out_features, generator=gen)
                assert torch.equal(module.linear(x, grid, out_features, bias, residual),
                                   module.linear(x, panels, out_features, bias, residual)), (kind, rows)


def test_a_grid_weight_that_does_not_fit_the_rows_is_refused_with_its_shapes(built):
    weight = through_gguf(torch.randn(32, 64), "q4_1")
    _, packed = skinny.pack_grid(weight)
    with pytest.raises(RuntimeError, match="grid-packed weight"):
        skinny.linear(torch.randn(2, 96), packed, 32, None, None)


@pytest.mark.parametrize("arch,layers", [("llama", "q4_1"), ("qwen2", "q4_1"), ("gemma", "q5_0")])
def test_a_gguf_model_runs_on_its_grids_bitwise_and_decodes_losslessly(built, arch, layers, monkeypatch):
    base = on_grid(tiny_model(arch, dtype=torch.float32), layers)
    on_panels, on_grids = copy.deepcopy(base), copy.deepcopy(base)
    ids = torch.randint(0, base.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    sizes = (1, 5, 16)
    with torch.inference_mode():
        stock = base(ids).logits
        monkeypatch.setattr(skinny, "EXACT_GRIDS", False)
        set_linear_backend(on_panels, "skinny")
        panels = [on_panels(ids[:, :n]).logits for n in sizes]
        monkeypatch.setattr(skinny, "EXACT_GRIDS", True)
        set_linear_backend(on_grids, "skinny")
        grids = [on_grids(ids[:, :n]).logits for n in sizes]
    formats = {m: skinny.packed_format(m.forward._weight) for m in on_grids.modules() if isinstance(m, torch.nn.Linear)}
    assert set(formats.values()) == ({"q4_1", "q8_0"} if layers == "q4_1" else {"q8_0"})  # Q5_0: in Q8_0's layout
    assert formats[on_grids.get_output_embeddings()] == "q8_0"
    assert {skinny.packed_format(m.forward._weight) for m in on_panels.modules()
            if isinstance(m, torch.nn.Linear)} == {"float32"}
    for a, b in zip(grids, panels):
        assert torch.equal(a, b)
    torch.testing.assert_close(grids[-1], stock[:, :16], rtol=1e-4, atol=1e-4)
    assert_random_trees_decode_losslessly(on_grids)


def test_the_cost_floor_counts_the_bytes_a_grid_streams(built, monkeypatch):
    from selfspec.bench.cost import linear_floor_ms, streamed_bytes

    model = on_grid(tiny_model("llama", dtype=torch.float32))
    dense = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert streamed_bytes(model) == dense  # stock: float32 weights
    monkeypatch.setattr(skinny, "EXACT_GRIDS", True)
    set_linear_backend(model, "skinny")
    with torch.inference_mode():
        model(torch.zeros(1, 1, dtype=torch.long))
    grids = streamed_bytes(model)
    assert dense / 7 < grids < dense / 3  # Q4_1 layers (5.3x fewer bytes), a Q8_0 head (3.6x), panels padded
    limits = {"read_gb_s": 1.0, "gflops": 1e9}
    assert linear_floor_ms(model, [1], limits)[1] == pytest.approx(grids / 1e9 * 1e3)


def test_packed_formats_says_what_each_linear_streams(built, monkeypatch):
    from selfspec.runtime.kernels import packed_formats

    model = on_grid(tiny_model("llama", dtype=torch.float32))
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert packed_formats(model) == {"stock": linears}
    monkeypatch.setattr(skinny, "EXACT_GRIDS", True)
    set_linear_backend(model, "skinny")
    with torch.inference_mode():
        model(torch.zeros(1, 1, dtype=torch.long))
    assert packed_formats(model) == {"q4_1": linears - 1, "q8_0": 1}


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_lossy_grids_round_to_the_nearest_level_and_compute_exactly_what_they_rebuild(kind):
    """``skinny.quantize`` (drafters' layers only) rounds every weight to its block's nearest level, as llama.cpp
    does, and ``pack_quantized`` panels compute exactly what the float32 panels of the rebuilt weight compute."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(37, 96, generator=gen) * 0.05
    weight[3, :32] = 0.0  # an all-zero block
    d, m, q = skinny.quantize(weight, kind)
    rebuilt = skinny.dequantize(d, m, q)
    step = d.float().repeat_interleave(32, dim=1)
    assert (rebuilt - weight).abs().le(step / 2 + 1e-6).all()  # within half a level everywhere
    assert torch.equal(rebuilt[3, :32], torch.zeros(32))
    if kind == "q4_1":
        assert int(q.max()) <= 15 and m is not None
    else:
        assert int(q.abs().max()) <= 127 and m is None
    assert skinny.pack_grid(rebuilt)[0] == kind  # the rebuilt weight lies exactly on that grid
    x = torch.randn(5, 96, generator=gen)
    assert torch.equal(skinny.linear(x, skinny.pack_quantized(weight, kind), 37, None),
                       skinny.linear(x, skinny.pack(rebuilt), 37, None))
    with pytest.raises(ValueError, match="blocks of 32"):
        skinny.quantize(torch.zeros(4, 40), kind)
    with pytest.raises(ValueError, match="unknown grid"):
        skinny.quantize(weight, "q5_0")
