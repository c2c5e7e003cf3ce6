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
