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
import statistics
import time

import torch

from selfspec.runtime import cache as kv
from selfspec.runtime.kernels import set_linear_backend
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
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, args.prefix + max(sizes)), generator=torch.Generator().manual_seed(0))
    seconds: dict[tuple[str, int], list[float]] = {(b, n): [] for b in backends for n in sizes}
    with torch.inference_mode():
        cache = kv.new_cache(model, capacity=args.prefix + max(sizes) + 8)
        model(input_ids=ids[:, :args.prefix], cache=cache, use_cache=True)
        for repeat in range(args.repeats + 2):  # the first two are warm-up (packing, page faults)
            for backend in backends:
                set_linear_backend(model, backend)
                for n in sizes:
                    start = time.perf_counter()
                    model(input_ids=ids[:, args.prefix:args.prefix + n], cache=cache, use_cache=True)
                    if repeat >= 2:
                        seconds[(backend, n)].append(time.perf_counter() - start)
                    kv.keep_accepted(cache, args.prefix, [])
    print(f"forward ms (median of {args.repeats}), {args.threads} threads, prefix {args.prefix}; "
          "in brackets: cost relative to the same backend's 1-token forward")
    print("| tokens | " + " | ".join(backends) + " |")
    print("|---:|" + "---:|" * len(backends))
    for n in sizes:
        cells = []
        for backend in backends:
            ms = statistics.median(seconds[(backend, n)]) * 1e3
            base = statistics.median(seconds[(backend, sizes[0])]) * 1e3
            cells.append(f"{ms:.1f} ({ms / base:.2f}x)")
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
