"""``selfspec train RECIPE`` runs a recipe registered under ``selfspec.recipes``, as the launchers in train/ do."""

from __future__ import annotations

import json
from pathlib import Path

from selfspec.cli import main
from selfspec.cli.train import available_recipes

ROOT = Path(__file__).resolve().parents[2]


def test_recipes_are_registered():
    assert {"medusa", "early-exit"} <= set(available_recipes())


def test_train_command_runs_the_medusa_recipe(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"count to {i}", "response": " ".join(map(str, range(i + 3))) * 2})
                            + "\n" for i in range(8)))
    rc = main(["train", "medusa", "--config", str(ROOT / "configs/medusa/tiny.yaml"), f"output_dir={tmp_path / 'run'}",
               f"heads_dir={tmp_path / 'heads'}", f"data.source={data}", "data.eval_samples=2", "optim.max_steps=2"])
    assert rc == 0
    config = json.loads((tmp_path / "heads" / "config.json").read_text())
    assert config["training"]["metrics"]["steps"] == 2 and "train/medusa.py" in config["training"]["command"]


def test_unknown_recipe_is_a_one_line_error(capsys):
    assert main(["train", "nope", "--config", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'nope'" in err and "medusa" in err
