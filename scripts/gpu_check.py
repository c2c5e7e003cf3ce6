"""One-shot check on an accelerator: the forward cost curve and a side-by-side benchmark of the drafters.

    python scripts/gpu_check.py --prompts mt_bench.jsonl --first 41 --limit 10 --device cuda --out runs/gpu

1. Cost curve: median forward ms of ``--tokens`` new tokens over ``--prefix`` cached ones (the verification cost of
   a tree of that many nodes), timed with device synchronisation, and its ratio to the 1-token forward.
2. Benchmark: HF greedy ``generate`` (the reference) and ``decoding.generate`` with each ``--methods`` drafter on the
   same prompts, interleaved per prompt after one warm-up each; tokens/s, tau, speedup and whether every output
   is identical to the reference. A method that fails is reported with its error and the others go on.

Prompts are questions ``--first`` .. ``--first + --limit - 1`` (1-based) of a Spec-Bench / MT-bench JSONL file.
Writes ``results.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from pathlib import Path

import torch
import transformers

from decoding import generate
from decoding.registry import make_drafter
from selfspec.bench.cost import cost_curves
from selfspec.bench.runner import first_difference, top2_gaps
from selfspec.runtime.models import load_model
from selfspec.runtime.prompts import encode_prompt, read_prompts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_greedy(model, ids: torch.Tensor, max_new_tokens: int, eos) -> list[int]:
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         eos_token_id=eos, pad_token_id=eos, temperature=None, top_p=None, top_k=None)
    return out[0, ids.shape[1]:].tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--tokens", default="1,2,4,8,16,24,32,64", help="tokens per forward for the cost curve")
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--prompts", required=True, help="Spec-Bench / MT-bench JSONL")
    parser.add_argument("--first", type=int, default=41, help="1-based index of the first question used")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--methods", default="none,lookup,medusa:heads/smollm2-135m-instruct-medusa-seq,"
                        "medusa+lookup:heads/smollm2-135m-instruct-medusa-seq",
                        help="drafter specs NAME[:HEADS_DIR], comma-separated")
    parser.add_argument("--out", default="runs/gpu")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    model, tokenizer = load_model(args.model, dtype=DTYPES[args.dtype], device=device)
    environment = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                   "torch": torch.__version__, "transformers": transformers.__version__, "dtype": args.dtype}
    print(json.dumps(environment), flush=True)

    sizes = [int(n) for n in args.tokens.split(",")]
    curve = cost_curves(model, sizes, prefix=args.prefix, repeats=args.repeats, warmup=3)["stock"]
    print(f"forward ms, {args.prefix} cached tokens (ratio to 1 token):")
    for n, ms in curve.items():
        print(f"  {n:3d} tokens: {ms:7.2f} ms ({ms / curve[sizes[0]]:.2f}x)", flush=True)

    rows = read_prompts(args.prompts, args.first - 1 + args.limit)[args.first - 1:]
    prompts = [encode_prompt(tokenizer, row["prompt"]).to(device) for row in rows]
    eos = tokenizer.eos_token_id
    specs = [s for s in args.methods.split(",") if s]
    drafters, errors = {}, {}
    for spec in specs:
        name, _, heads_dir = spec.partition(":")
        try:
            drafters[spec] = make_drafter(name, model, heads_dir or None)
        except Exception as error:  # report and go on: this is a survey
            errors[spec] = f"{type(error).__name__}: {error}"
    results = {"vanilla": {"tokens": [], "seconds": 0.0, "steps": 0}}
    results.update({spec: {"tokens": [], "seconds": 0.0, "steps": 0} for spec in drafters})

    def run(method: str, ids: torch.Tensor, max_new_tokens: int):
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            if method == "vanilla":
                tokens, steps = hf_greedy(model, ids, max_new_tokens, eos), None
            else:
                out = generate(model, drafters[method], ids, max_new_tokens=max_new_tokens, eos_token_id=eos)
                tokens, steps = out.sequences[0, ids.shape[1]:].tolist(), out.stats.steps
        sync(device)
        return tokens, steps, time.perf_counter() - start

    methods = list(results)
    for method in list(methods):  # warm-up; a method that fails here is dropped with its error
        try:
            run(method, prompts[0], 16)
        except Exception:
            errors[method] = traceback.format_exc(limit=4)
            methods.remove(method)
            results.pop(method)
    for i, ids in enumerate(prompts):
        shift = i % len(methods)
        for method in methods[shift:] + methods[:shift]:
            try:
                tokens, steps, seconds = run(method, ids, args.max_new_tokens)
            except Exception:
                errors[method] = traceback.format_exc(limit=4)
                continue
            entry = results[method]
            entry["tokens"].append(tokens)
            entry["seconds"] += seconds
            entry["steps"] += steps or len(tokens)
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)

    table = []
    for method, entry in results.items():  # vanilla first: the reference of every speedup
        new = sum(len(t) for t in entry["tokens"])
        speed = new / entry["seconds"] if entry["seconds"] else 0.0
        reference = results["vanilla"]
        identical = sum(a == b for a, b in zip(entry["tokens"], reference["tokens"]))
        entry.update(tokens_per_s=speed, tau=new / entry["steps"] if entry["steps"] else None,
                     identical=identical, total=len(reference["tokens"]))
        tau = f"{entry['tau']:.2f}" if entry["tau"] else "-"
        entry["divergences"] = []
        for i, (ours, ref) in enumerate(zip(entry["tokens"], reference["tokens"])):
            pos = first_difference(ours, ref)
            if pos is not None:  # where, and vanilla's top-1 minus top-2 logit there (a near-tie is fp rounding)
                gap = float(top2_gaps(model, prompts[i], ref)[pos]) if pos < len(ref) else None
                entry["divergences"].append({"prompt": i, "position": pos, "lengths": [len(ours), len(ref)],
                                             "gap": gap})
        table.append(f"| {method} | {speed:.1f} | {speed / reference['tokens_per_s']:.2f}x | {tau} | "
                     f"{identical}/{len(reference['tokens'])} |")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {"environment": environment, "cost_curve_ms": curve, "prefix": args.prefix,
               "prompts": f"{args.prompts} questions {args.first}-{args.first + len(prompts) - 1}",
               "max_new_tokens": args.max_new_tokens, "errors": errors,
               "methods": {m: {k: v for k, v in e.items() if k != "tokens"} for m, e in results.items()}}
    (out_dir / "results.json").write_text(json.dumps(summary, indent=2))
    print("| method | tokens/s | speedup | tau | identical |\n|---|---:|---:|---:|---|")
    print("\n".join(table))
    for method, entry in results.items():
        for d in entry["divergences"]:
            print(f"divergence {method}: {d}")
    for method, error in errors.items():
        print(f"ERROR {method}: {error}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
