"""Does PyTorch's own compiler flatten the verification cost curve? The forward cost of ``n`` new tokens over a
256-token cache for SmolLM2 (or any model), eager and compiled with torch.compile / Inductor, on transformers'
StaticCache (what HF ``generate`` compiles with).

    python scripts/compile_cost.py --tokens 1,4,8,16 [--variants eager-stock,eager-skinny,inductor,inductor-skinny]
    python scripts/compile_cost.py --variants inductor-autotune --json runs/compile-cost.json

Variants:
  eager-stock      transformers + PyTorch as shipped (MKL linears, sdpa)
  eager-skinny     selfspec's kernels (``--linear-backend skinny``: the skinny GEMM and, for up to 32 queries, the
                   skinny attention kernel)
  inductor         ``torch.compile(model.forward)``, Inductor with ``freezing`` (weights folded and prepacked for
                   oneDNN), one static graph per token count
  inductor-autotune  the same with ``mode="max-autotune"`` (Inductor's C++ GEMM templates are benchmarked against
                   the oneDNN/MKL kernels for every linear shape)
  inductor-skinny  Inductor around selfspec's skinny GEMM, registered as a ``torch.library`` custom op (the compiler
                   fuses everything else: norms, rotary, SiLU, residuals; attention is Inductor's SDPA lowering)

Each variant runs in its own process (compilation state does not leak between them); compile time is reported
beside the curve. Ratios are to the same variant's 1-token forward; ``x stock`` is the 1-token forward against
``eager-stock``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

VARIANTS = ("eager-stock", "eager-skinny", "inductor", "inductor-autotune", "inductor-skinny")


def _skinny_modules(model: nn.Module) -> None:
    """Replace every float32 ``nn.Linear`` by a module calling the skinny kernel through a custom op."""
    from selfspec.runtime import skinny

    @torch.library.custom_op("selfspec_compile_cost::skinny_linear", mutates_args=())
    def skinny_linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] > skinny.MAX_ROWS:  # the prefill: PyTorch's GEMM
            return torch.nn.functional.linear(x, weight, bias)
        return skinny.linear(rows, packed, weight.shape[0], bias).reshape(*x.shape[:-1], weight.shape[0])

    @skinny_linear.register_fake
    def _(x, weight, packed, bias):
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    class SkinnyLinear(nn.Module):
        def __init__(self, linear: nn.Linear):
            super().__init__()
            self.weight, self.bias = linear.weight, linear.bias
            self.register_buffer("packed", skinny.pack(linear.weight.detach()), persistent=False)

        def forward(self, x):
            return skinny_linear(x, self.weight, self.packed, self.bias)

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, SkinnyLinear(child))


def run_variant(variant: str, model_name: str, sizes: list[int], prefix: int, repeats: int) -> dict:
    from transformers import StaticCache

    from selfspec.runtime.kernels import set_linear_backend
    from selfspec.runtime.models import load_model

    model, _ = load_model(model_name)
    if variant == "eager-skinny":
        set_linear_backend(model, "skinny")
    elif variant == "inductor-skinny":
        from selfspec.runtime.attention import use_gqa_sdpa

        _skinny_modules(model)
        use_gqa_sdpa(model)
    vocab = model.get_input_embeddings().num_embeddings
    ids = torch.randint(0, vocab, (1, prefix + max(sizes)), generator=torch.Generator().manual_seed(0))
    forward = model.forward
    if variant.startswith("inductor"):
        import torch._inductor.config as inductor_config

        inductor_config.freezing = True
        torch._dynamo.config.cache_size_limit = max(16, len(sizes) + 4)
        mode = "max-autotune" if variant == "inductor-autotune" else None
        forward = torch.compile(model.forward, dynamic=False, mode=mode)
    cache = StaticCache(config=model.config, max_cache_len=prefix + max(sizes) + 8)

    def rewind(length: int) -> None:
        for layer in cache.layers:
            if getattr(layer, "is_initialized", True) and hasattr(layer, "cumulative_length"):
                layer.cumulative_length.fill_(length)

    ms: dict[str, float] = {}
    compile_s: dict[str, float] = {}
    with torch.no_grad():
        model(input_ids=ids[:, :prefix], cache=cache, use_cache=True)  # eager prefill
        for n in sizes:
            start = time.perf_counter()
            for _ in range(2):  # first call compiles (per shape); the second settles freezing's prepacking
                forward(input_ids=ids[:, prefix:prefix + n], cache=cache, use_cache=True)
                rewind(prefix)
            compile_s[str(n)] = round(time.perf_counter() - start, 1)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for _ in range(repeats):  # sizes interleaved: a slow moment of the machine falls on all of them
            for n in sizes:
                start = time.perf_counter()
                forward(input_ids=ids[:, prefix:prefix + n], cache=cache, use_cache=True)
                times[n].append(time.perf_counter() - start)
                rewind(prefix)
        for n in sizes:
            ms[str(n)] = round(statistics.median(times[n]) * 1e3, 2)
    return {"variant": variant, "ms": ms, "first_calls_s": compile_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", default="1,4,8,16")
    parser.add_argument("--variants", default="eager-stock,eager-skinny,inductor,inductor-skinny")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one variant, print JSON
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = sorted({1, *(int(t) for t in args.tokens.split(","))})
    if args.one:
        print(json.dumps(run_variant(args.one, args.model, sizes, args.prefix, args.repeats)))
        return 0
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    from selfspec.bench.cost import cpu_model

    results = []
    for variant in variants:
        print(f"{variant}: measuring (compiles first where it compiles)...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--one", variant, "--model", args.model, "--tokens",
                              args.tokens, "--prefix", str(args.prefix), "--repeats", str(args.repeats), "--threads",
                              str(args.threads)], capture_output=True, text=True, env=dict(os.environ))
        if out.returncode != 0:
            print(f"{variant} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    report = {"cpu": cpu_model(), "threads": args.threads, "prefix": args.prefix, "torch": torch.__version__,
              "results": results}
    stock = next((r["ms"]["1"] for r in results if r["variant"] == "eager-stock"), None)
    print(f"forward ms (median of {args.repeats}), {report['cpu']}, {args.threads} threads, {args.prefix} cached "
          "tokens, StaticCache; in brackets: ratio to the same variant's 1-token forward")
    print("| variant | " + " | ".join(f"{n} tok" for n in sizes) + " | 1 tok x stock | first calls (s) |")
    print("|---|" + "---:|" * (len(sizes) + 2))
    for r in results:
        one = r["ms"]["1"]
        cells = [f"{r['ms'][str(n)]:.1f} ({r['ms'][str(n)] / one:.2f}x)" for n in sizes]
        vs = f"{one / stock:.2f}" if stock else "-"
        print(f"| {r['variant']} | " + " | ".join(cells) + f" | {vs} | {sum(r['first_calls_s'].values()):.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
