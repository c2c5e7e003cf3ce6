"""``selfspec calibrate --heads DIR``: pick the Medusa tree with the most expected tokens per second on this
machine, save it into the heads' config.json, and compare predicted with measured tau."""

from __future__ import annotations

import argparse

import torch

from ..bench import eos_of, load_model, load_prompts
from ..bench_methods import GenSettings
from ..calibrate import DEFAULT_SIZES, calibrate, check_accuracy, measure_tau, report_dict, save_tree
from .bench import add_common_arguments, apply_backend


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="choose the Medusa tree for this machine from measured latencies",
                              description=__doc__)
    p.add_argument("--heads", required=True, help="Medusa heads directory (its config.json has head_accuracy)")
    add_common_arguments(p)
    p.set_defaults(limit=3)
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="tree sizes (draft nodes) to try")
    p.add_argument("--prefix-length", type=int, default=128, help="KV-cache length during the latency runs")
    p.add_argument("--repeats", type=int, default=7, help="timed forwards per size (median taken)")
    p.add_argument("--overhead-ms", type=float, default=0.0, help="fixed per-step cost added to every t(n)")
    p.add_argument("--fit-linear", action="store_true",
                   help="choose on a straight-line fit of t(n) rather than the raw medians (for a busy machine)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt of the tau check")
    p.add_argument("--no-measure", action="store_true", help="skip the greedy run that measures tau")
    p.add_argument("--dry-run", action="store_true", help="print the choice, write nothing")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from medusa.config import MedusaConfig

    torch.set_num_threads(args.threads)
    config = MedusaConfig.load(args.heads)
    accuracy = check_accuracy(config.head_accuracy, f"{args.heads}/config.json")
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    model, tokenizer = load_model(args.model)
    backend = apply_backend(model, args)
    best, candidates = calibrate(model, accuracy, sizes, heads_dir=args.heads, prefix_length=args.prefix_length,
                                 repeats=args.repeats, overhead_s=args.overhead_ms / 1000,
                                 fit_linear=args.fit_linear, seed=args.seed)
    if best.size == 0:
        print("no tree beats plain decoding on this machine with these heads: saving the empty tree")
    print("nodes | predicted tau | verify ms | draft ms | predicted tokens/s")
    for c in candidates:
        mark = "  <- chosen" if c is best else ""
        print(f"{c.size:5d} | {c.predicted_tau:13.3f} | {c.latency_s * 1000:9.2f} | {c.draft_s * 1000:8.2f} | "
              f"{c.tokens_per_s:8.1f}{mark}")
    measured = None
    if not args.no_measure and (args.prompts or tokenizer is None):
        prompts = load_prompts(tokenizer, args.prompts, args.limit, vocab_size=model.config.vocab_size, seed=args.seed)
        settings = GenSettings(args.max_new_tokens, eos_of(model, tokenizer))
        measured = measure_tau(model, args.heads, best.choices, prompts, settings)
        error = (measured - best.predicted_tau) / best.predicted_tau if measured else float("nan")
        print(f"tree of {best.size} nodes: predicted tau {best.predicted_tau:.3f}, measured {measured:.3f} "
              f"({error:+.1%}) on {len(prompts)} prompts x {args.max_new_tokens} tokens")
    elif not args.no_measure:
        print("no --prompts: tau not measured")
    if not args.dry_run:
        report = report_dict(best, candidates, measured_tau=measured, model=args.model,
                             prefix_length=args.prefix_length, repeats=args.repeats, overhead_ms=args.overhead_ms,
                             fit_linear=args.fit_linear, linear_backend=backend,
                             prompts=args.prompts, limit=args.limit, max_new_tokens=args.max_new_tokens)
        path = save_tree(args.heads, best, report)
        print(f"saved the {best.size}-node tree into {path} (details in calibration.json)")
    return 0
