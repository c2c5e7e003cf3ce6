"""``selfspec cost``: the forward cost curve of this machine, for the linear backend in effect and for stock PyTorch.

Prints, per token count, the median forward ms over 256 cached tokens and its ratio to the 1-token forward (what a
tree of that many nodes costs against a plain step), and the floor of the linear layers on this machine: the longer
of reading every weight once and doing their multiply-adds at the cores' peak rate (both measured first). Where
the floor itself rises with the tokens, the linears are compute-bound and no kernel makes that tree cost what one
token costs. ``--json`` prints one object ``{"cpu", "chosen", "threads", "prefix", "ms": {"1": ..},
"stock_ms": {"1": ..}, "floor_ms": {"1": ..}, "read_gb_s", "gflops", "fma_gflops", "curves": {backend: {"1": ..}},
"wide_tiles", "small_prefetch"}`` (``gflops``: a large GEMM through PyTorch's BLAS; ``fma_gflops``: the multiply-add peak the floor
uses, null where the skinny extension does not build; ``curves``: every backend measured; ``wide_tiles``: the tile
shape 15-16 rows run as on the skinny kernel, null on other backends; ``small_prefetch``: whether its 1-4-row tiles
software-prefetch here, null on other backends). ``--backends stock,onednn,skinny``
measures those side by side as well (interleaved, as everything here).
"""

from __future__ import annotations

import argparse
import json

import torch

from selfspec.bench.cost import cost_curves, cpu_model, linear_floor_ms, machine_limits, streamed_bytes
from selfspec.cli.bench import add_backend_argument
from selfspec.cli.checks import positive_ints
from selfspec.runtime import skinny
from selfspec.runtime.kernels import BACKENDS, packed_formats, set_linear_backend
from selfspec.runtime.models import load_model


def _backends(text: str) -> tuple[str, ...]:
    names = tuple(b.strip() for b in text.split(",") if b.strip())
    unknown = [b for b in names if b not in BACKENDS or b == "auto"]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown backend {unknown[0]!r}: choose from stock, onednn, skinny")
    return names


def _sizes(text: str) -> list[int]:
    return sorted(set(positive_ints("--tokens", "token counts")(text)) | {1})


def register(subparsers) -> None:
    p = subparsers.add_parser("cost", help="forward cost per token count (what a tree costs) on this machine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="alias, hub id or path; tiny:ARCH for a test model")
    p.add_argument("--tokens", type=_sizes, default=_sizes("1,2,4,8,16,24"),
                   help="token counts per forward (1 is always measured: the ratios are to it)")
    p.add_argument("--prefix", type=int, default=256, help="cached tokens before each forward (default 256)")
    p.add_argument("--repeats", type=int, default=12, help="timed rounds; the median is reported (default 12)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--backends", type=_backends, default=(),
                   help="more linear backends to measure beside the chosen one and stock, e.g. onednn,skinny")
    add_backend_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1 or args.prefix < 1:
        raise ValueError("--repeats and --prefix must be at least 1")
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    chosen = set_linear_backend(model, args.linear_backend)
    backends = list(dict.fromkeys([chosen, "stock", *args.backends]))
    curves = cost_curves(model, args.tokens, backends, prefix=args.prefix, repeats=args.repeats)
    limits = machine_limits()
    set_linear_backend(model, chosen)  # the floor counts the bytes the chosen backend streams
    with torch.inference_mode():
        model(torch.zeros(1, 1, dtype=torch.long))  # packs every layer the chosen backend has not run yet
    floor = linear_floor_ms(model, args.tokens, limits)
    result = {"cpu": cpu_model(), "chosen": chosen, "threads": torch.get_num_threads(), "prefix": args.prefix,
              "ms": {str(n): ms for n, ms in curves[chosen].items()},
              "stock_ms": {str(n): ms for n, ms in curves["stock"].items()},
              "floor_ms": {str(n): ms for n, ms in floor.items()},
              "read_gb_s": limits["read_gb_s"], "streamed_mb": streamed_bytes(model) / 1e6,
              "weights": packed_formats(model), "gflops": limits["gflops"], "fma_gflops": limits.get("fma_gflops"),
              "curves": {b: {str(n): ms for n, ms in curves[b].items()} for b in backends},
              "wide_tiles": skinny.wide_tiles() if chosen == "skinny" else None,
              "small_prefetch": skinny.small_prefetch() if chosen == "skinny" else None}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['cpu']}, {result['threads']} threads, {args.prefix} cached tokens; forward ms (ratio to 1 token)")
    print("| tokens | " + " | ".join(f"{b} (chosen)" if b == chosen else b for b in backends) + " | linear floor |")
    print("|---:|" + "---:|" * (len(backends) + 1))
    for n in args.tokens:
        cells = [f"{curves[b][n]:.1f} ({curves[b][n] / curves[b][1]:.2f}x)" for b in backends]
        cells.append(f"{floor[n]:.1f} ({floor[n] / floor[1]:.2f}x)")
        print(f"| {n} | " + " | ".join(cells) + " |")
    rate = (f"the cores' multiply-add peak ({limits['fma_gflops']:.0f} GFLOPS measured; a large GEMM through "
            f"PyTorch: {limits['gflops']:.0f})" if limits.get("fma_gflops")
            else f"a large GEMM's rate ({limits['gflops']:.0f} GFLOPS measured)")
    print(f"linear floor: the longer of reading the linear weights once ({result['streamed_mb']:.0f} MB as stored, "
          f"{limits['read_gb_s']:.0f} GB/s measured) and "
          f"their multiply-adds at {rate}; attention, norms and dispatch come on top")
    print("linear weights streamed as: " + ", ".join(f"{n} {f}" for f, n in result["weights"].items()))
    if result["wide_tiles"] and "float32" in result["weights"]:  # the choice applies to float32 panels only
        print(f"15-16 rows run as {result['wide_tiles']} tiles (rows x weight panels; the faster shape here, "
              "measured once by `auto`)")
    if result["small_prefetch"] is not None:
        print(f"1-4-row tiles {'prefetch' if result['small_prefetch'] else 'leave prefetching to the CPU'} (the "
              "faster here for 1-2-token forwards, measured once by `auto`)")
    return 0
