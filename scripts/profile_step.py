"""Where a decode step's time goes: drafting, the verification forward, acceptance, cache compaction and the
drafter's bookkeeping, per step and in total, for one drafter on real prompts; with ``--ops``, the operators inside
them (torch.profiler), so that "the base forward" can be split into matmuls, attention, norms and the rest.

    python scripts/profile_step.py --draft medusa:heads/smollm2-135m-instruct-medusa --limit 3
    python scripts/profile_step.py --draft none --ops
    python scripts/profile_step.py --draft "medusa:heads/smollm2-135m-instruct-medusa+lookup" --json runs/profile.json

The phases are timed inside ``decoding.generate`` (``GenerationStats``); the prompts are MT-bench questions,
answered after one untimed warm-up generation.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from decoding import generate
from selfspec.bench.methods import DrafterMethod, parse_method
from selfspec.bench.runner import eos_of, load_prompts
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.models import load_model

PHASES = ("draft", "verify", "accept", "compact", "observe")


def _op_table(prof, top: int) -> list[dict]:
    rows = []
    for event in prof.key_averages():
        if event.key.startswith("ProfilerStep") or event.key.startswith("selfspec."):
            continue
        rows.append({"op": event.key, "self_ms": event.self_cpu_time_total / 1e3, "calls": event.count})
    rows.sort(key=lambda r: -r["self_ms"])
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="alias, hub id or local path")
    parser.add_argument("--draft", default="none", help="a drafter spec as in selfspec bench: none, lookup, "
                        "medusa:DIR, early-exit:DIR, medusa:DIR+lookup")
    parser.add_argument("--prompts", default=None, help="Spec-Bench JSONL (default: ../shared/data/mt_bench.jsonl "
                        "if present)")
    parser.add_argument("--limit", type=int, default=3, help="prompts to profile")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--linear-backend", default="auto", choices=("auto", "stock", "onednn", "skinny"))
    parser.add_argument("--ops", action="store_true", help="also profile operators with torch.profiler")
    parser.add_argument("--top", type=int, default=15, help="operators to list with --ops")
    parser.add_argument("--json", default=None, help="write the figures to this file")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    prompts_path = args.prompts
    if prompts_path is None:
        default = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mt_bench.jsonl"
        if not default.is_file():
            parser.error("--prompts FILE.jsonl is required (no ../shared/data/mt_bench.jsonl here)")
        prompts_path = str(default)
    model, tokenizer = load_model(args.model)
    model.eval()
    backend = set_linear_backend(model, args.linear_backend)
    method = parse_method(args.draft)
    if not isinstance(method, DrafterMethod):
        parser.error(f"{args.draft!r} is not a drafter (vanilla and hf-* run transformers' own loop)")
    drafter = method.drafter(model)
    prompts = load_prompts(tokenizer, prompts_path, args.limit, vocab_size=model.config.vocab_size)
    eos = eos_of(model, tokenizer)

    def run(prompt):
        return generate(model, drafter, prompt.input_ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)

    run(prompts[0])  # warm-up: kernels, buffers, packed weights
    totals = dict.fromkeys(("prefill", *PHASES, "total"), 0.0)
    steps = tokens = 0
    for prompt in prompts:
        stats = run(prompt).stats
        steps, tokens = steps + stats.steps, tokens + stats.new_tokens
        for phase in totals:
            totals[phase] += getattr(stats, f"time_{phase}")
    loop = totals["total"] - totals["prefill"]
    other = loop - sum(totals[p] for p in PHASES)
    print(f"{args.draft} on {args.model} ({backend} linears, {args.threads} threads): {len(prompts)} prompts, "
          f"{tokens} tokens in {steps} steps, tau {tokens / max(steps, 1):.2f}, {tokens / totals['total']:.2f} tokens/s")
    print("| phase | ms per step | share of the decode loop |\n|---|---:|---:|")
    for phase in (*PHASES, "other"):
        seconds = other if phase == "other" else totals[phase]
        print(f"| {phase} | {1e3 * seconds / max(steps, 1):.2f} | {100 * seconds / loop:.1f}% |")
    report = {"draft": args.draft, "model": args.model, "backend": backend, "prompts": len(prompts),
              "steps": steps, "tokens": tokens, "seconds": totals, "ms_per_step": {
                  p: 1e3 * (other if p == "other" else totals[p]) / max(steps, 1) for p in (*PHASES, "other")}}

    if args.ops:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            stats = run(prompts[0]).stats
        table = _op_table(prof, args.top)
        print(f"\noperators over one generation ({stats.steps} steps; profiler overhead included), by self time:")
        print("| operator | self ms per step | calls per step |\n|---|---:|---:|")
        for row in table:
            print(f"| {row['op']} | {row['self_ms'] / stats.steps:.2f} | {row['calls'] / stats.steps:.1f} |")
        report["ops_per_step"] = [{**r, "self_ms": r["self_ms"] / stats.steps, "calls": r["calls"] / stats.steps}
                                  for r in table]
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
