"""Bad command-line input ends in one line that names the input and the fix, exit code 2, no traceback, and before
any model is loaded (the model named here does not exist: reaching the loader would fail differently)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfspec.cli import main

NO_MODEL = ["--model", "no-such-model-anywhere"]
GENERATE = ["generate", "--prompt", "hi", *NO_MODEL]
BENCH = ["bench", *NO_MODEL, "--methods", "vanilla"]

PROBES = [
    (GENERATE + ["--temperature", "-1"], "--temperature: must be >= 0"),
    (GENERATE + ["--temperature", "nan"], "--temperature: expected a finite number"),
    (GENERATE + ["--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    (GENERATE + ["--top-p", "0"], "--top-p: must be in (0, 1]"),
    (GENERATE + ["--top-k", "0"], "--top-k: must be at least 1"),
    (GENERATE + ["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (GENERATE + ["--max-new-tokens", "ten"], "--max-new-tokens: expected an integer, got 'ten'"),
    (GENERATE + ["--threads", "0"], "--threads: must be at least 1"),
    (GENERATE + ["--batch-size", "0"], "--batch-size: must be at least 1"),
    (["generate", "--prompts", "p.jsonl", "--limit", "-3", *NO_MODEL], "--limit: must be at least 1"),
    (GENERATE + ["--draft", "medusa+nope"], "unknown drafter 'nope'"),
    (GENERATE + ["--heads", "some/heads"], "--heads some/heads is given but no drafter: add --draft medusa"),
    (GENERATE + ["--draft", "medusa", "--heads", "h", "--draft-option", "tree=[[0],[0,0"],
     "--draft-option tree: cannot read '[[0],[0,0'"),
    (GENERATE + ["--draft", "lookup", "--draft-option", "num_tokens"], "--draft-option expects key=value"),
    (BENCH + ["--temperature", "-0.5"], "--temperature: must be >= 0"),
    (BENCH + ["--top-p", "2"], "--top-p: must be in (0, 1]"),
    (BENCH + ["--limit", "0"], "--limit: must be at least 1"),
    (BENCH + ["--max-new-tokens", "-1"], "--max-new-tokens: must be at least 1"),
    (["cost", *NO_MODEL, "--tokens", "0"], "--tokens"),
    (["cost", *NO_MODEL, "--tokens", "1,x"], "--tokens takes comma-separated integers, got '1,x'"),
    (BENCH[:-1] + ["vanilla@nope"], "unknown linear backend or draft weights 'nope' after '@'"),
    (BENCH[:-1] + ["bogus"], "unknown method 'bogus'; available:"),
    (["export", "--format", "bogus", "--heads", "h", "--out", "o"], "invalid choice: 'bogus'"),
    (["ablate", "--config", "missing.yaml"], "the following arguments are required: --grid"),
    (["train", "nope", "--config", "x.yaml"], "unknown recipe 'nope'; available:"),
    (["train", "medusa", "--config", "no/such/config.yaml"], "config file no/such/config.yaml does not exist"),
]

# Recipe configs are checked (types, ranges, keys) before the base model is loaded or any data is written.
TINY_MEDUSA = ["train", "medusa", "--config", str(Path(__file__).resolve().parents[2] / "configs/medusa/tiny.yaml")]
TINY_LAYERSKIP = ["train", "early-exit", "--config",
                  str(Path(__file__).resolve().parents[2] / "configs/early_exit/tiny-layerskip.yaml")]
PROBES += [
    (TINY_MEDUSA + ["optim.lr=abc"], "config key optim.lr: expected a number, got 'abc'"),
    (TINY_MEDUSA + ["optim.lr=-1"], "optim.lr must be a finite learning rate >= 0, got -1.0"),
    (TINY_MEDUSA + ["optim.lr=.inf"], "optim.lr must be a finite learning rate >= 0"),
    (TINY_MEDUSA + ["optim.batch_size=2.5"], "config key optim.batch_size: expected an integer, got 2.5"),
    (TINY_MEDUSA + ["seed=true"], "config key seed: expected an integer, got True"),
    (TINY_MEDUSA + ["data.max_length=[1]"], "config key data.max_length: expected an integer"),
    (TINY_MEDUSA + ["optim.max_grad_norm=0"], "optim.max_grad_norm must be > 0 (or null: no clipping)"),
    (TINY_MEDUSA + ["optim.warmup_steps=-1"], "optim.warmup_steps must be >= 0"),
    (TINY_MEDUSA + ["nosuch.key=1"], "unknown config key(s) ['nosuch']"),
    (TINY_MEDUSA + ["optim.lr"], "override 'optim.lr' is not of the form key=value"),
    (TINY_LAYERSKIP + ["layerskip.layer_dropout=1.5"], "layer dropout must be a probability in [0, 1), got 1.5"),
    (TINY_LAYERSKIP + ["layerskip.dropout_scale=cubic"], "layer dropout scale must be one of exp, linear, uniform"),
]


@pytest.mark.parametrize("argv, message", PROBES, ids=[" ".join(a[len(a) - 2:]) for a, _ in PROBES])
def test_bad_input_is_one_clear_line(argv, message, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr("selfspec.cli.generate.load_model", no_loading)
    monkeypatch.setattr("selfspec.cli.bench.load_model", no_loading)
    monkeypatch.setattr("selfspec.training.recipe.load_model", no_loading)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err


# ---------------------------------------------------------------- saved state is checked, never trusted blindly

def _tiny_heads(tmp_path):
    """A Medusa heads directory and an EAGLE-3 drafter directory for tiny:llama (what --model tiny:llama loads)."""
    from eagle.model import save_pretrained
    from medusa.heads import MedusaHeads
    from selfspec.runtime.models import load_model
    from selfspec.testing import eagle_draft

    model, _ = load_model("tiny:llama")
    MedusaHeads.for_model(model, num_heads=2).save_pretrained(tmp_path / "medusa")
    save_pretrained(eagle_draft(model), tmp_path / "eagle")
    return tmp_path / "medusa", tmp_path / "eagle"


def _truncate(path):
    path.write_bytes(path.read_bytes()[:64])


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


SAVED_STATE = [
    ("truncated medusa weights", "medusa", lambda d: _truncate(d / "model.safetensors"),
     "model.safetensors has 64 bytes"),
    ("changed eagle weights", "eagle", lambda d: _flip_last_byte(d / "model.safetensors"),
     "model.safetensors does not have the content that was written"),
    ("no completion marker", "medusa", lambda d: (d / ".selfspec-complete").unlink(), "completion marker"),
    ("deleted weights", "eagle", lambda d: (d / "model.safetensors").unlink(), "model.safetensors"),
]


@pytest.mark.parametrize("name, kind, damage, message", SAVED_STATE, ids=[p[0] for p in SAVED_STATE])
def test_damaged_heads_are_refused_naming_the_file(tmp_path, capsys, name, kind, damage, message):
    medusa_dir, eagle_dir = _tiny_heads(tmp_path)
    directory = medusa_dir if kind == "medusa" else eagle_dir
    damage(directory)
    code = main(["generate", "--model", "tiny:llama", "--prompt", "hi", "--max-new-tokens", "4", "--draft", kind,
                 "--heads", str(directory)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_export_refuses_the_wrong_kind_of_directory(tmp_path, capsys):
    medusa_dir, eagle_dir = _tiny_heads(tmp_path)
    for fmt, heads, message in (("speculators", medusa_dir, "is not an EAGLE-3 feature drafter"),
                                ("vllm-medusa", eagle_dir, "does not hold Medusa heads"),
                                ("sglang", medusa_dir, "the eagle3 format takes drafters"),
                                ("eagle3", eagle_dir, "fuses exactly 3 base layers"),  # the tiny drafter fuses 2
                                ("speculators", tmp_path / "nowhere", "no config.json")):
        code = main(["export", "--format", fmt, "--heads", str(heads), "--out", str(tmp_path / "out"),
                     "--model", "tiny:llama"])
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_a_malformed_dataset_line_is_named_before_training(tmp_path, capsys):
    good = json.dumps({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]})
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join([good, good, '{"conversations": [', good]) + "\n")
    config = Path(__file__).resolve().parents[2] / "configs" / "eagle" / "tiny.yaml"
    code = main(["train", "eagle", "--config", str(config), f"output_dir={tmp_path / 'run'}",
                 f"data.source={data}"])
    err = capsys.readouterr().err
    assert code == 2 and f"dataset {data}, line 3: not valid JSON" in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_calibrate_refuses_heads_of_another_model_before_any_work(tmp_path, capsys, monkeypatch):
    from medusa.heads import MedusaHeads
    from selfspec.runtime.models import load_model

    model, _ = load_model("tiny:llama")
    heads = MedusaHeads.for_model(model, num_heads=2)
    heads.config.head_accuracy = [[0.5, 0.2], [0.3, 0.1]]
    heads.save_pretrained(tmp_path / "h")
    monkeypatch.setattr("selfspec.cli.calibrate.calibrate",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("calibrated before checking the base")))
    code = main(["calibrate", "--heads", str(tmp_path / "h"), "--model", "tiny:qwen2"])
    err = capsys.readouterr().err
    assert code == 2 and "were trained for" in err and "Traceback" not in err, err


def test_debug_shows_the_traceback(capsys):
    """``--debug`` (before or after the subcommand, or among a recipe's arguments) re-raises the error."""
    with pytest.raises(KeyError, match="unknown recipe"):
        main(["--debug", "train", "nope"])
    for argv in (["train", "--debug", *TINY_MEDUSA[1:], "optim.lr=abc"], [*TINY_MEDUSA, "optim.lr=abc", "--debug"]):
        with pytest.raises(ValueError):
            main(argv)
    assert main([*TINY_MEDUSA, "optim.lr=abc"]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("policy,warned", [("passive", True), (" PASSIVE", True), ("active", False), (None, False)])
def test_a_thread_pool_that_sleeps_between_calls_is_named_before_any_work(policy, warned, capsys, monkeypatch):
    """``OMP_WAIT_POLICY=passive`` halves decoding speed (its threads sleep after each of a step's dozens of parallel
    calls): every command says so on stderr, with the fix, and goes on."""
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    assert main(GENERATE) == 2  # the unknown model: the warning comes first, then the command runs as it would
    err = capsys.readouterr().err
    assert ("warning: OMP_WAIT_POLICY=passive" in err and "Unset it" in err) == warned
    assert "no-such-model-anywhere" in err
