"""Ablation grids: every combination of a YAML grid's values is one cell, optionally trained (through a pluggable
hook) and then benchmarked against vanilla; the results go to a CSV and one line plot per varied key.

A grid file has ``base`` (the settings of every cell, keys in ``CELL_DEFAULTS``) and ``grid`` (dotted key ->
list of values; ``options.tree_size`` sets ``options["tree_size"]``). See ``configs/ablations/smoke.yaml``.
"""

from __future__ import annotations

import copy
import csv
import importlib
import itertools
import json
from pathlib import Path
from typing import Any, Callable

import yaml
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from decoding.drafter import SamplingParams
from selfspec.bench.methods import GenSettings, parse_method
from selfspec.bench.runner import BenchRun, eos_of, load_prompts, run_benchmark, summarize
from selfspec.runtime.models import is_test_model, load_model

#: every key a cell understands, with its default
CELL_DEFAULTS: dict[str, Any] = {
    "model": "smollm2-135m-instruct",  # alias, hub id, path or tiny:ARCH
    "prompts": None,  # Spec-Bench JSONL; None = synthetic random ids (tiny models)
    "limit": 4,  # prompts per cell
    "max_new_tokens": 64,
    "temperature": 0.0,  # 0 = greedy; the lossless check only applies to greedy
    "top_k": None,
    "top_p": None,
    "seed": 0,
    "method": "none",  # a method spec as in `selfspec bench --methods`; "{heads}" is replaced by the trained dir
    "options": {},  # keyword options for the drafter's factory
    "warmup_tokens": 16,
    "baseline": "per-cell",  # per-cell: rerun vanilla in every cell; once: reuse it across cells with equal settings
    "train": None,  # None, or {"entry": "module:function", ...}: function(dict) -> heads dir, run before the bench
}
METRICS = ("tokens_per_s", "vanilla_tokens_per_s", "speedup", "tau", "identical", "total", "bugs")


def load_grid(path: str | Path) -> tuple[dict, dict[str, list]]:
    """``(base, grid)`` from a grid YAML file.

    Raises:
        FileNotFoundError: no such file.
        ValueError: unknown keys, or a grid entry that is not a non-empty list.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"grid file {path} does not exist")
    spec = yaml.safe_load(path.read_text()) or {}
    unknown = set(spec) - {"base", "grid"}
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}; expected 'base' and 'grid'")
    base = {**CELL_DEFAULTS, **(spec.get("base") or {})}
    grid = spec.get("grid") or {}
    for key, values in grid.items():
        if key.split(".")[0] not in CELL_DEFAULTS:
            raise ValueError(f"{path}: unknown grid key {key!r}; known: {', '.join(CELL_DEFAULTS)}")
        if not isinstance(values, list) or not values:
            raise ValueError(f"{path}: grid key {key!r} needs a non-empty list of values")
    unknown = set(base) - set(CELL_DEFAULTS)
    if unknown:
        raise ValueError(f"{path}: unknown base keys {sorted(unknown)}; known: {', '.join(CELL_DEFAULTS)}")
    return base, grid


def expand_grid(base: dict, grid: dict[str, list]) -> list[tuple[dict, dict]]:
    """Every ``(assignment, cell)``: the grid values chosen and the full cell settings they give."""
    keys = list(grid)
    cells = []
    for values in itertools.product(*(grid[k] for k in keys)):
        cell = copy.deepcopy(base)
        for key, value in zip(keys, values):
            *parents, leaf = key.split(".")
            target = cell
            for part in parents:
                if target.get(part) is None:
                    target[part] = {}
                target = target[part]
            target[leaf] = value
        cells.append((dict(zip(keys, values)), cell))
    return cells


def run_train_hook(train: dict) -> str | None:
    """Call ``train["entry"]`` (``"module:function"``) with the train settings; it returns the heads dir it wrote.

    Raises:
        ValueError: a missing or malformed entry, or a module or function that does not exist.
    """
    entry = train.get("entry")
    if not entry or ":" not in entry:
        raise ValueError(f"train.entry must be 'module:function', got {entry!r}")
    module_name, function_name = entry.split(":", 1)
    try:
        function: Callable[[dict], str | None] = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"train.entry {entry!r} cannot be loaded: {e}") from None
    return function({k: v for k, v in train.items() if k != "entry"})


class _Inputs:
    """Models, prompts and vanilla references loaded once and shared by the cells that ask for the same ones."""

    def __init__(self, load: Callable[[str], tuple[Any, Any]]):
        self.load, self.models, self.prompts, self.references = load, {}, {}, {}

    def model(self, name: str) -> tuple[Any, Any]:
        if name not in self.models:
            self.models[name] = self.load(name)
        return self.models[name]

    def prompt_list(self, cell: dict) -> list:
        key = (cell["model"], cell["prompts"], cell["limit"], cell["seed"])
        if key not in self.prompts:
            model, tokenizer = self.model(cell["model"])
            self.prompts[key] = load_prompts(tokenizer, cell["prompts"], cell["limit"],
                                             vocab_size=model.config.vocab_size, seed=cell["seed"],
                                             synthetic=is_test_model(cell["model"]))
        return self.prompts[key]


def run_cell(cell: dict, inputs: _Inputs) -> dict:
    """Train (when the cell says so) and benchmark one cell; returns the bench results' ``methods`` part."""
    method_spec = str(cell["method"])
    if cell["train"]:
        method_spec = method_spec.replace("{heads}", str(run_train_hook(cell["train"])))
    model, tokenizer = inputs.model(cell["model"])
    prompts = inputs.prompt_list(cell)
    sampling = SamplingParams(float(cell["temperature"]), cell["top_k"], cell["top_p"])
    settings = GenSettings(int(cell["max_new_tokens"]), eos_of(model, tokenizer), sampling, int(cell["seed"]))
    method = parse_method(method_spec, **(cell["options"] or {}))
    ref_key = (cell["model"], cell["prompts"], cell["limit"], settings)
    reference: BenchRun | None = inputs.references.get(ref_key) if cell["baseline"] == "once" else None
    run = run_benchmark(model, prompts, [method], settings, warmup_tokens=int(cell["warmup_tokens"]),
                        reference=reference, progress=False)
    inputs.references.setdefault(ref_key, run)
    methods = summarize(model, run)
    return {"method": method.name, **methods[method.name], "vanilla": methods["vanilla"]}


def run_ablation(base: dict, grid: dict[str, list], out_dir: str | Path, *,
                 load: Callable[[str], tuple[Any, Any]] = load_model, progress: bool = True) -> list[dict]:
    """Run every cell; write ``ablation.csv``, ``cells.json`` and ``plot_<key>.png`` per varied key into ``out_dir``.
    Returns the CSV rows. ``load`` maps a model name to ``(model, tokenizer)`` (inject a model in tests)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    inputs = _Inputs(load)
    rows, details = [], []
    for index, (assignment, cell) in enumerate(tqdm(expand_grid(base, grid), desc="ablate", disable=not progress)):
        result = run_cell(cell, inputs)
        row = {"cell": index, **{k: _scalar(v) for k, v in assignment.items()}, "method": result["method"],
               "vanilla_tokens_per_s": result["vanilla"]["tokens_per_s"],
               **{m: result[m] for m in METRICS if m != "vanilla_tokens_per_s"}}
        rows.append(row)
        details.append({"cell": index, "assignment": assignment, "settings": cell, "results": result})
    write_csv(rows, out / "ablation.csv")
    (out / "cells.json").write_text(json.dumps(details, indent=2, default=str) + "\n")
    for key in grid:
        if len(grid[key]) > 1:
            plot_key(rows, key, [k for k in grid if k != key], out / f"plot_{key.replace('.', '_')}.png")
    return rows


def _scalar(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else json.dumps(value)


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot_key(rows: list[dict], key: str, other_keys: list[str], path: Path) -> None:
    """Speedup and tau against ``key``: one line per combination of the other varied keys."""
    values = list(dict.fromkeys(r[key] for r in rows))
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
    xs = {v: (v if numeric else i) for i, v in enumerate(values)}
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    axes = fig.subplots(1, 2)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in other_keys), []).append(r)
    for group, members in groups.items():
        label = ", ".join(f"{k}={v}" for k, v in zip(other_keys, group)) or None
        members = sorted(members, key=lambda r: xs[r[key]])
        for ax, metric in zip(axes, ("speedup", "tau")):
            ax.plot([xs[r[key]] for r in members], [r[metric] if r[metric] is not None else float("nan")
                                                    for r in members], marker="o", label=label)
    for ax, metric in zip(axes, ("speedup over vanilla", "tau")):
        ax.set_xlabel(key)
        ax.set_title(metric)
        if not numeric:
            ax.set_xticks(range(len(values)), [str(v) for v in values], rotation=30, ha="right", fontsize=8)
    if other_keys:
        axes[1].legend(fontsize=7)
    fig.savefig(path, dpi=120)
