"""Bad command-line input ends in one line that names the input and the fix, exit code 2, no traceback, and before
any model is loaded (the model named here does not exist: reaching the loader would fail differently)."""

from __future__ import annotations

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
]


@pytest.mark.parametrize("argv, message", PROBES, ids=[" ".join(a[len(a) - 2:]) for a, _ in PROBES])
def test_bad_input_is_one_clear_line(argv, message, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr("selfspec.cli.generate.load_model", no_loading)
    monkeypatch.setattr("selfspec.cli.bench.load_model", no_loading)
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err, err
    assert "Traceback" not in err
