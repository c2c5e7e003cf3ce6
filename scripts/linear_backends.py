"""What one decode forward costs on each linear backend, by the number of tokens in it (1 = a plain step, n = a tree
of n - 1 draft nodes): the shape of this curve decides which trees pay on a machine.

    python scripts/linear_backends.py                       # SmolLM2, stock / onednn / skinny, 1..32 tokens
    python scripts/linear_backends.py --tokens 1,8,16 --backends onednn,skinny --repeats 20

Backends are interleaved within every repetition (a busy moment of the machine hits them all alike) and the median
is reported; every forward runs over the same cached prefix of ``--prefix`` random tokens, with the tree's causal
mask left to the model (the cost of the tree mask itself is part of ``selfspec calibrate``'s figures).
"""

from __future__ import annotations

import argparse

import torch

from selfspec.bench.cost import cost_curves
from selfspec.runtime.models import load_model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="alias, hub id or local path")
    parser.add_argument("--backends", default="stock,onednn,skinny", help="comma-separated linear backends")
    parser.add_argument("--tokens", default="1,2,4,6,8,10,12,16,24,32", help="tokens per forward")
    parser.add_argument("--prefix", type=int, default=256, help="cached tokens before each forward")
    parser.add_argument("--repeats", type=int, default=12, help="timed forwards per backend and size (median)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    backends, sizes = args.backends.split(","), [int(n) for n in args.tokens.split(",")]
    curves = cost_curves(model, sizes, backends, prefix=args.prefix, repeats=args.repeats)
    print(f"forward ms (median of {args.repeats}), {args.threads} threads, prefix {args.prefix}; "
          "in brackets: cost relative to the same backend's 1-token forward")
    print("| tokens | " + " | ".join(backends) + " |")
    print("|---:|" + "---:|" * len(backends))
    for n in sizes:
        cells = [f"{curves[b][n]:.1f} ({curves[b][n] / curves[b][sizes[0]]:.2f}x)" for b in backends]
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
