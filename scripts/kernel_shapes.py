"""One weight matrix of the model's shapes through a build of the skinny kernel, per row count: hot (the matrix
held in the cores' L2 caches: the compute side) and streamed (as many distinct copies as fill memory beyond the
caches: the forward's real case). The gap between the two says whether a tile shape or prefetch change can help:
when streamed time ~ read time + hot time, reading and computing do not overlap.

    python scripts/kernel_shapes.py                       # this checkout's kernel
    python scripts/kernel_shapes.py --kernel VARIANT.cpp --rows 8,12,14,16
    python scripts/kernel_shapes.py --grid q4_1 --rows 1,8,9,12,16     # weights as a Q4_1 GGUF model holds them

With ``--grid``, each weight is first put through gguf-py's quantize/dequantize round trip (what a model loaded from
such a file holds) and packed as its exact grid (``skinny.pack_grid``); "streamed GB/s" still counts 4 bytes a
weight, the float32 traffic the grid replaces.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernel_ab  # noqa: E402  (the build helper shared with the A/B script)

from selfspec.bench.cost import cpu_model  # noqa: E402
from selfspec.runtime import skinny  # noqa: E402


def pack(grid: str | None, ext, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` packed for ``ext``: float32 panels, or its GGUF round trip's exact ``grid``."""
    if grid is None:
        return ext.pack(weight, False)
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    kind = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}[grid]
    rebuilt = torch.from_numpy(np.ascontiguousarray(quants.dequantize(quants.quantize(weight.numpy(), kind), kind)))
    found = skinny.pack_grid(rebuilt.reshape(weight.shape))
    if found is None or found[0] != grid:
        raise SystemExit(f"the {grid} round trip of a {tuple(weight.shape)} weight is not on its grid")
    return found[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default=str(skinny.SOURCE), help="a .cpp file or git revision of the kernel")
    parser.add_argument("--rows", default="1,4,8,12,14,16")
    parser.add_argument("--shapes", default="1536x576,576x1536", help="OUTxIN matrices (SmolLM2's MLP)")
    parser.add_argument("--copies", type=int, default=60, help="distinct copies streamed for the cold case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grid", choices=("q4_1", "q8_0"), default=None,
                        help="stream the weights as this exact GGUF grid instead of float32 panels")
    parser.add_argument("--wide-tiles", choices=skinny.WIDE_TILES, default="16x1",
                        help="the tile shape for 15-16 rows, where the build has the choice")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ext = kernel_ab.build(kernel_ab.kernel_source(args.kernel), [])
    if hasattr(ext, "set_wide_tiles"):
        ext.set_wide_tiles(skinny.WIDE_TILES.index(args.wide_tiles))
    print(f"{cpu_model()}, {args.threads} threads, kernel {args.kernel}, weights as {args.grid or 'float32'}, "
          f"15-16 rows as {args.wide_tiles}")
    print("| matrix | rows | hot us | hot GFLOPS | streamed us | streamed GB/s | streamed GFLOPS |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        out_features, in_features = (int(v) for v in shape.split("x"))
        hot, *copies = (pack(args.grid, ext, torch.randn(out_features, in_features)) for _ in range(args.copies + 1))
        for n in (int(r) for r in args.rows.split(",")):
            x = torch.randn(n, in_features)
            for _ in range(20):
                ext.linear(x, hot, out_features, None, None)
            rounds = []
            for _ in range(5):
                start = time.perf_counter()
                for _ in range(80):
                    ext.linear(x, hot, out_features, None, None)
                rounds.append((time.perf_counter() - start) / 80)
            hot_s = statistics.median(rounds)
            # one untimed pass first: without it the first row count measured ran 30-40% slow (Xeon model 167,
            # 1536x576 Q4_1: 3 rows 51.7 us first, 36.6 us after 1 and 2 rows), whatever it was
            for packed in copies:
                ext.linear(x, packed, out_features, None, None)
            rounds = []
            for _ in range(3):
                start = time.perf_counter()
                for packed in copies:
                    ext.linear(x, packed, out_features, None, None)
                rounds.append((time.perf_counter() - start) / len(copies))
            cold_s = statistics.median(rounds)
            flops = 2 * n * out_features * in_features
            print(f"| {shape} | {n} | {hot_s * 1e6:.1f} | {flops / hot_s / 1e9:.0f} | {cold_s * 1e6:.1f} | "
                  f"{out_features * in_features * 4 / cold_s / 1e9:.1f} | {flops / cold_s / 1e9:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
