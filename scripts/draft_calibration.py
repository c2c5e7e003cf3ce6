"""Is a feature drafter's confidence what verification accepts? A reliability table (and plot) per draft depth.

EAGLE-2 grows its dynamic tree by path probability (the product of the draft's probabilities from the root) on the
premise that a node's path probability approximates the chance that the base model accepts it. Where that holds,
ranking nodes by it is the right way to spend a verification's node budget, and what limits acceptance is how sharp
the draft's distributions are, not how the tree is chosen. This script decodes prompts greedily with a wide tree
(every grown node kept), and for every proposed node records its path probability and whether the base model's
greedy continuation went through it (the output is the model's own greedy one, so a node is accepted exactly when
its path's tokens are what follows the root in the output).

    python scripts/draft_calibration.py --heads heads/smollm2-135m-instruct-eagle3 --prompts mt_bench_1-40.jsonl \\
        --limit 10 --spread --max-new-tokens 160 --plot runs/draft-calibration.png

Prints, per depth and probability bin, the nodes, their mean path probability and the fraction accepted, and the
share of all accepted nodes each bin holds (what pruning that bin would cost); then the tau each node budget would
buy if verifying it cost nothing (the ceiling a tree size can reach with this drafter, whatever the machine).
``--json`` writes both tables.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from selfspec.bench.cost import cpu_model
from selfspec.cli.generate import parse_options
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.models import load_model
from selfspec.runtime.prompts import encode_prompt, read_prompts

BINS = (0.0, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0 + 1e-9)


Node = tuple[float, int, bool]  # (path probability, depth, accepted)


def record_nodes(model, drafter, input_ids: torch.Tensor, max_new_tokens: int, eos) -> list[list[Node]]:
    """Per proposal while decoding ``input_ids``: ``(path probability, depth, accepted)`` of each proposed node
    (proposals reaching past the end of the output are left out: what follows them is unknown)."""
    from decoding.generate import generate

    proposals = []  # (cache length, tree, path log-probabilities)
    propose = drafter.propose

    def recording(state):
        tree = propose(state)
        if tree is not None and len(tree) and drafter.path_log_probs is not None:
            proposals.append((state.cache_length, tree, list(drafter.path_log_probs)))
        return tree

    drafter.propose = recording
    try:
        out = generate(model, drafter, input_ids, max_new_tokens=max_new_tokens, eos_token_id=eos)
    finally:
        del drafter.propose  # the instance attribute: the class's method again
    sequence = out.sequences[0].tolist()
    steps = []
    for prefix, tree, log_probs in proposals:
        # the root is sequence[prefix]; a node's path is accepted when its tokens are what follows the root
        paths = tree.token_paths
        if prefix + 1 + max(len(path) for path in paths) > len(sequence):
            continue
        steps.append([(math.exp(log_prob), len(path), tuple(sequence[prefix + 1:prefix + 1 + len(path)]) == path)
                      for path, log_prob in zip(paths, log_probs)])
    return steps


def tau_by_budget(steps: list[list[Node]], budgets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)) -> list[dict]:
    """The tau each node budget buys if verification cost nothing: per step, the ``n`` most probable of the recorded
    nodes (EAGLE-2's reranking), realized (what was accepted among them) and predicted (their summed probability)."""
    if not steps:
        raise ValueError("no draft step was recorded: every proposal reached past the end of its output; give more "
                         "--max-new-tokens or more prompts")
    ranked = [sorted(step, key=lambda node: -node[0]) for step in steps]
    rows = []
    for n in budgets:
        if n > max(len(step) for step in ranked):
            break
        rows.append({"nodes": n, "tau": 1 + sum(sum(a for _, _, a in step[:n]) for step in ranked) / len(ranked),
                     "predicted": 1 + sum(sum(p for p, _, _ in step[:n]) for step in ranked) / len(ranked)})
    return rows


def reliability(nodes: list[Node]) -> list[dict]:
    """Per depth and bin of ``BINS``: nodes, mean path probability, fraction accepted, share of all accepted nodes."""
    total_accepted = sum(a for _, _, a in nodes) or 1
    rows = []
    for depth in sorted({d for _, d, _ in nodes}):
        for lo, hi in zip(BINS, BINS[1:]):
            sel = [(p, a) for p, d, a in nodes if d == depth and lo <= p < hi]
            if not sel:
                continue
            accepted = sum(a for _, a in sel)
            rows.append({"depth": depth, "bin": [lo, min(hi, 1.0)], "nodes": len(sel),
                         "mean_prob": sum(p for p, _ in sel) / len(sel), "accepted": accepted / len(sel),
                         "share_of_accepted": accepted / total_accepted})
    return rows


def plot(rows: list[dict], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.5, 5))
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--", label="calibrated")
    for depth in sorted({r["depth"] for r in rows}):
        part = [r for r in rows if r["depth"] == depth and r["nodes"] >= 20]
        ax.plot([r["mean_prob"] for r in part], [r["accepted"] for r in part], marker="o", label=f"depth {depth}")
    ax.set_xlabel("path probability under the draft (bin mean)")
    ax.set_ylabel("fraction accepted by the base model")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", default="heads/smollm2-135m-instruct-eagle3", help="a feature drafter directory")
    parser.add_argument("--model", default=None, help="the base model (default: the drafter's)")
    parser.add_argument("--prompts", required=True, help="a Spec-Bench style JSONL file (tune prompts: MT-bench 1-40)")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--spread", action="store_true", help="take --limit prompts spread over the file")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--tree", default="depth=3 nodes=64 top_k=4 width=4",
                        help="the drafter's options for the recorded trees, KEY=VALUE items (to keep every grown node: "
                             "nodes >= top_k * (1 + width * (depth - 1)))")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", default=None, help="write a reliability plot (PNG) here")
    parser.add_argument("--json", default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import eagle

    options = parse_options(args.tree.split())
    saved = json.loads((Path(args.heads) / "config.json").read_text())
    base = args.model or (saved.get("base_model") or {}).get("name_or_path") or "smollm2-135m-instruct"
    model, tokenizer = load_model(base)
    set_linear_backend(model, "auto")
    drafter = eagle.load(model, args.heads, **options)
    steps = []
    prompts = read_prompts(args.prompts, args.limit, spread=args.spread)
    for i, prompt in enumerate(prompts, 1):
        steps += record_nodes(model, drafter, encode_prompt(tokenizer, prompt["prompt"]), args.max_new_tokens,
                              tokenizer.eos_token_id)
        print(f"\r{i}/{len(prompts)} prompts, {len(steps)} steps", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    rows = reliability([node for step in steps for node in step])
    budgets = tau_by_budget(steps)
    print(f"{cpu_model()}; {args.heads}; {len(prompts)} prompts of {args.prompts} x {args.max_new_tokens} tokens; "
          f"tree {args.tree}")
    print("| depth | path probability | nodes | mean probability | accepted | share of all accepted |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['depth']} | [{r['bin'][0]:.2f}, {r['bin'][1]:.2f}) | {r['nodes']} | {r['mean_prob']:.3f} | "
              f"{r['accepted']:.3f} | {r['share_of_accepted']:.3f} |")
    print(f"\ntau by node budget if verification cost nothing ({len(steps)} steps; the most probable nodes of each):")
    print("| nodes | tau | predicted by the draft's probabilities |")
    print("|---:|---:|---:|")
    for b in budgets:
        print(f"| {b['nodes']} | {b['tau']:.3f} | {b['predicted']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"heads": args.heads, "prompts": args.prompts, "rows": rows,
                                               "tau_by_budget": budgets}, indent=1))
    if args.plot:
        plot(rows, Path(args.plot), f"{Path(args.heads).name}: {len(prompts)} prompts, {cpu_model()}")
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
