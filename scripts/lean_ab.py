"""Lean decoder layers (``selfspec.runtime.lean``) against transformers' own, interleaved in one process: whole
forwards of the model on the skinny backend (same linear and attention kernels in both), the layers' ``forward``
switched forward by forward, so that both see the same moment of a VM whose speed drifts.

    python scripts/lean_ab.py --tokens 1,4,8,16

Each forward of ``n`` tokens runs over ``--prefix`` cached tokens with a causal mask and is rolled back after;
medians of ``--repeats`` rounds. The logits of the two are compared first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from selfspec.bench.cost import cpu_model
from selfspec.runtime import cache as kv
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.lean import use_lean_layers
from selfspec.runtime.models import load_model


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", default="1,4,8,16")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = sorted({int(n) for n in args.tokens.split(",")})
    model, _ = load_model(args.model)
    model.eval()
    set_linear_backend(model, "skinny")
    if not use_lean_layers(model):
        sys.exit(f"{args.model}: no decoder layer the lean forward supports")
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, args.prefix + max(sizes)), generator=torch.Generator().manual_seed(0))
    cache = kv.new_cache(model, capacity=args.prefix + max(sizes) + 8)
    model(input_ids=ids[:, :args.prefix], cache=cache, use_cache=True)

    def forward(lean: bool, n: int) -> torch.Tensor:
        use_lean_layers(model, lean)
        mask = torch.ones(1, 1, n, args.prefix + n, dtype=torch.bool).tril(args.prefix) if n > 1 else None
        try:
            return model(input_ids=ids[:, args.prefix:args.prefix + n], cache=cache, use_cache=True,
                         attention_mask=mask).logits
        finally:
            kv.crop(cache, args.prefix)

    for n in sizes:
        a, b = forward(False, n), forward(True, n)
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            sys.exit(f"{n} tokens: the lean layers change an argmax")
        print(f"{n} tokens: logits differ by at most {(a - b).abs().max().item():.1e}", file=sys.stderr)
    times: dict = {}
    for round_ in range(args.repeats + 2):  # two rounds of warm-up
        for n in sizes:
            for lean in ((False, True) if round_ % 2 else (True, False)):
                start = time.perf_counter()
                forward(lean, n)
                if round_ >= 2:
                    times.setdefault((lean, n), []).append((time.perf_counter() - start) * 1e3)
    print(f"forward ms (ratio to {sizes[0]} token), skinny kernels, {cpu_model()}, {args.threads} threads, "
          f"{args.prefix} cached tokens, median of {args.repeats} interleaved rounds")
    print("| decoder layers | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for lean in (False, True):
        median = {n: statistics.median(times[(lean, n)]) for n in sizes}
        cells = " | ".join(f"{median[n]:.1f} ({median[n] / median[sizes[0]]:.2f}x)" for n in sizes)
        print(f"| {'lean (selfspec.runtime.lean)' if lean else 'transformers'} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
