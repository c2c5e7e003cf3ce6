"""The exit-layer table of issue #19 from a sweep's benchmark (scripts/exit_sweep.sh) and this machine's forward-cost
curve (``selfspec cost --json``): per exit layer E, the draft's cost per token (ms, and as a share of a plain step),
first-token acceptance, tau and speedup as measured, then what the chain would need to reach a target speedup.

    selfspec cost --tokens 1,2,3,4,5,7,9 --json > runs/sweep/cost.json
    python scripts/exit_sweep_report.py runs/sweep/bench/results.json --cost runs/sweep/cost.json --target 1.5

"acceptance needed": the per-token acceptance a chain (best length up to --max-depth) must reach for the target at
that draft cost and this machine's verification curve (``early_exit.estimates.required_acceptance``; "-" when even
perfect acceptance falls short). It is compared with the first-token acceptance measured, which bounds the rest of
the chain from above.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from early_exit.estimates import chain_speedup, required_acceptance


def verify_curve(cost: dict):
    """n -> forward cost of n tokens over a 1-token forward, interpolated linearly between measured sizes."""
    ms = {int(n): v for n, v in cost["ms"].items()}
    sizes = sorted(ms)

    def ratio(n: int) -> float:
        if n in ms:
            return ms[n] / ms[1]
        below = max([s for s in sizes if s < n], default=sizes[0])
        above = min([s for s in sizes if s > n], default=sizes[-1])
        if above == below:
            return ms[above] / ms[1]
        return (ms[below] + (ms[above] - ms[below]) * (n - below) / (above - below)) / ms[1]
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="results.json of the sweep's benchmark")
    parser.add_argument("--cost", required=True, help="selfspec cost --json output on the same machine")
    parser.add_argument("--target", type=float, default=1.5)
    parser.add_argument("--max-depth", type=int, default=6)
    parser.add_argument("--output", help="write the markdown table here too")
    args = parser.parse_args(argv)

    results = json.loads(Path(args.results).read_text())
    cost = json.loads(Path(args.cost).read_text())
    curve = verify_curve(cost)
    methods = results["methods"]
    plain_ms = 1e3 / methods["vanilla"]["tokens_per_s"]
    config = results.get("config", {})
    lines = [f"{config.get('cpu', cost.get('cpu'))}; {config.get('num_prompts')} prompts of {config.get('prompts')} x "
             f"{config.get('max_new_tokens')} tokens; plain step {plain_ms:.1f} ms (vanilla {methods['vanilla']['tokens_per_s']:.2f} "
             f"tokens/s); verification of 5 tokens = {curve(5):.2f}x one token.", "",
             f"| method | draft ms/token | draft cost / plain step | first-token acceptance | tau | speedup | "
             f"acceptance needed for {args.target}x | best speedup at acceptance 1 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = []
    for name, e in methods.items():
        if name == "vanilla":
            continue
        draft_ms, first = e.get("draft_ms_per_token"), e.get("first_token_acceptance")
        d = draft_ms / plain_ms if draft_ms is not None else None
        need = required_acceptance(args.target, d, args.max_depth, curve) if d is not None else None
        ceiling = chain_speedup(1.0, d, args.max_depth, curve)[0] if d is not None else None
        layer = re.search(r"/e(\d+)/", name)
        rows.append((int(layer.group(1)) if layer else 10**6, name))
        fmt = lambda v, spec=".2f": "-" if v is None else format(v, spec)  # noqa: E731
        lines.append(f"| {name} | {fmt(draft_ms)} | {fmt(d)} | {fmt(first)} | {fmt(e['tau'])} | "
                     f"{fmt(e['speedup'])}x | {fmt(need)} | {fmt(ceiling)}x |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.output:
        Path(args.output).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
