"""``selfspec ablate --grid GRID.yaml``: benchmark (and optionally train) every cell of a grid; CSV + plots."""

from __future__ import annotations

import argparse

import torch

from selfspec.bench.ablate import load_grid, run_ablation


def register(subparsers) -> None:
    p = subparsers.add_parser("ablate", help="run an ablation grid (CSV + one plot per varied key)",
                              description=__doc__)
    p.add_argument("--grid", required=True, help="grid YAML (see configs/ablations/smoke.yaml)")
    p.add_argument("--out", default="runs/ablate", help="output directory (default runs/ablate)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    base, grid = load_grid(args.grid)
    rows = run_ablation(base, grid, args.out, progress=not args.quiet)
    keys = [k for k in rows[0] if k not in ("cell",)]
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.3g}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    print(f"wrote {args.out}/ablation.csv, {args.out}/cells.json and plots")
    return 0
