"""Markdown table, per exit layer: top-1 agreement of the exit classifier with the full model (training-free
shared head vs trained), and the resulting tau and tokens/s of early-exit drafting against plain decoding.

    python scripts/exit_layer_table.py --stride 3 --heads heads/smollm2-135m-instruct-early-exit --output runs/exit_layers.md

Agreement is teacher-forced on the model's own greedy continuations of the calibration prompts (exact for the first
draft token: the draft's layer-E state is the full model's own). tau and tokens/s come from ``decoding.generate``
with a chain draft, every method interleaved per prompt so that a busy CPU slows them alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from decoding.generate import generate
from early_exit import DraftPolicy, EarlyExitDrafter, ExitClassifier, new_classifier
from early_exit.estimates import calibration_set, chain_speedup, exit_agreement, relative_cost
from selfspec.runtime.layers import num_decoder_layers
from selfspec.runtime.models import load_model
from selfspec.runtime.prompts import encode_prompt, read_prompts
from selfspec.training.data import BUILTIN_PROMPTS


def encoded_prompts(tokenizer, path: str | None, limit: int) -> list[torch.Tensor]:
    texts = [p["prompt"] for p in read_prompts(path, limit)] if path else BUILTIN_PROMPTS[:limit]
    return [encode_prompt(tokenizer, text) for text in texts]


def timed_runs(model, drafters: dict, prompts: list[torch.Tensor], new_tokens: int, eos) -> dict:
    """name -> {tau, tokens_per_s, equal}: interleaved per prompt; ``equal`` checks the output against plain."""
    seconds = {name: 0.0 for name in drafters}
    tokens = {name: 0 for name in drafters}
    steps = {name: 0 for name in drafters}
    equal = {name: True for name in drafters}
    phases = {name: {"draft_s": 0.0, "verify_s": 0.0} for name in drafters}
    for ids in prompts:
        reference = None
        for name, drafter in drafters.items():
            start = time.perf_counter()
            out = generate(model, drafter, ids, max_new_tokens=new_tokens, eos_token_id=eos)
            seconds[name] += time.perf_counter() - start
            tokens[name] += out.stats.new_tokens
            steps[name] += out.stats.steps
            phases[name]["draft_s"] += out.stats.time_draft
            phases[name]["verify_s"] += out.stats.time_verify
            reference = out.sequences if reference is None else reference
            equal[name] &= torch.equal(out.sequences, reference)
    return {name: {"tau": tokens[name] / max(steps[name], 1), "tokens_per_s": tokens[name] / seconds[name],
                   "equal": equal[name], **phases[name]} for name in drafters}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="base model (or tiny:<arch>)")
    parser.add_argument("--heads", nargs="*", default=[], help="trained classifier directories (any exit layers)")
    parser.add_argument("--stride", type=int, default=3, help="exit layers stride, stride..L-1")
    parser.add_argument("--layers", type=int, nargs="*", help="explicit exit layers (default: by --stride)")
    parser.add_argument("--prompts", help="Spec-Bench style JSONL (default: the built-in calibration prompts)")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-depth", type=int, default=4, help="chain length of the draft")
    parser.add_argument("--no-timing", action="store_true", help="agreement and expected speedup only")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--output", help="write the markdown table (and a .json beside it) here")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    model.eval()
    total = num_decoder_layers(model)
    trained = {c.exit_layer: c for c in (ExitClassifier.from_pretrained(h, model) for h in args.heads)}
    layers = sorted(set(args.layers or range(args.stride, total, args.stride)) | set(trained))
    prompts = encoded_prompts(tokenizer, args.prompts, args.num_prompts)
    calibration = calibration_set(model, prompts, new_tokens=args.new_tokens)
    classifiers = {("shared", e): new_classifier(model, e) for e in layers}
    classifiers.update({("trained", e): c for e, c in trained.items()})
    agreement = exit_agreement(model, calibration, classifiers)

    rows, eos = [], tokenizer.eos_token_id
    for e in layers:
        row = {"exit_layer": e, "cost": relative_cost(model, e), "shared_top1": agreement[("shared", e)],
               "trained_top1": agreement.get(("trained", e))}
        row["expected_speedup"] = chain_speedup(max(row["shared_top1"], row["trained_top1"] or 0), row["cost"],
                                                args.max_depth)[0]
        if not args.no_timing:
            drafters = {"plain": None}
            for kind in ("shared", "trained"):
                if (kind, e) in classifiers:
                    drafters[kind] = EarlyExitDrafter(model, classifiers[(kind, e)], DraftPolicy.chain(args.max_depth))
            # Plain decoding is re-measured beside every layer: on a shared CPU the speed drifts over minutes.
            runs = timed_runs(model, drafters, prompts, args.new_tokens, eos)
            row["plain_tokens_per_s"] = runs.pop("plain")["tokens_per_s"]
            for kind, r in runs.items():
                row.update({f"{kind}_tau": r["tau"], f"{kind}_tokens_per_s": r["tokens_per_s"],
                            f"{kind}_equal": r["equal"], f"{kind}_draft_s": r["draft_s"],
                            f"{kind}_verify_s": r["verify_s"]})
        rows.append(row)
        print(json.dumps(row), flush=True)

    table = markdown(rows, args, total)
    print(table)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(table)
        Path(args.output).with_suffix(".json").write_text(json.dumps(rows, indent=2))
    return 0


def markdown(rows: list[dict], args, total: int) -> str:
    def f(value, spec=".3f"):
        return "-" if value is None else format(value, spec)

    head = (f"Exit layers of {args.model} ({total} layers): chain draft of {args.max_depth}, {args.num_prompts} "
            f"prompts x {args.new_tokens} tokens. Agreement = top-1 equal to the full model's (teacher-forced); draft cost = "
            "one draft token (layers[:E] + full LM head) / one full forward, in weights read.\n\n"
            "| exit layer | draft cost | top-1 shared head | top-1 trained | tau shared | tau trained | "
            "tok/s shared | tok/s trained | tok/s plain |\n|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['exit_layer']} | {f(r['cost'], '.2f')} | {f(r['shared_top1'])} | {f(r['trained_top1'])} | "
             f"{f(r.get('shared_tau'), '.2f')} | {f(r.get('trained_tau'), '.2f')} | "
             f"{f(r.get('shared_tokens_per_s'), '.1f')} | {f(r.get('trained_tokens_per_s'), '.1f')} | "
             f"{f(r.get('plain_tokens_per_s'), '.1f')} |" for r in rows]
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
