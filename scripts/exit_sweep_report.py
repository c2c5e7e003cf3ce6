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


#: (name, hidden, intermediate, layers, heads, kv heads, vocab) of public Llama-architecture models
SHAPES = (("SmolLM2-135M", 576, 1536, 30, 9, 3, 49152), ("SmolLM2-360M", 960, 2560, 32, 15, 5, 49152),
          ("SmolLM2-1.7B", 2048, 8192, 24, 32, 32, 49152), ("Llama-2-7B", 4096, 11008, 32, 32, 32, 32000),
          ("Llama-3-8B", 4096, 14336, 32, 32, 8, 128256))


def shapes_table(target: float, max_depth: int, curve, exit_layer: int) -> str:
    """Draft cost of a Kangaroo exit (E layers + a one-layer adapter + an 8,192-row head) over a full forward, in
    weights read (machine-independent; built on the meta device, no memory), and the acceptance it would need."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from early_exit.estimates import relative_cost

    rows = [f"Kangaroo exit at E={exit_layer} (+ one adapter layer, 8,192-row head) on other shapes, cost in weights "
            "read (a lower bound on CPU, where fixed per-layer costs add to a small model's draft):", "",
            f"| model | layers x hidden | draft cost / full forward | acceptance needed for {target}x, flat "
            f"verification | with this machine's curve |", "|---|---|---:|---:|---:|"]
    for name, hidden, inter, layers, heads, kv, vocab in SHAPES:
        config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                             num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab)
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
        d = relative_cost(model, exit_layer + 1, head_rows=8192)
        flat, here = required_acceptance(target, d, max_depth), required_acceptance(target, d, max_depth, curve)
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        rows.append(f"| {name} | {layers} x {hidden} | {d:.3f} | {fmt(flat)} | {fmt(here)} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="results.json of the sweep's benchmark")
    parser.add_argument("--cost", required=True, help="selfspec cost --json output on the same machine")
    parser.add_argument("--target", type=float, default=1.5)
    parser.add_argument("--max-depth", type=int, default=6)
    parser.add_argument("--output", help="write the markdown table here too")
    parser.add_argument("--shapes", action="store_true",
                        help="add the weight-count draft cost of a Kangaroo exit on other public model shapes")
    parser.add_argument("--shape-exit", type=int, default=2, help="exit layer E for --shapes (default 2)")
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
    if args.shapes:
        lines += ["", shapes_table(args.target, args.max_depth, curve, args.shape_exit)]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.output:
        Path(args.output).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
