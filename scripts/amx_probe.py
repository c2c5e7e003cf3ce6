"""Probe: AMX for the skinny kernel's exact Q4_1 grid linears (issue 17), against the kernel in this checkout.

    python scripts/amx_probe.py                 # both MLP shapes, rows 1,2,4,8,12,16
    python scripts/amx_probe.py --rows 1,16 --copies 40

Prints, per shape and row count: the AMX integer-digit kernel (``scripts/amx_probe.cpp``; how it computes is
described there) streamed, without its weight stream, without its tiles; the skinny grid kernel; both kernels' largest
error against float64; and whether each of n rows equals the row computed alone (bitwise). Then whether one AMX
TDPBF16PS rounds as a sequential float32 sum or as an exactly rounded one, which decides whether an AVX-512 path
could reproduce it bit for bit (it cannot for the bf16 instruction; the integer digits are exact on any engine).
Needs an x86-64 CPU with AMX-INT8, AMX-BF16 and AVX-512 on Linux; says so and exits where there is none.
"""

from __future__ import annotations

import argparse
import sys
import time
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import kernel_ab  # noqa: E402  (the build helper)

from selfspec.bench.cost import cpu_model  # noqa: E402
from selfspec.runtime import skinny  # noqa: E402

SOURCE = ROOT / "scripts" / "amx_probe.cpp"


def has_amx() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f in flags for f in ("amx_int8", "amx_bf16", "avx512f", "avx512_bf16"))


def q41(out_features: int, in_features: int, seed: int):
    """A random Q4_1 grid (d, m float16; q 0..15 spanning each block, so ``skinny.pack_grid`` finds it)."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(out_features, in_features // 32, generator=g) * 0.01 + 0.001).half()
    m = (-torch.rand(out_features, in_features // 32, generator=g) * 0.05).half()
    q = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.uint8)
    q[:, 0::32], q[:, 1::32] = 0, 15
    return d, m, q, skinny.dequantize(d, m, q)


def pack_amx(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The probe's layout (see amx_probe.cpp): uint8 [panels, blocks, 384]."""
    out_features, in_features = q.shape
    panels, blocks = (out_features + 15) // 16, in_features // 32

    def rows(t, dtype):
        padded = torch.zeros(panels * 16, t.shape[1], dtype=dtype)
        padded[:out_features] = t.to(dtype)
        return padded

    levels = rows(q, torch.uint8).view(panels, 16, blocks, 32)  # [P, c, b, k]
    kk = torch.tensor([[4 * t + (i & 3) for i in range(64)] for t in range(4)])
    cc = torch.tensor([[i >> 2 for i in range(64)] for t in range(4)])
    nibbles = levels[:, cc, :, kk] | (levels[:, cc, :, kk + 16] << 4)  # [4, 64, P, b]
    nibbles = nibbles.permute(2, 3, 0, 1).reshape(panels, blocks, 256)

    def scales(t):
        return rows(t, torch.float32).view(panels, 16, blocks).permute(0, 2, 1).contiguous().view(torch.uint8)

    return torch.cat([scales(d), scales(m), nibbles], -1).contiguous()


def best_us(fn, weights: list, repeats: int = 5) -> float:
    for w in weights[:3]:
        fn(w)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(w)
        times.append((time.perf_counter() - start) / len(weights))
    return min(times) * 1e6


def rounding_check(ext, trials: int = 6) -> None:
    """How one TDPBF16PS rounds: share of outputs equal to a sequential float32 sum and to the exactly rounded sum."""
    f32 = np.float32
    seq_same = exact_same = total = 0
    for seed in range(trials):
        g = torch.Generator().manual_seed(seed)
        spread = (0.0, 2.0, 5.0)[seed % 3]
        a = (torch.randn(16, 32, generator=g) * torch.exp(torch.randn(16, 32, generator=g) * spread)).bfloat16()
        b = torch.randint(-127, 128, (32, 16), generator=g).float().bfloat16()
        c = torch.randn(16, 16, generator=g)
        pairs = b.view(16, 2, 16).permute(0, 2, 1).reshape(16, 32).contiguous()
        hw = ext.tdp_bf16(a.view(torch.int16), pairs.view(torch.int16), c).numpy()
        A, B, C = a.float().numpy(), b.float().numpy(), c.numpy()
        for i in range(16):
            for j in range(16):
                t = f32(C[i, j])
                for k in range(32):
                    t = f32(t + f32(A[i, k] * B[k, j]))
                exact = f32(Fraction(float(C[i, j])) + sum(Fraction(float(A[i, k])) * Fraction(float(B[k, j]))
                                                        for k in range(32)))
                seq_same += int(t == hw[i, j])
                exact_same += int(exact == hw[i, j])
                total += 1
    print(f"TDPBF16PS vs a sequential float32 sum: {seq_same / total:.1%} equal; vs the exactly rounded sum: "
          f"{exact_same / total:.1%} equal ({total} outputs, inputs over 1-5 orders of magnitude)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,12,16")
    parser.add_argument("--copies", type=int, default=30, help="distinct weight copies, streamed from memory")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not has_amx():
        sys.exit("this CPU has no AMX-INT8/AMX-BF16 with AVX-512 (see /proc/cpuinfo): nothing to probe here")
    torch.set_num_threads(args.threads)
    ext = kernel_ab.build(SOURCE, [])
    if not ext.init():
        sys.exit("the kernel refused AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM failed)")
    grid = skinny.extension()
    sizes = [int(r) for r in args.rows.split(",")]
    if max(sizes) > 16:
        sys.exit("--rows: the probe handles at most 16 rows")
    print(f"CPU: {cpu_model()}; {args.threads} threads; {args.copies} copies of each matrix; microseconds per call")
    print("| shape | rows | AMX digits | without weight stream | without tiles | skinny grid | error AMX | error grid "
          "| rows independent |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for out_features, in_features in ((1536, 576), (576, 1536)):
        d, m, q, weight = q41(out_features, in_features, seed=out_features)
        amx_w = pack_amx(d, m, q)
        kind, grid_w = skinny.pack_grid(weight)
        amx_copies = [amx_w.clone() for _ in range(args.copies)]
        grid_copies = [grid_w.clone() for _ in range(args.copies)]
        for n in sizes:
            x = torch.randn(n, in_features)
            ref = x.double() @ weight.double().T
            y_amx, y_grid = ext.linear(x, amx_w, out_features, 0), grid.linear(x, grid_w, out_features, None, None)
            alone = torch.cat([ext.linear(x[i:i + 1], amx_w, out_features, 0) for i in range(n)])
            times = [best_us(lambda w: ext.linear(x, w, out_features, mode), amx_copies) for mode in (0, 1, 2)]
            t_grid = best_us(lambda w: grid.linear(x, w, out_features, None, None), grid_copies)
            err_amx = (y_amx.double() - ref).abs().max().item()
            err_grid = (y_grid.double() - ref).abs().max().item()
            print(f"| {out_features} x {in_features} | {n} | {times[0]:.1f} | {times[1]:.1f} | {times[2]:.1f} | "
                  f"{t_grid:.1f} | {err_amx:.1e} | {err_grid:.1e} | {torch.equal(alone, y_amx)} |")
    rounding_check(ext)


if __name__ == "__main__":
    main()
