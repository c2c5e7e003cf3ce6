"""``selfspec bench``: methods side by side on the same prompts; writes results.json, results.md, results.png."""

from __future__ import annotations

import argparse

import torch

from decoding.drafter import SamplingParams
from selfspec.bench.methods import GenSettings, parse_method, split_methods
from selfspec.bench.report import category_lines, fallback_lines, markdown_table, write_results
from selfspec.bench.runner import environment, eos_of, load_prompts, run_benchmark, summarize
from selfspec.cli.checks import positive_int, positive_ints, probability, temperature
from selfspec.runtime.kernels import (
    BACKENDS,
    DRAFT_WEIGHTS,
    draft_backend,
    draft_weights,
    packed_formats,
    set_draft_weights,
    set_linear_backend,
)
from selfspec.runtime.models import is_test_model, load_model


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Model, prompts and threads: shared by bench and calibrate."""
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="alias, hub id or path; tiny:ARCH for a random tiny model (synthetic prompts)")
    parser.add_argument("--prompts", help="Spec-Bench / MT-bench JSONL file (first turn, chat template)")
    parser.add_argument("--limit", type=positive_int, default=10, help="number of prompts (default 10)")
    parser.add_argument("--spread", action="store_true",
                        help="take the --limit prompts evenly spaced over the file, not the first ones (MT-bench "
                             "lists its categories in blocks of ten)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed for sampling and synthetic prompts")
    add_backend_argument(parser)


def add_backend_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--linear-backend", default="auto", choices=list(BACKENDS),
                        help="kernels for the linear layers (selfspec.runtime.kernels): stock, onednn, or skinny (this "
                             "project's, built for the CPU on first use); auto (default) times each on this machine "
                             "and keeps the fastest")
    parser.add_argument("--draft-weights", default="float16", choices=list(DRAFT_WEIGHTS),
                        help="what drafters' own layers read on the skinny backend: float16 copies of their weights "
                             "(default: half a draft step's memory traffic; drafts only propose, the float32 model "
                             "verifies every token), float32, or their weights rounded to a Q8_0 or Q4_1 block grid "
                             "(fewer bytes still; may change what is accepted, never what is output)")


def apply_backend(model, args: argparse.Namespace) -> str:
    """Put ``model`` on ``--linear-backend`` and say which backend is in effect."""
    backend = set_linear_backend(model, args.linear_backend)
    set_draft_weights(getattr(args, "draft_weights", "float16"))
    weights = ""
    if backend == "skinny":  # one token through the model packs every layer: say what they stream
        with torch.inference_mode():
            model(torch.zeros(1, 1, dtype=torch.long, device=model.device))
        weights = "; weights: " + ", ".join(f"{n} {f}" for f, n in packed_formats(model).items())
    print(f"linear backend: {backend}" + (" (auto)" if args.linear_backend == "auto" else "")
          + f"; attention: {attention_of(model)}; draft weights: "
          + (f"{draft_weights()} (unless a drafter's saved policy names its own)" if draft_backend(backend) != backend
             else f"as the model's ({backend})") + weights,
          flush=True)
    return backend


def attention_of(model) -> str | None:
    """The attention implementation the model runs (the backend's: ``sdpa`` on stock, selfspec's on the others)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark decoding methods against HF greedy generate",
                              description=__doc__ + "\n\nMethods: vanilla, hf-pld[:N], hf-early-exit:E, and every "
                              "registered drafter as NAME[:DIR] (for example medusa:DIR, early-exit:DIR, none). Every method runs on "
                              "--linear-backend; METHOD@stock or METHOD@onednn runs one method on another backend "
                              "(vanilla@stock shows the stock baseline).",
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--methods", default="vanilla,hf-pld,none",
                   help="comma-separated method specs: NAME[:ARG][[key=value,...]], drafters joined by '+' (one "
                        "tree) or '|' (a fallback), then optionally @BACKEND (vanilla@stock) or @DRAFT_WEIGHTS "
                        "(eagle:DIR@q4_1: that method's drafters on those weights)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256)
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy (the lossless check needs greedy)")
    p.add_argument("--top-k", type=positive_int)
    p.add_argument("--top-p", type=probability)
    p.add_argument("--warmup-tokens", type=int, default=16, help="new tokens of each method's untimed warm-up")
    p.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--batch-sizes", type=positive_ints("--batch-sizes", "batch sizes"), default=None,
                   help="benchmark batched decoding instead, e.g. 1,4,16: vanilla (HF generate, left-padded) and "
                        "drafter methods per batch size, each row checked against its batch-1 answer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    specs = split_methods(args.methods)
    methods = [parse_method(s) for s in specs]  # fail on a bad spec before loading anything
    model, tokenizer = load_model(args.model)
    backend = apply_backend(model, args)
    prompts = load_prompts(tokenizer, args.prompts, args.limit, vocab_size=model.config.vocab_size, seed=args.seed,
                           synthetic=is_test_model(args.model), spread=args.spread)
    settings = GenSettings(args.max_new_tokens, eos_of(model, tokenizer),
                           SamplingParams(args.temperature, args.top_k, args.top_p), args.seed)
    if args.batch_sizes:
        return _run_batched(args, model, prompts, specs, settings, backend)
    bench_run = run_benchmark(model, prompts, methods, settings, warmup_tokens=args.warmup_tokens,
                              progress=not args.quiet)
    config = {"model": args.model, "prompts": args.prompts, "limit": args.limit, "spread": args.spread,
              "num_prompts": len(prompts),
              "methods": list(bench_run.generations), **settings.to_dict(),
              "warmup_tokens": args.warmup_tokens, "linear_backend": backend, "attention": attention_of(model),
              "draft_weights": draft_weights(), **environment()}
    results = {"methods": summarize(model, bench_run), "config": config}
    paths = write_results(results, args.out)
    print(markdown_table(results))
    for extra in (category_lines(results), fallback_lines(results)):
        if extra:
            print(extra)
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    bugs = sum(e.get("bugs") or 0 for e in results["methods"].values())
    if bugs:
        print(f"WARNING: {bugs} divergence(s) from vanilla at a top-2 logit gap >= 1e-4: not fp32 rounding, a bug")
    return 0


def _run_batched(args, model, prompts, specs, settings, backend: str) -> int:
    import json
    from pathlib import Path

    from selfspec.bench.batched import batched_table, run_batched

    results = run_batched(model, prompts, specs, args.batch_sizes, settings, progress=not args.quiet)
    results["config"] = {"model": args.model, "prompts": args.prompts, "num_prompts": len(prompts),
                         "methods": specs, **settings.to_dict(), "linear_backend": backend,
                         "attention": attention_of(model), "draft_weights": draft_weights(), **environment()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results-batched.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    table = batched_table(results)
    (out / "results-batched.md").write_text(table)
    print(table)
    print(f"wrote {out / 'results-batched.json'}, {out / 'results-batched.md'}")
    return 0
