"""Replay drafters on the greedy answers of a prompts file: tau, tree sizes, drafting time, and the speedup this
machine's measured cost curve predicts, in seconds per setting and without one verification forward
(``selfspec.bench.replay``). How the prompt-lookup tree and the datastore were tuned (docs/RESULTS.md):

    python scripts/replay_drafters.py --prompts mt_bench_1-40.jsonl --limit 40 --max-new-tokens 256 --drafters \\
        "lookup max_ngram=3 num_tokens=4 num_candidates=1 nodes=none tokens_per_match=none nodes_per_match=none; \\
         lookup; lookup+datastore:runs/datastore; medusa:heads/smollm2-135m-instruct-medusa-seq+lookup"

Drafters are separated by ``;``: a registry spec (parts joined by ``+`` or ``|``, each ``NAME[:DIR]``), then
``key=value`` options (``datastore.nodes=8`` for a part other than the first). Predicted speedup = tokens / sum over
steps of (forward cost of the step's tree / forward cost of one token + drafting time / one-token forward time). Tune
on prompts you will not report on.
"""

from __future__ import annotations

import argparse
import time

import torch

from decoding import make_drafter
from selfspec.bench.cost import cost_curves, cpu_model
from selfspec.bench.replay import add_hidden, make_references, replay
from selfspec.bench.runner import eos_of, load_prompts
from selfspec.runtime.kernels import set_draft_weights, set_linear_backend
from selfspec.runtime.models import load_model

CURVE_SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def parse_drafters(text: str) -> list[tuple[str, dict[str, str]]]:
    """``"lookup nodes=8; lookup+datastore:DIR"`` -> ``[("lookup", {"nodes": "8"}), ("lookup+datastore:DIR", {})]``.

    Raises:
        ValueError: an option without ``=``, or no drafter at all.
    """
    out = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        spec, *options = item.split()
        bad = [o for o in options if "=" not in o]
        if bad:
            raise ValueError(f"drafter {spec!r}: options are key=value, got {bad[0]!r}")
        out.append((spec, dict(o.split("=", 1) for o in options)))
    if not out:
        raise ValueError("--drafters is empty")
    return out


def relative_cost(curve: dict[int, float], tokens: int) -> float:
    """Forward cost of ``tokens`` tokens over that of one, interpolated on ``curve`` (extended linearly)."""
    sizes = sorted(curve)
    lo = max((s for s in sizes if s <= tokens), default=sizes[0])
    hi = min((s for s in sizes if s >= tokens), default=sizes[-1])
    if lo == hi:
        ms = curve[lo] if tokens <= sizes[-1] else curve[sizes[-1]] * tokens / sizes[-1]
    else:
        ms = curve[lo] + (curve[hi] - curve[lo]) * (tokens - lo) / (hi - lo)
    return ms / curve[sizes[0]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", required=True, help="Spec-Bench/MT-bench JSONL (first turns)")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--drafters", required=True, help="drafter specs with options, separated by ';'")
    parser.add_argument("--linear-backend", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    drafters = parse_drafters(args.drafters)  # a malformed list fails before the model loads
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    model.eval()
    backend = set_linear_backend(model, args.linear_backend)
    set_draft_weights("float16")
    prompts = load_prompts(tokenizer, args.prompts, args.limit, vocab_size=model.config.vocab_size)
    start = time.perf_counter()
    references = make_references(model, [p.input_ids for p in prompts], args.max_new_tokens,
                                 eos_token_id=eos_of(model, tokenizer), layers=(-1,))
    tokens = sum(r.continuation.numel() for r in references)
    print(f"{len(references)} greedy answers, {tokens} tokens, in {time.perf_counter() - start:.0f} s")
    curve = cost_curves(model, CURVE_SIZES, (backend,))[backend]
    print(f"{cpu_model()}, {backend}: forward ms " + ", ".join(f"{n}: {ms:.1f}" for n, ms in curve.items()))
    print("| drafter | tau | mean tree | largest tree | drafting ms/step (replay) | predicted speedup |")
    print("|---|---:|---:|---:|---:|---:|")
    for spec, options in drafters:
        drafter = make_drafter(spec, model, None, **options)
        add_hidden(model, references, tuple(getattr(drafter, "hidden_layers", ())))  # e.g. the feature drafter's
        replay(drafter, references[:1], model)  # warm-up
        start = time.perf_counter()
        result = replay(drafter, references, model)
        draft_steps = (time.perf_counter() - start) * 1e3 / curve[1]  # drafting, in one-token forwards
        cost = sum(relative_cost(curve, n + 1) for n in result.tree_sizes) + draft_steps
        label = spec + "".join(f" {k}={v}" for k, v in options.items())
        print(f"| {label} | {result.tau:.2f} | {result.mean_tree:.1f} | {max(result.tree_sizes, default=0)} | "
              f"{(draft_steps * curve[1]) / max(result.steps, 1):.2f} | {result.tokens / cost:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
