"""The ablation runner: the smoke grid writes its CSV and plots; grids expand and fail clearly; the training hook
is called per cell and its heads directory reaches the method."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from selfspec.bench.ablate import expand_grid, load_grid, run_ablation
from selfspec.cli import main

SMOKE = Path(__file__).resolve().parents[2] / "configs" / "ablations" / "smoke.yaml"


def test_smoke_grid_writes_csv_and_plots(tmp_path):
    assert main(["ablate", "--threads", "1", "--grid", str(SMOKE), "--out", str(tmp_path), "--quiet"]) == 0
    rows = list(csv.DictReader((tmp_path / "ablation.csv").open()))
    base, grid = load_grid(SMOKE)
    assert len(rows) == len(expand_grid(base, grid)) == 4
    assert {"cell", *grid, "tokens_per_s", "speedup", "tau", "identical", "total"} <= set(rows[0])
    assert all(r["identical"] == r["total"] for r in rows)  # prompt lookup is lossless
    assert {r["max_new_tokens"] for r in rows} == {"8", "12"}
    for key in grid:
        png = tmp_path / f"plot_{key.replace('.', '_')}.png"
        assert png.read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "cells.json").is_file()


def test_expand_grid_sets_dotted_keys():
    base = {"options": {}, "train": None, "limit": 1}
    cells = expand_grid(base, {"options.tree": [2, 4], "train.lr": [0.1], "limit": [1, 2]})
    assert len(cells) == 4
    assignment, cell = cells[-1]
    assert assignment == {"options.tree": 4, "train.lr": 0.1, "limit": 2}
    assert cell["options"] == {"tree": 4} and cell["train"] == {"lr": 0.1} and cell["limit"] == 2
    assert base == {"options": {}, "train": None, "limit": 1}  # the base is not mutated


@pytest.mark.parametrize("text, match", [
    ("grid: {nonsense: [1]}", "unknown grid key"),
    ("base: {nonsense: 1}", "unknown base keys"),
    ("grid: {limit: 3}", "non-empty list"),
    ("extra: 1", "unknown top-level"),
])
def test_bad_grids_fail_clearly(tmp_path, text, match):
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_grid(path)


def test_train_hook_feeds_the_method(tmp_path, monkeypatch):
    (tmp_path / "fake_recipe.py").write_text(
        "import torch\n"
        "from medusa import MedusaHeads\n"
        "from selfspec.runtime.models import load_model\n"
        "CALLS = []\n"
        "def train(config):\n"
        "    CALLS.append(config)\n"
        "    heads = MedusaHeads.for_model(load_model('tiny:llama')[0], num_heads=config['num_heads'])\n"
        "    out = config['output_dir'] + f\"/heads{config['num_heads']}\"\n"
        "    heads.save_pretrained(out)\n"
        "    return out\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import fake_recipe

    base = {**load_grid(SMOKE)[0], "method": "medusa:{heads}", "options": {"tree": 4}, "max_new_tokens": 6,
            "train": {"entry": "fake_recipe:train", "output_dir": str(tmp_path)}}
    rows = run_ablation(base, {"train.num_heads": [1, 2]}, tmp_path / "out", progress=False)
    assert [c["num_heads"] for c in fake_recipe.CALLS] == [1, 2]
    assert [r["method"] for r in rows] == [f"medusa:{tmp_path}/heads1", f"medusa:{tmp_path}/heads2"]
    assert all(r["identical"] == r["total"] == 2 for r in rows)
    assert (tmp_path / "out" / "plot_train_num_heads.png").is_file()


def test_bad_train_entry(tmp_path):
    base = {**load_grid(SMOKE)[0], "train": {"entry": "no_such_module:train"}}
    with pytest.raises(ValueError, match="cannot be loaded"):
        run_ablation(base, {}, tmp_path, progress=False)


def test_injected_model_loader(tmp_path):
    from selfspec.testing import tiny_model

    loaded = []

    def load(name):
        loaded.append(name)
        return tiny_model("qwen2", dtype=torch.float64), None

    base = {**load_grid(SMOKE)[0], "model": "my-model", "method": "none"}
    rows = run_ablation(base, {"max_new_tokens": [4, 6]}, tmp_path, load=load, progress=False)
    assert loaded == ["my-model"] and len(rows) == 2
    assert all(r["identical"] == r["total"] for r in rows)


@pytest.mark.parametrize("path", sorted(SMOKE.parent.glob("*.yaml")), ids=lambda p: p.name)
def test_every_grid_file_loads(path):
    base, grid = load_grid(path)
    assert expand_grid(base, grid)
    text = path.read_text()
    assert text.startswith("#") and f"selfspec ablate --grid configs/ablations/{path.name}" in text  # launch command
    uncommented = [line for line in text.splitlines() if line.strip() and "#" not in line and not line.endswith(":")]
    assert not uncommented, f"{path.name}: keys without a comment: {uncommented}"
