"""``selfspec cost``: the forward cost curve, as a table or one JSON object, for the chosen backend and stock."""

from __future__ import annotations

import json

import pytest
import torch

from selfspec.bench.cost import cost_curves, cpu_model
from selfspec.cli import main
from selfspec.runtime.models import load_model


def test_json_has_the_documented_keys(capsys):
    rc = main(["cost", "--model", "tiny:llama", "--tokens", "2,4", "--repeats", "2", "--prefix", "16", "--threads",
               "1", "--linear-backend", "onednn", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) >= {"cpu", "chosen", "ms", "stock_ms"} and result["cpu"] == cpu_model() != ""
    assert result["chosen"] == "onednn"
    assert result["wide_tiles"] is None and result["small_prefetch"] is None  # skinny-kernel settings: not in effect
    assert set(result["ms"]) == set(result["stock_ms"]) == {"1", "2", "4"}  # 1 is always measured
    assert all(ms > 0 for ms in [*result["ms"].values(), *result["stock_ms"].values()])
    assert set(result["floor_ms"]) == {"1", "2", "4"} and result["read_gb_s"] > 0 and result["gflops"] > 0
    floors = [result["floor_ms"][n] for n in ("1", "2", "4")]
    assert 0 < floors[0] <= floors[1] <= floors[2]


def test_linear_floor_is_the_longer_of_reading_the_weights_and_computing():
    from selfspec.bench.cost import linear_floor_ms

    model, _ = load_model("tiny:llama")  # untied LM head: a Linear like the others
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    limits = {"read_gb_s": 1.0, "gflops": 1.0}  # 1 byte/ns, 1 flop/ns
    floor = linear_floor_ms(model, [1, 3], limits)
    assert floor[1] == pytest.approx(4 * weights / 1e6)  # reading fp32 weights: 4 B each
    assert floor[3] == pytest.approx(6 * weights / 1e6)  # 2 flops per weight per row
    # the cores' multiply-add peak, where measured, is the compute side of the floor (not the BLAS GEMM's rate)
    floor = linear_floor_ms(model, [3], {**limits, "fma_gflops": 3.0})
    assert floor[3] == pytest.approx(4 * weights / 1e6)  # 6 flops per weight at 3 flop/ns: reading is longer now


def test_fma_peak_is_measured_from_registers():
    from selfspec.runtime import skinny

    if not skinny.available():
        pytest.skip(f"the skinny extension does not build here: {skinny.unavailable_reason()}")
    torch.set_num_threads(1)
    one = max(skinny.fma_peak_gflops(200_000) for _ in range(3))
    # at least one vector FMA every two cycles of a 1 GHz core, and no more than 4 a cycle at 6 GHz
    lanes = skinny.extension().lanes()
    assert 2 * lanes * 0.5 <= one <= 2 * lanes * 4 * 6


def test_table_names_the_cpu_and_the_ratios(capsys):
    assert main(["cost", "--model", "tiny:llama", "--tokens", "1,3", "--repeats", "1", "--prefix", "8",
                 "--threads", "1", "--linear-backend", "stock"]) == 0
    out = capsys.readouterr().out
    assert cpu_model() in out and "| 1 | " in out and "(1.00x)" in out and "| 3 | " in out


def test_every_measured_forward_sees_the_same_prefix():
    # The cache is rolled back after each forward: otherwise later sizes would attend over a longer context.
    model, _ = load_model("tiny:llama")
    seen = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["input_ids"].shape[1], kwargs["cache"].get_seq_length())),
        with_kwargs=True)
    try:
        curves = cost_curves(model, [1, 3], ["stock"], prefix=8, repeats=2, warmup=1)
    finally:
        hook.remove()
    assert set(curves["stock"]) == {1, 3}
    assert seen[0] == (8, 0)  # the prefill
    assert seen[1:] == [(1, 8), (3, 8)] * 3  # one warm-up round and two timed ones, always over 8 cached tokens


@pytest.mark.parametrize("tokens", ["0,2", "a,b", ""])
def test_bad_token_counts_are_refused_before_loading(tokens, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["cost", "--model", "no-such-model", "--tokens", tokens])
    assert exit_info.value.code == 2
    assert "--tokens" in capsys.readouterr().err


def test_more_backends_are_measured_side_by_side(capsys):
    rc = main(["cost", "--model", "tiny:llama", "--tokens", "2", "--repeats", "1", "--prefix", "8", "--threads", "1",
               "--linear-backend", "stock", "--backends", "onednn,stock", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["curves"]) == ["stock", "onednn"]  # the chosen one first, each once
    assert set(result["curves"]["onednn"]) == {"1", "2"} and result["curves"]["stock"] == result["stock_ms"]
    assert main(["cost", "--model", "tiny:llama", "--tokens", "2", "--repeats", "1", "--prefix", "8", "--threads",
                 "1", "--linear-backend", "stock", "--backends", "onednn"]) == 0
    assert "| stock (chosen) | onednn | linear floor |" in capsys.readouterr().out


def test_an_unknown_backend_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit):
        main(["cost", "--model", "tiny:llama", "--backends", "mkl"])
    assert "unknown backend 'mkl'" in capsys.readouterr().err


def test_figures_name_the_cpu_by_family_model_and_vector_extensions():
    """A VM often reports only "AMD EPYC" for Zen 3 and Zen 5 alike: the name figures carry adds what tells them apart."""
    from selfspec.bench.cost import describe_cpu

    zen3 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC\n"
            "flags\t\t: fpu sse2 avx fma avx2 bmi2\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n")
    xeon = ("cpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz\n"
            "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert describe_cpu(zen3) == "AMD EPYC (family 25 model 1, AVX2)"  # the first processor's block
    assert describe_cpu(xeon) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz (family 6 model 143, AVX-512, AMX)"
    assert describe_cpu("model name\t: Some CPU\nflags\t: sse2\n") == "Some CPU"
    assert describe_cpu("Features\t: neon\n") is None and cpu_model() != ""
