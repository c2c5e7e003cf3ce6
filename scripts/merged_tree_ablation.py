"""Medusa heads merged with prompt lookup: tokens/s and tau of several tree settings side by side, interleaved per
prompt (rotated order, one untimed warm-up each), against the empty drafter on the same kernels.

    python scripts/merged_tree_ablation.py --heads heads/smollm2-135m-instruct-medusa-seq --start 20 --limit 6

A setting is ``NAME=OPTIONS``, the options as for ``selfspec generate --draft-option`` (``tree`` for the heads,
``lookup.num_tokens`` / ``lookup.num_candidates`` for lookup), joined by commas; settings are separated by ``;``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import decoding
from decoding.registry import make_combined
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.models import load_model
from selfspec.runtime.prompts import encode_prompt

DEFAULT_SETTINGS = ("m4+l4=;m4+l6=lookup.num_tokens=6;m4+l6x2=lookup.num_tokens=6,lookup.num_candidates=2;"
                    "m6+l6=tree=6,lookup.num_tokens=6;m3+l8x2=tree=3,lookup.num_tokens=8,lookup.num_candidates=2;"
                    "m2+l6x2=tree=2,lookup.num_tokens=6,lookup.num_candidates=2")


def parse_settings(text: str) -> dict[str, dict[str, str]]:
    settings = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, options = item.partition("=")
        settings[name] = dict(option.split("=", 1) for option in options.split(",") if option)
    return settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--heads", required=True, help="Medusa heads directory")
    parser.add_argument("--prompts", default=str(Path(__file__).resolve().parents[2] / "shared/data/mt_bench.jsonl"))
    parser.add_argument("--start", type=int, default=20, help="first question (default 20: not the benchmark's)")
    parser.add_argument("--limit", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--settings", default=DEFAULT_SETTINGS)
    parser.add_argument("--linear-backend", default="auto", choices=("auto", "stock", "onednn", "skinny"))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    backend = set_linear_backend(model, args.linear_backend)
    questions = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    prompts = [encode_prompt(tokenizer, q["turns"][0]) for q in questions[args.start:args.start + args.limit]]
    drafters = {"none": None}
    for name, options in parse_settings(args.settings).items():
        drafters[name] = make_combined([("medusa", args.heads), ("lookup", None)], model, options)
    totals = {name: [0.0, 0, 0] for name in drafters}  # seconds, tokens, steps
    names = list(drafters)
    eos = tokenizer.eos_token_id
    for i, input_ids in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            decoding.generate(model, drafters[name], input_ids, max_new_tokens=8, eos_token_id=eos)
            start = time.perf_counter()
            out = decoding.generate(model, drafters[name], input_ids, max_new_tokens=args.max_new_tokens,
                                    eos_token_id=eos)
            totals[name][0] += time.perf_counter() - start
            totals[name][1] += out.stats.new_tokens
            totals[name][2] += out.stats.steps
    base = totals["none"][1] / totals["none"][0]
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens, linear backend {backend}")
    print("| setting | tokens/s | speedup over none | tau |\n|---|---:|---:|---:|")
    for name, (seconds, tokens, steps) in totals.items():
        print(f"| {name} | {tokens / seconds:.2f} | {tokens / seconds / base:.2f}x | {tokens / steps:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
