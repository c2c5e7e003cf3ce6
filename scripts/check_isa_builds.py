"""The skinny extension built for other instruction sets on this CPU, checked against PyTorch: what an AVX2 machine
(or one without F16C) compiles from the same source, exercised here before such a machine runs it.

    python scripts/check_isa_builds.py                                  # AVX2, and AVX2 without F16C
    python scripts/check_isa_builds.py --cflags=-mno-avx512f --cflags="-mno-avx512f -mno-f16c -mno-fma"

For each build: the linear kernel on float32 and float16 panels for 1-25 rows (bias and residual), RMSNorm, rotary
and silu(gate) * up against transformers' / PyTorch's, and the attention kernel against SDPA. The native build is
what the test suite checks; this covers the code paths it does not take here.
"""

from __future__ import annotations

import argparse
import sys

import torch
from kernel_ab import build

from selfspec.runtime import skinny


def check(module) -> None:
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    for rows in range(1, 26):
        weight, bias = torch.randn(70, 45, generator=gen), torch.randn(70, generator=gen)
        x, residual = torch.randn(rows, 45, generator=gen), torch.randn(rows, 70, generator=gen)
        for half in (False, True):
            packed = module.pack(weight, half)
            used = weight.half().float() if half else weight
            torch.testing.assert_close(module.linear(x, packed, 70, bias, residual),
                                       residual + torch.nn.functional.linear(x, used, bias), rtol=1e-5, atol=1e-5)
    x, weight = torch.randn(20, 37, generator=gen) * 3, torch.randn(37, generator=gen)
    expected = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(module.rms_norm(x, weight, 1e-5), expected, rtol=1e-5, atol=1e-5)
    gate, up = torch.randn(7, 37, generator=gen) * 6, torch.randn(7, 37, generator=gen)
    gate[0, :4] = torch.tensor([-200.0, -88.5, 90.0, 300.0])
    expected, got = torch.nn.functional.silu(gate) * up, gate.clone()
    module.silu_mul_(got, up)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-30)
    q = torch.randn(2, 5, 3 * 64, generator=gen)
    angles = torch.rand(1, 5, 32, generator=gen) * 50
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    heads = q.view(2, 5, 3, 64).transpose(1, 2)
    expected, _ = apply_rotary_pos_emb(heads, heads, cos, sin)
    rows = q.reshape(10, -1).clone()
    module.rope_(rows, cos.reshape(-1, 64).contiguous(), sin.reshape(-1, 64).contiguous(), 64)
    torch.testing.assert_close(rows.view(2, 5, 3, 64).transpose(1, 2), expected, rtol=1e-5, atol=1e-5)
    for n in (1, 7, 16):
        query = torch.randn(1, 9, n, 64, generator=gen)
        key, value = torch.randn(1, 3, 40, 64, generator=gen), torch.randn(1, 3, 40, 64, generator=gen)
        mask = torch.ones(1, 1, n, 40, dtype=torch.bool).tril(40 - n)
        expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=0.125,
                                                                    enable_gqa=True).transpose(1, 2)
        torch.testing.assert_close(module.attention(query, key, value, mask, 0.125), expected, rtol=1e-5, atol=1e-5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cflags", action="append", help="extra flags of one build (repeatable)")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    for flags in args.cflags or ["-mno-avx512f", "-mno-avx512f -mno-f16c"]:
        module = build(skinny.SOURCE, flags.split())
        check(module)
        print(f"{flags}: {module.lanes()} lanes, every check passed; FMA peak "
              f"{module.fma_peak_gflops(1_000_000):.0f} GFLOPS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
