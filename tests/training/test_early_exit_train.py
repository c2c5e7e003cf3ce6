"""The early-exit recipe: configs load, the distillation loss goes down, a resumed run equals an uninterrupted one,
and the saved classifier drafts losslessly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import early_exit.recipe as exit_recipe
from decoding.generate import generate
from decoding.registry import make_drafter
from selfspec import training as T
from selfspec.runtime.models import load_model
from selfspec.testing import early_exit_overrides

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "early_exit" / "tiny.yaml"

@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "early_exit").glob("*.yaml")), ids=lambda p: p.name)
def test_configs_load(path):
    cfg = T.load_config(exit_recipe.EarlyExitRecipeConfig, path)
    assert 1 <= cfg.classifier.exit_layer


def test_nothing_to_train_is_a_clear_error():
    with pytest.raises(ValueError, match="nothing to train"):
        T.load_config(exit_recipe.EarlyExitRecipeConfig, TINY, ["classifier.adapter_layers=0", "classifier.own_norm=false"])


def test_training_smoke_loss_goes_down_and_heads_draft_losslessly(tmp_path):
    result = exit_recipe.main(["--config", str(TINY), *early_exit_overrides(tmp_path, "run", **{"optim.max_steps": 12,
                                                                                   "classifier.draft_vocab_size": 40})])
    losses = [r["loss"] for r in result["history"]]
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0], losses
    heads = tmp_path / "run" / "heads"
    config = json.loads((heads / "config.json").read_text())
    assert config["draft_vocab_size"] == 40 and config["policy"]["max_depth"] == 4
    assert "top1_agreement" in config["metrics"] and "train/early_exit.py" in config["metrics"]["command"]
    model, _ = load_model("tiny:llama", dtype=torch.float32)
    drafter = make_drafter("early-exit", model, str(heads))
    ids = torch.tensor([[2, 40, 41, 42, 43]])
    expected = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(generate(model, drafter, ids, max_new_tokens=20).sequences, expected)


def test_resume_equals_an_uninterrupted_run(tmp_path):
    module = exit_recipe
    module.main(["--config", str(TINY), *early_exit_overrides(tmp_path, "straight", **{"optim.max_steps": 6})])
    module.main(["--config", str(TINY), *early_exit_overrides(tmp_path, "resumed", **{"optim.max_steps": 3})])
    assert T.latest_checkpoint(tmp_path / "resumed").name.endswith("3")
    result = module.main(["--config", str(TINY), "--resume", *early_exit_overrides(tmp_path, "resumed", **{"optim.max_steps": 6})])
    assert [r["step"] for r in result["history"]] == [4, 5, 6]
    straight = load_file(str(tmp_path / "straight" / "heads" / "model.safetensors"))
    resumed = load_file(str(tmp_path / "resumed" / "heads" / "model.safetensors"))
    assert straight.keys() == resumed.keys()
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=0, atol=0)
    changed = load_file(str(tmp_path / "straight" / "heads" / "model.safetensors"))["adapter.0.linear.weight"]
    assert changed.abs().sum() > 0  # the adapter did train (zero init)


def test_attention_adapter_trains_on_full_sequences_and_drafts_losslessly(tmp_path):
    result = exit_recipe.main(["--config", str(TINY), *early_exit_overrides(tmp_path, "attn", **{
        "optim.max_steps": 12, "classifier.adapter": "attention", "classifier.adapter_heads": 2})])
    losses = [r["loss"] for r in result["history"]]
    assert len(losses) == 12 and losses[-1] < 0.8 * losses[0], losses
    heads = tmp_path / "attn" / "heads"
    config = json.loads((heads / "config.json").read_text())
    assert config["adapter"] == "attention" and config["adapter_heads"] == 2
    weights = load_file(str(heads / "model.safetensors"))
    assert weights["attention.o_proj.weight"].abs().sum() > 0  # zero init: the output projection did train
    assert not any(k.startswith("adapter.") for k in weights)
    model, _ = load_model("tiny:llama", dtype=torch.float32)
    drafter = make_drafter("early-exit", model, str(heads))
    assert drafter.hidden_layers == (config["exit_layer"],)
    ids = torch.tensor([[2, 40, 41, 42, 43]])
    expected = model.generate(ids, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert torch.equal(generate(model, drafter, ids, max_new_tokens=20).sequences, expected)


@pytest.mark.parametrize("override, message", [
    ("classifier.adapter=lstm", "unknown adapter kind 'lstm'"),
    ("classifier.adapter=attention classifier.adapter_layers=2", "adapter_layers must be 1"),
    ("method=medusa", "method must be distill or layerskip"),
])
def test_bad_classifier_values_are_clear_errors(override, message):
    with pytest.raises(ValueError, match=message):
        T.load_config(exit_recipe.EarlyExitRecipeConfig, TINY, override.split())


def test_evaluation_during_training_logs_a_learning_curve_and_leaves_training_unchanged(tmp_path):
    steps = {"optim.max_steps": 6}
    exit_recipe.main(["--config", str(TINY), *early_exit_overrides(tmp_path, "plain", **steps)])
    exit_recipe.main(["--config", str(TINY), *early_exit_overrides(tmp_path, "curve", **steps, **{"logging.eval_every": 2})])
    records = [json.loads(line) for line in (tmp_path / "curve" / "metrics.jsonl").read_text().splitlines()]
    curve = [r for r in records if r.get("eval")]
    assert [r["step"] for r in curve] == [2, 4]  # the final evaluation (step 6) is the run's own, as without it
    assert all(0 <= r["top1_agreement"] <= 1 and r["eval_positions"] > 0 for r in curve)
    assert records[-1]["step"] == 6 and "top1_agreement" in records[-1]
    plain = load_file(str(tmp_path / "plain" / "heads" / "model.safetensors"))
    evaluated = load_file(str(tmp_path / "curve" / "heads" / "model.safetensors"))
    for name in plain:  # evaluating switched modes and ran the base, but trained nothing and drew no random numbers
        torch.testing.assert_close(evaluated[name], plain[name], rtol=0, atol=0)


def test_held_out_agreement_ranks_the_draft_vocabulary_as_drafting_does(tmp_path):
    """With a draft vocabulary the loss shapes only its rows; the agreement counts what drafting would propose (the
    best of those rows, mapped back to its id), not a full-vocabulary argmax. Recomputed here independently."""
    argv = ["--config", str(TINY), *early_exit_overrides(tmp_path, "v", **{"optim.max_steps": 8,
                                                                        "classifier.draft_vocab_size": 100})]
    recipe = exit_recipe.EarlyExitRecipe.from_command_line(argv, "test")
    metrics = recipe.run()
    classifier, base = recipe.classifier, recipe.base
    hits = full = total = 0
    with torch.no_grad():
        for example in recipe.eval_examples:
            ids = torch.tensor([example["input_ids"]])
            hidden = base(ids, output_hidden_states=True).hidden_states
            keep = torch.tensor(example["loss_mask"][1:], dtype=torch.bool)
            target = base.get_output_embeddings()(hidden[-1][0, :-1]).argmax(-1)[keep]
            logits, vocab = classifier.draft_logits(hidden[classifier.exit_layer][:, :-1], base)
            hits += int((vocab[logits[0].argmax(-1)][keep] == target).sum())
            full += int((classifier(hidden[classifier.exit_layer][:, :-1], base)[0].argmax(-1)[keep] == target).sum())
            total += int(keep.sum())
    assert metrics["eval_positions"] == total
    assert metrics["top1_agreement"] == pytest.approx(hits / total)
    assert metrics["full_vocab_top1_agreement"] == pytest.approx(full / total)
    assert 0 < hits < full  # the tiny base's argmax often falls outside the 100 most frequent data tokens


def test_init_from_starts_where_a_saved_classifier_stopped(tmp_path):
    """A run started from saved heads begins with exactly their predictions (and their draft vocabulary), and
    goes on learning from there."""
    first = exit_recipe.main(["--config", str(TINY), *early_exit_overrides(
        tmp_path, "first", **{"optim.max_steps": 8, "classifier.draft_vocab_size": 40})])
    saved = tmp_path / "first" / "heads"
    from early_exit import ExitClassifier
    from selfspec.runtime.models import load_model

    base = load_model("tiny:llama")[0]
    calibrated = ExitClassifier.from_pretrained(saved, base)  # a policy chosen for these weights on some machine
    calibrated.config.policy_by_machine = {"x86_64-avx2": {"policy": {"max_depth": 1}}}
    calibrated.save_pretrained(saved, base)
    zero = exit_recipe.main(["--config", str(TINY), *early_exit_overrides(
        tmp_path, "zero", **{"optim.max_steps": 1, "optim.lr": 0.0, "init_from": str(saved)})])
    assert zero["top1_agreement"] == first["top1_agreement"]
    config = json.loads((tmp_path / "zero" / "heads" / "config.json").read_text())
    assert config["policy_by_machine"] == {}  # new weights: recalibrate them
    before, after = (load_file(str(d / "model.safetensors")) for d in (saved, tmp_path / "zero" / "heads"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    more = exit_recipe.main(["--config", str(TINY), *early_exit_overrides(
        tmp_path, "more", **{"optim.max_steps": 8, "init_from": str(saved)})])
    assert more["history"][0]["loss"] < first["history"][0]["loss"]  # starts trained, not from scratch
    with pytest.raises(ValueError, match="set classifier.exit_layer=2"):
        exit_recipe.main(["--config", str(TINY), *early_exit_overrides(
            tmp_path, "bad", **{"optim.max_steps": 1, "init_from": str(saved), "classifier.exit_layer": 1})])
    with pytest.raises(ValueError, match="set heads_dir to another directory"):
        T.load_config(exit_recipe.EarlyExitRecipeConfig, TINY, [f"init_from={saved}", f"heads_dir={saved}"])
    with pytest.raises(ValueError, match="remove init_from"):
        T.load_config(exit_recipe.EarlyExitRecipeConfig, TINY, [f"init_from={saved}", "method=layerskip",
                                                                "classifier.adapter_layers=0"])
