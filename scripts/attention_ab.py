"""The skinny backend's two attentions, interleaved in one process: whole forwards of the model with every linear on
the skinny kernel, attention by PyTorch's SDPA over the grouped heads (``attention.GQA_SDPA``) or by the few-query
attention kernel (``attention.SKINNY_ATTENTION``, what ``set_linear_backend("skinny")`` uses), alternating forward by
forward so that both see the same moment of a VM whose speed drifts.

    python scripts/attention_ab.py --tokens 1,2,4,8,12,16,24

Each forward of ``n`` tokens runs over ``--prefix`` cached tokens with a causal mask (a chain: every query sees the
prefix and the tokens before it) and is rolled back after; medians of ``--repeats`` rounds. The logits of the two
are compared first (argmax equal, largest difference printed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from selfspec.bench.cost import cpu_model
from selfspec.runtime import cache as kv
from selfspec.runtime.attention import GQA_SDPA, SKINNY_ATTENTION, use_attention
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.models import load_model

LABELS = {GQA_SDPA: "SDPA (GQA_SDPA)", SKINNY_ATTENTION: "skinny attention"}


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", default="1,2,4,8,12,16,24")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = sorted({int(n) for n in args.tokens.split(",")})
    model, _ = load_model(args.model)
    model.eval()
    set_linear_backend(model, "skinny")
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, args.prefix + max(sizes)), generator=torch.Generator().manual_seed(0))
    cache = kv.new_cache(model, capacity=args.prefix + max(sizes) + 8)
    model(input_ids=ids[:, :args.prefix], cache=cache, use_cache=True)

    def forward(implementation: str, n: int) -> torch.Tensor:
        use_attention(model, implementation)
        mask = torch.ones(1, 1, n, args.prefix + n, dtype=torch.bool).tril(args.prefix)
        try:
            return model(input_ids=ids[:, args.prefix:args.prefix + n], cache=cache, use_cache=True,
                         attention_mask=mask).logits
        finally:
            kv.crop(cache, args.prefix)

    for n in sizes:
        a, b = forward(GQA_SDPA, n), forward(SKINNY_ATTENTION, n)
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            sys.exit(f"{n} tokens: the two attentions disagree on an argmax")
        print(f"{n} tokens: logits differ by at most {(a - b).abs().max().item():.1e}", file=sys.stderr)
    times: dict = {}
    for round_ in range(args.repeats + 2):  # two rounds of warm-up
        order = (GQA_SDPA, SKINNY_ATTENTION) if round_ % 2 else (SKINNY_ATTENTION, GQA_SDPA)
        for n in sizes:
            for implementation in order:
                start = time.perf_counter()
                forward(implementation, n)
                if round_ >= 2:
                    times.setdefault((implementation, n), []).append((time.perf_counter() - start) * 1e3)
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"forward ms (ratio to {sizes[0]} token), skinny linears, {cpu_model()}, {args.threads} threads, {args.prefix} cached "
          f"tokens, median of {args.repeats} interleaved rounds")
    print("| attention | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for implementation in (GQA_SDPA, SKINNY_ATTENTION):
        one = median[(implementation, sizes[0])]
        cells = " | ".join(f"{median[(implementation, n)]:.1f} ({median[(implementation, n)] / one:.2f}x)"
                           for n in sizes)
        print(f"| {LABELS[implementation]} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
