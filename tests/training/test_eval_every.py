"""``logging.eval_every`` in every recipe: held-out evaluations at those steps land in ``metrics.jsonl`` (the
learning curve) and training resumes in training mode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import eagle.recipe as eagle_recipe
import medusa.recipe as medusa_recipe
from selfspec.testing import repetitive_conversations

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module, config", [(medusa_recipe, "configs/medusa/tiny.yaml"),
                                            (eagle_recipe, "configs/eagle/tiny.yaml")], ids=["medusa", "eagle"])
def test_evaluations_during_training_form_a_learning_curve(tmp_path, module, config):
    data = repetitive_conversations(tmp_path / "d.jsonl", 8)
    module.main(["--config", str(ROOT / config), f"output_dir={tmp_path / 'run'}", f"data.source={data}",
                 "data.eval_samples=2", "optim.epochs=50", "optim.max_steps=5", "logging.eval_every=2"])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    curve = [r for r in records if r.get("eval")]
    assert [r["step"] for r in curve] == [2, 4]
    final = records[-1]
    assert final["step"] == 5 and not final.get("eval")
    # the same metrics as the final evaluation's, at every point of the curve
    assert all(set(r) - {"eval"} == set(final) for r in curve), (curve, final)


def test_plot_metrics_tabulates_and_plots_the_curve(tmp_path, capsys):
    import early_exit.recipe as exit_recipe
    from selfspec.testing import early_exit_overrides, load_script

    exit_recipe.main(["--config", str(ROOT / "configs/early_exit/tiny.yaml"),
                      *early_exit_overrides(tmp_path, "run", **{"optim.max_steps": 6, "logging.eval_every": 2})])
    capsys.readouterr()
    plot = load_script("plot_metrics")
    assert plot.main([str(tmp_path / "run"), "--keys", "top1_agreement"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "| step | top1_agreement |"
    assert [line.split(" | ")[0] for line in lines[2:5]] == ["| 2", "| 4", "| 6"]  # the curve, then the final eval
    assert (tmp_path / "run" / "learning_curve.png").stat().st_size > 1000
    with pytest.raises(SystemExit, match="no metrics.jsonl"):
        plot.main([str(tmp_path / "nowhere")])
