"""Tree calibration on a tiny model with tiny Medusa heads: candidate trees, the E/t(n) choice, latency
measurement, and the command that writes the chosen tree into the heads' config.json."""

from __future__ import annotations

import json

import pytest
import torch

from medusa import MedusaConfig, MedusaHeads, expected_accept_length
from selfspec.bench import calibration as cal
from selfspec.cli import main
from selfspec.runtime.kernels import machine_class
from selfspec.runtime.models import load_model
from selfspec.testing import sequential_heads, tiny_model

ACCURACY = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.15, 0.1]]


def test_candidate_trees_are_nested_and_capped():
    trees = cal.candidate_trees(ACCURACY, [1, 4, 8, 100])
    assert sorted(trees) == [0, 1, 4, 8]  # 100 > 3 + 9 + 27 possible nodes
    assert trees[0] == [] and trees[1] == [[0]]
    assert all(len(trees[n]) == n for n in trees)
    assert {tuple(c) for c in trees[4]} <= {tuple(c) for c in trees[8]}


def test_choice_maximises_expected_tokens_per_second(monkeypatch):
    # Latency flat up to 4 nodes, then steep: the 4-node tree must win.
    monkeypatch.setattr(cal, "verify_latencies",
                        lambda model, trees, **_: {n: 1.0 if n <= 4 else 1.0 + n for n in trees})
    best, candidates = cal.calibrate(tiny_model("llama"), ACCURACY, [1, 2, 4, 8, 16])
    assert best.size == 4
    assert best.predicted_tau == pytest.approx(1 + expected_accept_length(best.choices, ACCURACY))
    assert [c.size for c in candidates] == [0, 1, 2, 4, 8, 16]
    assert max(candidates[1:], key=lambda c: c.tokens_per_s) is best


def test_verify_latencies_are_measured():
    trees = cal.candidate_trees(ACCURACY, [2, 8])
    model = tiny_model("llama")
    from decoding.tree import DraftTree, TreeTemplate

    drafts = {n: DraftTree(torch.full((n,), 5), TreeTemplate(c).parents if c else torch.zeros(0, dtype=torch.long))
              for n, c in trees.items()}
    latency = cal.verify_latencies(model, drafts, prefix_length=16, repeats=2, warmup=1)
    assert set(latency) == {0, 2, 8} and all(t > 0 for t in latency.values())


def test_cumulative_accuracy_is_rejected():
    with pytest.raises(ValueError, match="not cumulative"):
        cal.check_accuracy([[0.5, 0.8, 0.9]], "heads")
    with pytest.raises(ValueError, match="no measured head_accuracy"):
        cal.check_accuracy(None, "heads")


def test_calibrate_command_writes_the_tree(tmp_path, capsys):
    heads = MedusaHeads.for_model(load_model("tiny:llama")[0], num_heads=3, head_accuracy=ACCURACY)
    heads.save_pretrained(tmp_path)
    rc = main(["calibrate", "--mode", "accuracy", "--threads", "1", "--heads", str(tmp_path), "--model", "tiny:llama",
               "--sizes", "1,4,8",
               "--repeats", "1", "--prefix-length", "16", "--limit", "1", "--max-new-tokens", "8",
               "--overhead-ms", "50"])  # a real model's step cost, so that drafting pays on this tiny one
    assert rc == 0
    config = MedusaConfig.load(tmp_path)
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert len(config.tree) == report["chosen_size"] in (1, 4, 8)
    assert config.tree == cal.candidate_trees(ACCURACY, [report["chosen_size"]])[report["chosen_size"]]
    assert report["measured_tau"] >= 1.0 and [c["size"] for c in report["candidates"]] == [0, 1, 4, 8]
    assert f"Default drafting: a static tree of {len(config.tree)} nodes" in (tmp_path / "README.md").read_text()
    out = capsys.readouterr().out
    assert "<- chosen" in out and "measured" in out
    # The saved heads still load, and the drafter now uses the calibrated tree by default.
    from decoding import make_drafter

    assert make_drafter("medusa", load_model("tiny:llama")[0], str(tmp_path)).template.choices == config.tree


def test_plain_decoding_wins_when_every_tree_costs_more_than_it_gains(monkeypatch, tmp_path):
    from decoding import make_drafter
    from selfspec.runtime.io import is_complete

    # Any tree triples the step time and no tree reaches tau 3: the empty tree must win and be saved as such.
    monkeypatch.setattr(cal, "verify_latencies", lambda model, trees, **_: {n: 1.0 if n == 0 else 3.0 for n in trees})
    model = tiny_model("llama")
    best, candidates = cal.calibrate(model, ACCURACY, [1, 2, 4])
    assert best.size == 0 and best.choices == [] and all(c.predicted_tau < 3 for c in candidates)
    heads = MedusaHeads.for_model(model, num_heads=3, head_accuracy=ACCURACY, tree=[[0], [1]])
    heads.save_pretrained(tmp_path)
    weights = (tmp_path / "model.safetensors").read_bytes()
    cal.save_tree(model, tmp_path, best, cal.report_dict(best, candidates))
    assert MedusaConfig.load(tmp_path).tree == []
    assert (tmp_path / "model.safetensors").read_bytes() == weights  # saved again by the heads' own save_pretrained
    assert make_drafter("medusa", model, str(tmp_path)).template.choices == []  # not the default tree
    assert is_complete(tmp_path, check_sizes=True)  # rewritten as a whole: the completion marker is still true


def test_draft_cost_enters_the_choice(monkeypatch):
    monkeypatch.setattr(cal, "verify_latencies", lambda model, trees, **_: {n: 1.0 for n in trees})
    monkeypatch.setattr(cal, "draft_latencies", lambda model, make, choices, **_: {n: 0.2 * n for n in choices})
    best, candidates = cal.calibrate(tiny_model("llama"), ACCURACY, [1, 2, 4, 8, 16], heads_dir="unused")
    expected = max(candidates[1:], key=lambda c: c.predicted_tau / (1.0 + 0.2 * c.size))
    assert best is expected and best.size < 16  # without the draft cost the largest tree would win
    assert all(c.draft_s == pytest.approx(0.2 * c.size) for c in candidates)


def test_draft_latencies_with_tiny_heads(tmp_path):
    from decoding import make_drafter

    model = tiny_model("llama")
    MedusaHeads.for_model(model, num_heads=3).save_pretrained(tmp_path)
    choices = cal.candidate_trees(ACCURACY, [2, 8])
    latency = cal.draft_latencies(model, lambda c: make_drafter("medusa", model, str(tmp_path), tree=c), choices,
                                  repeats=2, warmup=1)
    assert latency[0] == 0.0 and latency[2] > 0 and latency[8] > 0


def test_linear_fit_smooths_outliers():
    fitted = cal.linear_fit({0: 1.0, 4: 1.4, 8: 5.0, 16: 2.6})  # one size hit by another process
    assert fitted[16] > fitted[8] > fitted[4] > fitted[0]
    assert cal.linear_fit({0: 1.0, 10: 2.0}) == pytest.approx({0: 1.0, 10: 2.0})


def _sequential_heads(tmp_path):
    model = load_model("tiny:llama")[0]  # what the command loads for --model tiny:llama
    heads = sequential_heads(model, num_heads=3, seed=3)
    heads.config.head_accuracy = ACCURACY
    heads.save_pretrained(tmp_path)
    return model


def test_replay_calibration_uses_the_replayed_tau_and_the_measured_costs(monkeypatch, tmp_path):
    from decoding import make_drafter
    from selfspec.bench.replay import make_references, replay

    model = _sequential_heads(tmp_path)
    references = make_references(model, [torch.tensor([[1, 17, 4, 33, 8]]), torch.tensor([[5, 6, 7]])], 16)
    monkeypatch.setattr(cal, "verify_latencies", lambda model, trees, **_: {n: 0.05 + 0.01 * n for n in trees})
    settings = cal.settings_for(MedusaConfig.load(tmp_path), [0, 2, 6], [3, 8], widths=[2], top_ks=[2, 24])
    assert [s.label for s in settings] == ["static 0", "static 2", "static 6", "dynamic 3 (width 2, top-2)",
                                           "dynamic 3 (width 2, top-24)", "dynamic 8 (width 2, top-2)",
                                           "dynamic 8 (width 2, top-24)"]
    best, rows = cal.calibrate_by_replay(model, tmp_path, settings, references, overhead_s=0.001, repeats=1)
    for row in rows:
        drafter = make_drafter("medusa", model, str(tmp_path), **row.setting.options())
        expected = replay(drafter, references, model)
        assert row.tau == pytest.approx(expected.tau) and row.tree_size == pytest.approx(expected.mean_tree)
        assert row.verify_s == pytest.approx(0.05 + 0.01 * row.tree_size)
        assert row.tokens_per_s == pytest.approx(row.tau / (row.verify_s + row.draft_s + 0.001))
    assert best is max(rows, key=lambda r: r.tokens_per_s)
    assert rows[0].tau == 1.0 and rows[0].tree_size == 0


def test_medusa_heads_can_be_calibrated_by_decoding(tmp_path, capsys):
    """--mode decode measures every setting beside plain decoding and saves what the chosen one ran with: a static
    tree grown to its size, or a dynamic tree over the tree it was given."""
    from decoding import make_drafter

    model = _sequential_heads(tmp_path)
    machine = machine_class()
    before = MedusaConfig.load(tmp_path)
    argv = ["calibrate", "--prefer-fastest", "--mode", "decode", "--threads", "1", "--heads", str(tmp_path),
            "--model", "tiny:llama",
            "--limit", "2", "--max-new-tokens", "8", "--linear-backend", "stock", "--keep-default"]
    assert main([*argv, "--grid", "tree=2,4 dynamic=0,3 width=2 top_k=2"]) == 0
    out = capsys.readouterr().out
    assert "calibration: 4 Medusa drafter policies beside plain decoding" in out and "chosen: " in out
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert report["mode"] == "decode" and [c["policy"] for c in report["candidates"]] == [
        {"tree": t, "dynamic": d, "width": 2, "top_k": 2} for t in (2, 4) for d in (0, 3)]
    chosen = report["chosen"]
    assert chosen == max(report["candidates"], key=lambda c: c["tokens_per_s"])["policy"]
    config = MedusaConfig.load(tmp_path)
    grown = cal.candidate_trees(ACCURACY, [chosen["tree"]])[chosen["tree"]]
    dynamic = {"size": 3, "width": 2, "top_k": 2} if chosen["dynamic"] else None
    assert config.drafting_by_machine[machine]["policy"] == {"tree": grown, "dynamic_tree": dynamic}
    assert (config.tree, config.dynamic_tree) == (before.tree, before.dynamic_tree)  # --keep-default
    loaded = make_drafter("medusa", model, str(tmp_path))
    ran = make_drafter("medusa", model, str(tmp_path), **chosen)  # what the calibration decoded
    assert loaded.template.choices == ran.template.choices == grown
    assert (loaded.beam is None) == (ran.beam is None) == (dynamic is None)
    # a grid format Medusa heads cannot save is refused before anything runs
    assert main([*argv, "--grid", "tree=2 draft_weights=q4_1"]) == 2
    assert "draft_weights is not saved with Medusa heads" in capsys.readouterr().err


def test_the_saved_policy_stays_unless_a_policy_is_faster_beyond_the_runs_interval():
    from types import SimpleNamespace

    def policy(seconds):  # per-prompt results: 100 tokens in these many seconds
        return [SimpleNamespace(tokens=[0] * 100, seconds=s) for s in seconds]

    saved = policy([1.0, 2.0, 1.5, 1.2])
    noisy = policy([0.9, 2.1, 1.3, 1.3])  # faster in total, slower on two prompts: not told apart
    clear = policy([0.8, 1.6, 1.2, 1.0])  # faster on every prompt
    assert cal.choose_policy([saved, noisy]) == 1  # the fastest, by default
    assert cal.choose_policy([saved, noisy], keep_saved=True) == 0
    assert cal.choose_policy([saved, noisy, clear], keep_saved=True) == 2
    assert cal.choose_policy([clear, noisy], keep_saved=True) == 0  # the saved one is the fastest
    assert cal.choose_policy([saved[:1], noisy[:1]], keep_saved=True) == 1  # one prompt: no interval, the fastest
    steady = policy([0.95, 1.9, 1.45, 1.15])  # a little faster on every prompt
    assert cal.choose_policy([saved, noisy, steady], keep_saved=True) == 2  # the fastest of those that beat it
    # a policy that beats the saved one at 95% on its own, but not at 95% for a grid of eleven (Bonferroni)
    saved = policy([1.0] * 12)
    marginal = policy([0.93, 0.95, 0.94, 0.96, 0.92, 0.95, 0.97, 0.94, 1.06, 0.93, 0.95, 1.07])
    assert cal.speedup_interval(marginal, saved)[0] > 1.0
    assert cal.choose_policy([saved, marginal], keep_saved=True) == 1
    assert cal.choose_policy([saved, marginal] + [policy([1.01] * 12)] * 10, keep_saved=True) == 0


def test_a_medusa_policy_over_a_null_tree_saves_the_tree_that_ran(tmp_path):
    """Heads saved without a tree draft the default tree size: keeping their saved drafting must save that tree,
    not an empty one (which would turn drafting off)."""
    from decoding import make_drafter

    model, _ = load_model("tiny:llama")
    MedusaHeads.for_model(model, num_heads=3, head_accuracy=ACCURACY).save_pretrained(tmp_path)
    assert MedusaConfig.load(tmp_path).tree is None
    ran = make_drafter("medusa", model, str(tmp_path)).template.choices
    assert ran and make_drafter("medusa", model, str(tmp_path), dynamic=0).template.choices == ran
    cal.save_medusa_policy(model, tmp_path, {}, {"cpu": "test CPU"}, keep_default=True)
    entry = MedusaConfig.load(tmp_path).drafting_by_machine[machine_class()]["policy"]
    assert entry == {"tree": ran, "dynamic_tree": None}
    assert make_drafter("medusa", model, str(tmp_path)).template.choices == ran


def test_calibration_decodes_the_saved_policy_beside_the_grid(tmp_path, capsys):
    model, _ = load_model("tiny:llama")
    heads, _ = _exit_classifier(tmp_path, model)
    assert main(["calibrate", "--threads", "1", "--heads", str(heads), "--model", "tiny:llama", "--limit", "3",
                 "--max-new-tokens", "8", "--grid", "max_depth=1,3", "--linear-backend", "stock"]) == 0
    out = capsys.readouterr().out
    assert "2 early-exit classifier policies and the saved one beside plain decoding" in out
    assert "(saved policy)" in out
    report = json.loads((heads / "calibration.json").read_text())
    assert [c["policy"] for c in report["candidates"]] == [{}, {"max_depth": 1}, {"max_depth": 3}]
    speeds = [c["tokens_per_s"] for c in report["candidates"]]
    fastest = report["candidates"][speeds.index(max(speeds))]
    if report["chosen"] != fastest["policy"]:  # the saved one stayed: the fastest did not beat it clearly
        assert report["chosen"] == {} and "the saved policy stays" in out
        assert report["candidates"][0]["vs_chosen_95"] is None or fastest["vs_chosen_95"][0] <= 1.0
    config = json.loads((heads / "config.json").read_text())
    assert config["policy"] == {"max_depth": 5, **report["chosen"]}  # either way, what ran is what is saved


def test_dynamic_zero_drafts_the_saved_static_tree(tmp_path):
    from decoding import make_drafter

    model = _sequential_heads(tmp_path)
    heads = MedusaHeads.from_pretrained(tmp_path, model)
    heads.config.tree, heads.config.dynamic_tree = [[0], [0, 0]], {"size": 3, "width": 2, "top_k": 2}
    heads.save_pretrained(tmp_path)
    assert make_drafter("medusa", model, str(tmp_path)).beam is not None  # the saved default: dynamic
    static = make_drafter("medusa", model, str(tmp_path), dynamic="0")
    assert static.beam is None and static.template.choices == [[0], [0, 0]]
    assert make_drafter("medusa", model, str(tmp_path), dynamic=0, tree=1).template.choices == [[0]]


def test_replay_calibration_of_heads_merged_with_other_drafters(monkeypatch, tmp_path):
    from decoding import make_drafter
    from lookup.datastore import Datastore
    from selfspec.bench.replay import make_references, replay

    model = _sequential_heads(tmp_path / "heads")
    prompt = torch.tensor([[1, 17, 4, 33, 8, 1, 17]])
    references = make_references(model, [prompt], 16)
    store = Datastore.build([references[0].ids[0].tolist()], context=4, meta={"vocab_size": model.config.vocab_size})
    store.save(tmp_path / "ds")
    monkeypatch.setattr(cal, "verify_latencies", lambda model, trees, **_: {n: 0.05 + 0.01 * n for n in trees})
    settings = cal.settings_for(MedusaConfig.load(tmp_path / "heads"), [0, 2], [], widths=[2], top_ks=[2])
    merged = f"lookup+datastore:{tmp_path / 'ds'}"
    _, rows = cal.calibrate_by_replay(model, tmp_path / "heads", settings, references, merged_with=merged, repeats=1)
    _, alone = cal.calibrate_by_replay(model, tmp_path / "heads", settings, references, repeats=1)
    for row, single in zip(rows, alone):
        drafter = make_drafter(f"medusa+{merged}", model, str(tmp_path / "heads"), **row.setting.options())
        assert row.tau == pytest.approx(replay(drafter, references, model).tau)
        assert row.tau > single.tau  # the datastore holds the very continuation: merged drafts go further


def test_replay_calibration_command_saves_the_chosen_setting(tmp_path, capsys):
    from decoding import make_drafter

    model = _sequential_heads(tmp_path)
    rc = main(["calibrate", "--threads", "1", "--heads", str(tmp_path), "--model", "tiny:llama", "--sizes", "1,4",
               "--dynamic-sizes", "2,6", "--widths", "2", "--top-ks", "2", "--repeats", "1", "--limit", "2",
               "--prefix-length", "16", "--max-new-tokens", "12", "--overhead-ms", "50"])
    assert rc == 0
    report = json.loads((tmp_path / "calibration.json").read_text())
    assert report["mode"] == "replay" and len(report["candidates"]) == 5
    chosen = next(c for c in report["candidates"] if c["setting"] == report["chosen"])
    config = MedusaConfig.load(tmp_path)
    drafter = make_drafter("medusa", model, str(tmp_path))
    if chosen["dynamic"]:
        assert config.dynamic_tree == chosen["dynamic"] and drafter.beam.size == chosen["dynamic"]["size"]
    else:
        assert config.tree == chosen["tree"] and config.dynamic_tree is None and drafter.beam is None
    assert "<- chosen" in capsys.readouterr().out


# ---------------------------------------------------------------- early-exit classifiers: policy search by decoding
def _exit_classifier(tmp_path, model, dtype=None):
    from early_exit import new_classifier

    classifier = new_classifier(model, 2, adapter_layers=1, adapter="attention")
    with torch.no_grad():
        classifier.attention.o_proj.weight.normal_(0, 0.2)  # a trained-looking (non-identity) adapter
    classifier.config.policy = {"max_depth": 5}
    classifier.save_pretrained(tmp_path / "exit", model, notes="made by a test\n", dtype=dtype)
    return tmp_path / "exit", classifier


def test_grid_parsing():
    assert cal.parse_grid("max_depth=2,4 threshold=0,0.5") == [
        {"max_depth": 2, "threshold": 0}, {"max_depth": 2, "threshold": 0.5},
        {"max_depth": 4, "threshold": 0}, {"max_depth": 4, "threshold": 0.5}]
    assert cal.parse_grid("depth=2 draft_weights=float16,q4_1") == [{"depth": 2, "draft_weights": "float16"},
                                                                     {"depth": 2, "draft_weights": "q4_1"}]
    with pytest.raises(ValueError, match="'q5' is not one of float16, float32, q8_0, q4_1"):
        cal.parse_grid("draft_weights=q5")
    for bad, message in (("max_depth", "expected NAME=V1,V2"), ("max_depth=2,x", "'x' is not a number"),
                         ("", "--grid is empty")):
        with pytest.raises(ValueError, match=message):
            cal.parse_grid(bad)


def test_calibrate_chooses_and_saves_an_early_exit_policy(tmp_path, capsys):
    from early_exit import ExitClassifier
    from selfspec.runtime.io import verify_directory

    model, _ = load_model("tiny:llama")
    heads, original = _exit_classifier(tmp_path, model)
    mine = "## Sweep notes\n\nWritten by hand, kept by calibration.\n"
    (heads / "README.md").write_text((heads / "README.md").read_text() + "\n" + mine)
    rc = main(["calibrate", "--prefer-fastest", "--threads", "1", "--heads", str(heads), "--model", "tiny:llama", "--limit", "2",
               "--max-new-tokens", "8", "--grid", "max_depth=1,3 threshold=0,0.5", "--linear-backend", "stock"])
    assert rc == 0
    out = capsys.readouterr().out
    report = json.loads((heads / "calibration.json").read_text())
    assert report["mode"] == "decode" and len(report["candidates"]) == 4
    best = max(report["candidates"], key=lambda c: c["tokens_per_s"])
    assert report["chosen"] == best["policy"] and f"chosen: max_depth={best['policy']['max_depth']}" in out
    assert all(c["tau"] >= 1.0 and c["speedup"] > 0 for c in report["candidates"])
    verify_directory(heads)  # rewritten with fresh checksums, still complete
    config = json.loads((heads / "config.json").read_text())
    assert config["policy"] == best["policy"]
    assert mine in (heads / "README.md").read_text()
    reloaded = ExitClassifier.from_pretrained(heads, model).state_dict()
    assert reloaded.keys() == original.state_dict().keys()  # the weights survive the rewrite unchanged
    assert all(torch.equal(reloaded[k], v) for k, v in original.state_dict().items())


def test_calibrate_early_exit_bad_grid_is_refused_before_loading(tmp_path, capsys):
    model, _ = load_model("tiny:llama")
    heads, _ = _exit_classifier(tmp_path, model)
    rc = main(["calibrate", "--heads", str(heads), "--model", "tiny:llama", "--grid", "depth"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--grid item 'depth'" in err and "Traceback" not in err


# ---------------------------------------------------------------- feature drafters: the same search by decoding
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_calibrate_chooses_and_saves_a_feature_drafter_policy(tmp_path, capsys, dtype):
    from safetensors import safe_open

    from eagle.model import from_pretrained, save_pretrained
    from selfspec.runtime.io import verify_directory
    from selfspec.testing import eagle_draft

    model, _ = load_model("tiny:llama")
    draft = eagle_draft(model, draft_vocab_size=64)
    draft.config.decoding = {"depth": 2, "nodes": 2, "top_k": 2, "width": 2}
    heads = save_pretrained(draft, tmp_path / "eagle", dtype=dtype)
    card = (heads / "README.md").read_text()
    mine = "## Measured by hand\n\nA section its owner wrote.\n"
    (heads / "README.md").write_text(card.replace("## Default drafting", mine + "\n## Default drafting"))
    before = from_pretrained(heads, model).state_dict()
    rc = main(["calibrate", "--prefer-fastest", "--threads", "1", "--heads", str(heads), "--model", "tiny:llama", "--limit", "2",
               "--max-new-tokens", "8", "--grid", "depth=1,3 nodes=2,5", "--linear-backend", "stock"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "4 feature drafter policies" in out
    report = json.loads((heads / "calibration.json").read_text())
    assert report["mode"] == "decode" and len(report["candidates"]) == 4
    best = max(report["candidates"], key=lambda c: c["tokens_per_s"])
    assert report["chosen"] == best["policy"]
    # every policy's speed over the chosen one's, paired over the prompts: the chosen against itself is exactly 1
    assert best["vs_chosen_95"] == [1.0, 1.0]
    for c in report["candidates"]:
        low, high = c["vs_chosen_95"]
        assert 0 < low <= high
    assert "speed over the chosen policy's (95% interval)" in out and "| 1.00-1.00" in out
    verify_directory(heads)
    config = json.loads((heads / "config.json").read_text())
    assert config["decoding"] == {"depth": best["policy"]["depth"], "nodes": best["policy"]["nodes"], "top_k": 2,
                                  "width": 2}  # searched options replaced, the others kept
    # ... and saved for this kind of machine, with where and when it was calibrated
    machine = machine_class()
    assert report["machine_class"] == machine
    entry = config["decoding_by_machine"][machine]
    assert entry["policy"] == config["decoding"] and entry["calibrated_on"] == report["cpu"] and entry["date"]
    card = (heads / "README.md").read_text()
    assert mine in card  # the card keeps what its owner wrote; its default-drafting section is the new one
    assert json.dumps(config["decoding"]) in card.split("## Default drafting")[1]
    after = from_pretrained(heads, model).state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the weights survive the rewrite unchanged
    with safe_open(str(heads / "model.safetensors"), framework="pt") as f:
        stored = {f.get_slice(k).get_dtype() for k in f.keys()} - {"I64"}  # the draft vocabulary's ids
    assert stored == ({"F16"} if dtype == torch.float16 else {"F32"})  # stored as they were


def test_calibrate_can_keep_a_shared_drafters_default_and_save_for_this_machine_only(tmp_path, capsys):
    import eagle
    from eagle.model import save_pretrained
    from selfspec.testing import eagle_draft

    model, _ = load_model("tiny:llama")
    draft = eagle_draft(model, draft_vocab_size=64)
    default = {"depth": 2, "nodes": 2, "top_k": 2, "width": 2, "threshold": 0.3}
    draft.config.decoding = dict(default)
    heads = save_pretrained(draft, tmp_path / "eagle")
    argv = ["calibrate", "--prefer-fastest", "--threads", "1", "--heads", str(heads), "--model", "tiny:llama", "--limit", "2",
            "--max-new-tokens", "8", "--linear-backend", "stock", "--keep-default"]
    assert main([*argv, "--grid", "depth=1,3 nodes=3"]) == 0
    out = capsys.readouterr().out
    # the grid's policies inherit what it does not set from the saved policy, and the run says so
    assert f"over the feature drafter's saved one, {json.dumps(default)} (default)" in out
    config = json.loads((heads / "config.json").read_text())
    assert config["decoding"] == default  # what other machines use is untouched
    machine = machine_class()
    chosen = json.loads((heads / "calibration.json").read_text())["chosen"]
    assert config["decoding_by_machine"][machine]["policy"] == {**default, **chosen}
    drafter = eagle.load(model, heads)
    assert drafter.policy_source == f"calibrated for {machine}"
    assert (drafter.policy.depth, drafter.policy.nodes, drafter.policy.threshold) == (chosen["depth"], 3, 0.3)
    assert machine in (heads / "README.md").read_text().split("## Drafting calibrated per kind of machine")[1]
    # a second calibration on this machine starts from the machine's entry
    assert main([*argv, "--grid", "depth=2 nodes=2,4", "--dry-run"]) == 0
    assert f"({'calibrated for ' + machine})" in capsys.readouterr().out
    # without --keep-default the default becomes the policy that was measured: the grid's options over this
    # machine's entry (its threshold included), not over the old default
    entry = config["decoding_by_machine"][machine]["policy"]
    draft.config.decoding, draft.config.decoding_by_machine = {"depth": 2, "nodes": 2, "top_k": 2, "width": 2}, {
        machine: {"policy": {**entry, "threshold": 0.25, "min_prob": 0.01}}}
    save_pretrained(draft, heads)
    assert main([*argv[:-1], "--grid", "depth=1,2 nodes=3"]) == 0
    config = json.loads((heads / "config.json").read_text())
    chosen = json.loads((heads / "calibration.json").read_text())["chosen"]
    assert config["decoding"] == config["decoding_by_machine"][machine]["policy"] == {
        **entry, "threshold": 0.25, "min_prob": 0.01, **chosen}


def test_medusa_heads_keep_a_tree_per_kind_of_machine(tmp_path, capsys):
    from decoding import make_drafter

    model, _ = load_model("tiny:llama")
    default = [[0], [1]]
    heads = MedusaHeads.for_model(model, num_heads=3, head_accuracy=ACCURACY, tree=default)
    heads.save_pretrained(tmp_path)
    argv = ["calibrate", "--mode", "accuracy", "--threads", "1", "--heads", str(tmp_path), "--model", "tiny:llama",
            "--sizes", "1,4,8", "--repeats", "1", "--prefix-length", "16", "--limit", "1", "--max-new-tokens", "8",
            "--overhead-ms", "50", "--no-measure"]
    assert main([*argv, "--keep-default"]) == 0
    machine = machine_class()
    config = MedusaConfig.load(tmp_path)
    report = json.loads((tmp_path / "calibration.json").read_text())
    chosen = cal.candidate_trees(ACCURACY, [report["chosen_size"]])[report["chosen_size"]]
    assert config.tree == default  # what other machines use is untouched
    entry = config.drafting_by_machine[machine]
    assert entry["policy"] == {"tree": chosen, "dynamic_tree": None} and entry["calibrated_on"] == report["cpu"]
    assert config.drafting_for(machine) == (entry["policy"], f"drafting_by_machine[{machine!r}]")
    assert config.drafting_for("another-class") == ({"tree": default, "dynamic_tree": None}, "tree/dynamic_tree")
    drafter = make_drafter("medusa", model, str(tmp_path))
    assert drafter.template.choices == chosen and drafter.policy_source == f"calibrated for {machine}"
    given = make_drafter("medusa", model, str(tmp_path), tree=json.dumps(default))  # options still win
    assert given.template.choices == default and given.policy_source == "options"
    card = (tmp_path / "README.md").read_text().split("## Drafting calibrated per kind of machine")[1]
    assert machine in card and f"a static tree of {len(chosen)} nodes" in card
    # without --keep-default the choice becomes the default too
    assert main(argv) == 0
    config = MedusaConfig.load(tmp_path)
    assert config.tree == config.drafting_by_machine[machine]["policy"]["tree"]


def test_a_dynamic_medusa_entry_replaces_the_default_on_its_machine_only(tmp_path):
    model, _ = load_model("tiny:llama")
    machine = machine_class()
    heads = MedusaHeads.for_model(model, num_heads=3, head_accuracy=ACCURACY, tree=[[0], [1], [0, 0]])
    heads.save_pretrained(tmp_path)
    setting = cal.Setting(choices=None, dynamic={"size": 2, "width": 1, "top_k": 2})
    cal.save_setting(model, tmp_path, setting, {"cpu": "test CPU"}, keep_default=True)
    config = MedusaConfig.load(tmp_path)
    assert config.dynamic_tree is None and config.drafting_by_machine[machine]["policy"] == {
        "tree": [[0], [1], [0, 0]], "dynamic_tree": {"size": 2, "width": 1, "top_k": 2}}
    from medusa import load

    drafter = load(model, tmp_path)
    assert drafter.selector is not None and drafter.policy_source == f"calibrated for {machine}"
    assert load(model, tmp_path, tree=2).selector is None  # an explicit tree drafts statically


def test_a_dynamic_setting_is_measured_and_saved_over_this_machines_tree(tmp_path):
    """Calibration replays a dynamic setting with the machine's saved tree as its pool (sequential heads: its depth)
    and saves that tree with it; an entry whose static tree is empty ("no tree pays") still drafts dynamically."""
    from decoding import generate, make_drafter
    from medusa import load

    model, _ = load_model("tiny:llama")
    machine = machine_class()
    heads = sequential_heads(model, num_heads=3)
    heads.config.tree = [[0], [0, 0], [0, 0, 0]]
    heads.save_pretrained(tmp_path)
    cal.save_setting(model, tmp_path, cal.Setting(choices=[[0], [0, 0]]), {"cpu": "test CPU"}, keep_default=True)
    replayed = make_drafter("medusa", model, str(tmp_path), dynamic=3, width=2, top_k=2)  # as the replay builds it
    assert replayed.template.choices == [[0], [0, 0]] and replayed.beam.depth == 2
    cal.save_setting(model, tmp_path, cal.Setting(dynamic={"size": 3, "width": 2, "top_k": 2}), {"cpu": "test CPU"},
                     keep_default=True)
    assert MedusaConfig.load(tmp_path).drafting_by_machine[machine]["policy"]["tree"] == [[0], [0, 0]]
    assert load(model, tmp_path).beam.depth == 2  # what was measured is what is loaded
    cal.save_setting(model, tmp_path, cal.Setting(choices=[]), {"cpu": "test CPU"}, keep_default=True)
    assert load(model, tmp_path).template.choices == []  # no tree pays: plain decoding
    cal.save_setting(model, tmp_path, cal.Setting(dynamic={"size": 3, "width": 2, "top_k": 2}), {"cpu": "test CPU"},
                     keep_default=True)
    drafter = load(model, tmp_path)
    assert drafter.beam.depth == 3  # an empty pool: the beam runs every head
    prompt = torch.tensor([[5, 9, 2, 7, 11]])
    out = generate(model, drafter, prompt, max_new_tokens=12)
    assert max(out.stats.tree_sizes) > 0  # it drafts, not plain decoding
    assert torch.equal(out.sequences, model.generate(prompt, max_new_tokens=12, do_sample=False))


def test_bad_per_machine_entries_are_refused_naming_them():
    with pytest.raises(ValueError, match=r"drafting_by_machine\['x'\] must set exactly \['tree', 'dynamic_tree'\]"):
        MedusaConfig(num_heads=2, drafting_by_machine={"x": {"policy": {"tree": [[0]]}}})
    with pytest.raises(ValueError, match=r"drafting_by_machine\['x'\]: MedusaConfig.tree path"):
        MedusaConfig(num_heads=2, drafting_by_machine={"x": {"policy": {"tree": [[0, 0, 0]], "dynamic_tree": None}}})
    config = MedusaConfig(num_heads=2, drafting_by_machine={"x": {"policy": {"tree": [["1"]], "dynamic_tree": None}}})
    assert config.drafting_for("x") == ({"tree": [[1]], "dynamic_tree": None}, "drafting_by_machine['x']")
    with pytest.raises(ValueError, match=r"drafting_by_machine\['x'\] must be an object with a 'policy'"):
        MedusaConfig(num_heads=2, drafting_by_machine={"x": [[0]]})
    from early_exit.classifier import ExitClassifierConfig

    with pytest.raises(ValueError, match=r"policy_by_machine\['y'\] must be an object with a 'policy'"):
        ExitClassifierConfig(exit_layer=1, policy_by_machine={"y": {"max_depth": 2}})


def test_exit_classifiers_keep_a_policy_per_kind_of_machine(tmp_path, capsys):
    from decoding import make_drafter

    model, _ = load_model("tiny:llama")
    heads, _ = _exit_classifier(tmp_path, model)
    config = json.loads((heads / "config.json").read_text())
    default = config["policy"]
    argv = ["calibrate", "--prefer-fastest", "--threads", "1", "--heads", str(heads), "--model", "tiny:llama", "--limit", "2",
            "--max-new-tokens", "8", "--linear-backend", "stock"]
    assert main([*argv, "--grid", "max_depth=1,3", "--keep-default"]) == 0
    assert f"over the early-exit classifier's saved one, {json.dumps(default)} (default)" in capsys.readouterr().out
    machine = machine_class()
    config = json.loads((heads / "config.json").read_text())
    chosen = json.loads((heads / "calibration.json").read_text())["chosen"]
    assert config["policy"] == default and config["policy_by_machine"][machine]["policy"] == {**default, **chosen}
    drafter = make_drafter("early-exit", model, str(heads))
    assert drafter.policy.max_depth == chosen["max_depth"] and drafter.policy_source == f"calibrated for {machine}"
    assert make_drafter("early-exit", model, str(heads), max_depth=2).policy_source.endswith(" + options")
    assert machine in (heads / "README.md").read_text().split("## Drafting calibrated per kind of machine")[1]
    # a saved entry that is not a policy fails where it is used, naming the entry and the fix
    from early_exit import ExitClassifier

    classifier = ExitClassifier.from_pretrained(heads, model)
    classifier.config.policy_by_machine[machine]["policy"] = {"max_depth": 0}
    classifier.save_pretrained(heads, model)
    with pytest.raises(ValueError, match=rf"policy_by_machine\['{machine}'\] in .*config.json"):
        make_drafter("early-exit", model, str(heads))


def test_calibrating_a_float16_exit_classifier_keeps_it_float16(tmp_path):
    from early_exit import ExitClassifier
    from selfspec.runtime.io import stored_float_dtype

    model, _ = load_model("tiny:llama")
    heads, _ = _exit_classifier(tmp_path, model, dtype=torch.float16)
    assert stored_float_dtype(heads) == torch.float16
    before = ExitClassifier.from_pretrained(heads, model).state_dict()
    assert main(["calibrate", "--prefer-fastest", "--threads", "1", "--heads", str(heads), "--model", "tiny:llama", "--limit", "1",
                 "--max-new-tokens", "4", "--grid", "max_depth=1,2", "--linear-backend", "stock"]) == 0
    assert stored_float_dtype(heads) == torch.float16  # not doubled to float32 by the rewrite
    after = ExitClassifier.from_pretrained(heads, model).state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_calibrating_a_feature_drafter_as_a_fallback_decodes_each_policy_where_lookup_has_nothing(
        tmp_path, capsys, monkeypatch):
    """``--fallback-of lookup``: every policy decodes as ``lookup|eagle:HEADS`` with the policy routed to the feature
    drafter (not to lookup, the spec's first part), the report says so, and bad fallbacks are refused up front."""
    from decoding import FallbackDrafter
    from eagle.drafter import EagleDrafter
    from eagle.model import save_pretrained
    from selfspec.testing import eagle_draft

    model, _ = load_model("tiny:llama")
    heads = save_pretrained(eagle_draft(model, draft_vocab_size=64), tmp_path / "eagle")
    built = []
    parse = cal.parse_method

    def spy(spec, **options):
        method = parse(spec, **options)
        built.append((spec, method))
        return method

    monkeypatch.setattr(cal, "parse_method", spy)
    rc = main(["calibrate", "--prefer-fastest", "--threads", "1", "--heads", str(heads), "--model", "tiny:llama", "--limit", "2",
               "--max-new-tokens", "8", "--grid", "depth=1,3", "--linear-backend", "stock",
               "--fallback-of", "lookup", "--dry-run"])
    assert rc == 0
    assert "as the fallback of lookup" in capsys.readouterr().out
    policies = [(spec, method.drafter(model)) for spec, method in built if spec != "vanilla"]
    assert [spec for spec, _ in policies] == [f"lookup|eagle:{heads}"] * 2
    for (_, drafter), depth in zip(policies, (1, 3)):
        assert isinstance(drafter, FallbackDrafter) and drafter.names == ["lookup", "eagle"]
        assert isinstance(drafter.drafters[1], EagleDrafter) and drafter.drafters[1].policy.depth == depth
    monkeypatch.setattr(cal, "parse_method", parse)
    assert main(["calibrate", "--prefer-fastest", "--threads", "1", "--heads", str(heads), "--model", "tiny:llama", "--limit", "1",
                 "--max-new-tokens", "4", "--grid", "depth=1", "--linear-backend", "stock",
                 "--fallback-of", "lookup"]) == 0
    assert json.loads((heads / "calibration.json").read_text())["fallback_of"] == "lookup"
    for bad, message in (("lookup+datastore:x", "merge others"), ("lookup|eagle", "the drafter being calibrated")):
        assert main(["calibrate", "--heads", str(heads), "--model", "tiny:llama", "--fallback-of", bad]) != 0
        assert message in capsys.readouterr().err
    medusa = tmp_path / "medusa"
    MedusaHeads.for_model(model, num_heads=2).save_pretrained(medusa)
    assert main(["calibrate", "--heads", str(medusa), "--model", "tiny:llama", "--fallback-of", "lookup"]) != 0
    assert "Medusa heads with --mode decode); replay merges with --merged-with only" in capsys.readouterr().err
