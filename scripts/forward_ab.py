"""Two ways of running the skinny backend's forward, interleaved in one process: whole forwards of the model with
one part switched forward by forward, so that both sides see the same moment of a VM whose speed drifts.

    python scripts/forward_ab.py --compare attention --tokens 1,2,4,8,12,16,24
    python scripts/forward_ab.py --compare lean --tokens 1,2,4,8,12,16,24
    python scripts/forward_ab.py --compare lean --old-lean 172f0b7   # a revision's lean layers against this one's
    python scripts/forward_ab.py --compare fused --tokens 1,4,8,9,12,16

``--compare attention``: PyTorch's SDPA over the grouped heads (``attention.GQA_SDPA``) against the few-query
attention kernel (``attention.SKINNY_ATTENTION``). ``--compare lean``: transformers' decoder layers against the lean
ones (``selfspec.runtime.lean``); ``--compare fused``: the lean layers as twelve extension calls against one
(``lean.FUSED_LAYERS``; their logits must be bitwise equal); with ``--old-lean REV``, the lean layers of git revision ``REV`` (its
``selfspec/runtime/lean.py``, run on this checkout's kernels) against this checkout's. Every linear is on the skinny kernel on both sides. Each forward of ``n`` tokens
runs over ``--prefix`` cached tokens with a causal mask and is rolled back after; medians of ``--repeats`` rounds.
The logits of the two sides are compared first (argmax equal, largest difference printed).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from selfspec.bench.cost import cpu_model
from selfspec.runtime import cache as kv
from selfspec.runtime import lean
from selfspec.runtime.attention import GQA_SDPA, SKINNY_ATTENTION, use_attention
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.lean import use_lean_layers
from selfspec.runtime.models import load_model

#: what each comparison switches: (label off, label on, switch(model, on))
COMPARISONS = {
    "attention": ("SDPA (GQA_SDPA)", "skinny attention",
                  lambda model, on: use_attention(model, SKINNY_ATTENTION if on else GQA_SDPA)),
    "lean": ("transformers' layers", "lean layers (selfspec.runtime.lean)", use_lean_layers),
    "fused": ("lean layers, twelve calls", "lean layers, one call (skinny.decoder_layer)",
              lambda model, on: setattr(lean, "FUSED_LAYERS", on)),
}


def lean_of_revision(revision: str) -> types.ModuleType:
    """``selfspec/runtime/lean.py`` as of git ``revision``, loaded as a module of its own."""
    root = Path(__file__).resolve().parent.parent
    text = subprocess.run(["git", "-C", str(root), "show", f"{revision}:selfspec/runtime/lean.py"], check=True,
                          capture_output=True, text=True).stdout
    module = types.ModuleType(f"lean_{revision}")
    exec(compile(text, f"{revision}:selfspec/runtime/lean.py", "exec"), module.__dict__)
    module._LEAN = f"{lean._LEAN}_{revision}"  # its own per-layer slot, apart from this checkout's
    return module


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", choices=sorted(COMPARISONS), required=True)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", default="1,2,4,8,12,16,24")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--old-lean", metavar="REV", help="with --compare lean: REV's lean layers, not transformers'")
    args = parser.parse_args(argv)
    if args.old_lean and args.compare != "lean":
        parser.error("--old-lean goes with --compare lean")
    torch.set_num_threads(args.threads)
    sizes = sorted({int(n) for n in args.tokens.split(",")})
    labels = COMPARISONS[args.compare][:2]
    switch = COMPARISONS[args.compare][2]
    if args.old_lean:
        old = lean_of_revision(args.old_lean)
        labels = (f"lean layers of {args.old_lean}", "lean layers (this checkout)")

        def switch(model, on):
            (lean if on else old).use_lean_layers(model, True)
    model, _ = load_model(args.model)
    model.eval()
    set_linear_backend(model, "skinny")
    if args.compare == "lean" and not use_lean_layers(model):
        sys.exit(f"{args.model}: no decoder layer the lean forward supports")
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, args.prefix + max(sizes)), generator=torch.Generator().manual_seed(0))
    cache = kv.new_cache(model, capacity=args.prefix + max(sizes) + 8)
    model(input_ids=ids[:, :args.prefix], cache=cache, use_cache=True)

    def forward(on: bool, n: int) -> torch.Tensor:
        switch(model, on)
        mask = torch.ones(1, 1, n, args.prefix + n, dtype=torch.bool).tril(args.prefix)
        try:
            return model(input_ids=ids[:, args.prefix:args.prefix + n], cache=cache, use_cache=True,
                         attention_mask=mask).logits
        finally:
            kv.crop(cache, args.prefix)

    for n in sizes:
        a, b = forward(False, n), forward(True, n)
        if not torch.equal(a.argmax(-1), b.argmax(-1)):
            sys.exit(f"{n} tokens: the two sides disagree on an argmax")
        if args.compare == "fused" and not torch.equal(a, b):
            sys.exit(f"{n} tokens: the fused layer's logits differ from the twelve-call layer's")
        print(f"{n} tokens: logits differ by at most {(a - b).abs().max().item():.1e}", file=sys.stderr)
    times: dict = {}
    for round_ in range(args.repeats + 2):  # two rounds of warm-up
        for n in sizes:
            for on in ((False, True) if round_ % 2 else (True, False)):
                start = time.perf_counter()
                forward(on, n)
                if round_ >= 2:
                    times.setdefault((on, n), []).append((time.perf_counter() - start) * 1e3)
    print(f"forward ms (ratio to {sizes[0]} token), skinny linears, {cpu_model()}, {args.threads} threads, "
          f"{args.prefix} cached tokens, median of {args.repeats} interleaved rounds")
    print(f"| {args.compare} | " + " | ".join(str(n) for n in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for on, label in ((False, labels[0]), (True, labels[1])):
        median = {n: statistics.median(times[(on, n)]) for n in sizes}
        cells = " | ".join(f"{median[n]:.1f} ({median[n] / median[sizes[0]]:.2f}x)" for n in sizes)
        print(f"| {label} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
