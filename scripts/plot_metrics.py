"""The learning curve of a training run: its ``metrics.jsonl`` (training losses every ``logging.log_every`` steps,
held-out evaluations every ``logging.eval_every`` steps and at the end) as a markdown table of the evaluations and a
plot of both against the optimizer step.

    python scripts/plot_metrics.py runs/exit-e2-long [--keys top1_agreement] [--out curve.png]

Scalar evaluation metrics are plotted (``--keys`` picks them; default all); list-valued ones (per-depth accuracy)
are plotted one line per entry.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matplotlib.figure import Figure


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """``(training records, evaluation records)`` of ``run/metrics.jsonl``, each ordered by step. An evaluation is
    any record without a training ``loss``; a resumed run's repeated steps keep their last record."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise SystemExit(f"no metrics.jsonl at {path}: pass a training run's output_dir")
    train, evals = {}, {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            (train if "loss" in record else evals)[record["step"]] = record
    return [train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)]


def series(evals: list[dict], keys: list[str] | None) -> dict[str, list[tuple[int, float]]]:
    """name -> [(step, value)] for the scalar (or per-entry list) evaluation metrics."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in evals:
        for key, value in record.items():
            if key in ("step", "eval") or (keys and key not in keys):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not key.startswith("eval_"):
                out.setdefault(key, []).append((record["step"], float(value)))
            elif isinstance(value, list) and all(isinstance(v, (int, float)) for v in value):
                for i, v in enumerate(value):
                    out.setdefault(f"{key}[{i + 1}]", []).append((record["step"], float(v)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a training run's output_dir (or its metrics.jsonl)")
    parser.add_argument("--keys", default=None, help="comma-separated evaluation metrics to show (default: all)")
    parser.add_argument("--out", type=Path, default=None, help="the plot (default: RUN/learning_curve.png)")
    args = parser.parse_args(argv)
    train, evals = read_metrics(args.run)
    curves = series(evals, args.keys.split(",") if args.keys else None)
    if not curves:
        print("no evaluation metrics in this run (set logging.eval_every to record a curve)", file=sys.stderr)
    names = list(curves)
    print("| step | " + " | ".join(names) + " |")
    print("|---:|" + "---:|" * len(names))
    steps = sorted({s for points in curves.values() for s, _ in points})
    for step in steps:
        row = [dict(curves[n]).get(step) for n in names]
        print(f"| {step} | " + " | ".join("" if v is None else f"{v:.4f}" for v in row) + " |")
    figure = Figure(figsize=(10, 4), layout="constrained")
    loss_ax, eval_ax = figure.subplots(1, 2)
    if train:
        loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1)
    loss_ax.set(xlabel="optimizer step", ylabel="training loss", title="training loss")
    for name, points in curves.items():
        eval_ax.plot(*zip(*points), marker="o", ms=3, label=name)
    eval_ax.set(xlabel="optimizer step", title="held-out evaluation")
    if curves:
        eval_ax.legend(fontsize=8)
    out = args.out or (args.run if args.run.is_dir() else args.run.parent) / "learning_curve.png"
    figure.savefig(out, dpi=120)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
