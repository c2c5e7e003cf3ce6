"""train/eagle.py on a tiny random Llama: the loss is the base's own distribution, training lowers it, the drafter
it saves loads and decodes losslessly, cached and online features agree, the time budget stops cleanly and
--resume finishes the same run, and 2 processes match 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import eagle.recipe as eagle_recipe
from decoding.generate import generate
from eagle.drafter import make_eagle_drafter
from selfspec.runtime.kernels import linear_backend_of, onednn_available
from selfspec.testing import (
    assert_same_run,
    greedy_reference,
    launch_recipe,
    logged_losses,
    random_prompt,
    repetitive_conversations,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "train/eagle.py"
TINY = ROOT / "configs/eagle/tiny.yaml"


def args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY), f"output_dir={tmp_path / 'run'}", f"data.source={data}", "data.eval_samples=2",
            *extra]


def build(argv) -> eagle_recipe.EagleRecipe:
    parsed = eagle_recipe.T.parse_recipe_args(argv, "test")
    cfg = eagle_recipe.T.load_config(eagle_recipe.RecipeConfig, parsed.config, parsed.overrides)
    r = eagle_recipe.EagleRecipe(cfg, parsed.resume)
    r.setup()
    return r


def test_step_losses_are_cross_entropies_to_the_base_distribution(tmp_path):
    r = build(args(tmp_path, repetitive_conversations(tmp_path / "d.jsonl", 8), "optim.max_steps=1"))
    batch = r.make_batch([0, 1, 2])
    denominators = r.counts(batch)
    _, terms = r.loss(batch, denominators)
    draft, base = r.model, r.base
    feats = batch["features"]
    outputs = draft([feats[i] for i in r.aux_layers], batch["input_ids"], batch["attention_mask"], r.cfg.ttt_steps)
    for j, out in enumerate(outputs):
        rows, cols = eagle_recipe.step_positions(batch, j)
        with torch.no_grad():  # the base's own prediction at t + j + 1, from a fresh forward of the whole model
            logits = base(batch["input_ids"], attention_mask=batch["attention_mask"]).logits[rows, cols + j + 1]
        p = torch.softmax(logits, -1)[:, draft.draft_vocab]
        log_q = torch.log_softmax(draft.logits(out[rows, cols]), -1)
        expected = -(p * log_q).sum() / denominators[j]
        assert float(terms[j]) == pytest.approx(float(expected.detach()), rel=1e-4)
        # the positions are those whose drafted token (t + j + 2) is an assistant token
        assert bool(batch["loss_mask"][rows, cols + j + 2].all())


def test_teacher_from_kept_log_normalisers_equals_the_full_softmax(tmp_path):
    """From an example's second batch on, the teacher multiplies only the draft vocabulary's LM-head rows and
    normalises by the log-normaliser kept from its first: the same probabilities and argmax as the full softmax, in
    any batch the example lands in (other neighbours, other padding)."""
    r = build(args(tmp_path, repetitive_conversations(tmp_path / "d.jsonl", 8), "optim.max_steps=1"))
    assert r.cfg.draft.draft_vocab_size < r.base.config.vocab_size  # otherwise nothing would be saved
    first = r.make_batch([0, 1, 2])
    assert set(r.teacher_stats) == {0, 1, 2}
    head = r.base.get_output_embeddings()
    calls = []
    handle = head.register_forward_hook(lambda *a: calls.append(1))
    try:
        again = r.make_batch([2, 0, 1])  # a different order: rows move, the longest example sets the padding
    finally:
        handle.remove()
    assert not calls  # the full-vocabulary head did not run
    for new_row, old_row in enumerate([2, 0, 1]):
        n = int(first["attention_mask"][old_row].sum())
        torch.testing.assert_close(again["teacher_probs"][new_row, :n], first["teacher_probs"][old_row, :n],
                                   rtol=1e-5, atol=1e-7)
        assert torch.equal(again["teacher_argmax"][new_row, :n], first["teacher_argmax"][old_row, :n])
    assert not again["teacher_probs"][again["attention_mask"] == 0].any()
    rows_through_head = []
    handle = head.register_forward_hook(lambda module, inputs, output: rows_through_head.append(inputs[0].shape[0]))
    try:
        mixed = r.make_batch([0, 5])  # example 5 is new: the full softmax for its row only
    finally:
        handle.remove()
    assert 5 in r.teacher_stats
    assert sum(rows_through_head) == sum(r.train_examples[5]["loss_mask"][1:])  # its positions whose next is trained
    n = int(first["attention_mask"][0].sum())
    torch.testing.assert_close(mixed["teacher_probs"][0, :n], first["teacher_probs"][0, :n], rtol=1e-5, atol=1e-7)
    alone = r.make_batch([5])
    m = int(alone["attention_mask"][0].sum())
    torch.testing.assert_close(mixed["teacher_probs"][1, :m], alone["teacher_probs"][0, :m], rtol=1e-5, atol=1e-7)
    denominators = r.counts(again)
    torch.testing.assert_close(r.loss(again, denominators)[1],
                               r.loss(r.make_batch([2, 0, 1]), denominators)[1])
    full = build(args(tmp_path / "full", tmp_path / "d.jsonl", "optim.max_steps=1", "draft.draft_vocab_size=null"))
    full.make_batch([0, 1])
    assert not full.teacher_stats  # the whole vocabulary: nothing to save, nothing kept


def test_training_lowers_the_loss_and_saves_a_lossless_drafter(tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 12)
    r = build(args(tmp_path, data, "optim.max_steps=12", "optim.epochs=20", "optim.lr=0.01", "logging.log_every=1",
                  "loss=hard"))  # the soft loss bottoms out at the teacher entropy
    r.train()
    metrics = r.evaluate()
    r.save_heads(metrics)
    first, last = r.history[0]["loss"], r.history[-1]["loss"]
    assert last < 0.8 * first, (first, last)
    assert len(metrics["accuracy"]) == r.cfg.ttt_steps and metrics["eval_targets"][0] > 0
    drafter = make_eagle_drafter(r.base, str(tmp_path / "run" / "heads"))
    assert drafter.policy.depth == r.cfg.decoding.depth and drafter.policy.nodes == r.cfg.decoding.nodes
    saved = json.loads((tmp_path / "run" / "heads" / "config.json").read_text())
    assert saved["training"]["metrics"]["steps"] == 12 and "train/eagle.py" in saved["training"]["command"]
    for n in (3, 11):
        ids = random_prompt(n, seed=n)
        out = generate(r.base, drafter, ids, max_new_tokens=24)
        assert torch.equal(out.sequences, greedy_reference(r.base, ids, 24))


@pytest.mark.skipif(not onednn_available(), reason="this PyTorch build has no oneDNN")
def test_the_base_runs_the_gemm_asked_for_and_features_agree_with_stocks(tmp_path, capsys):
    data = repetitive_conversations(tmp_path / "d.jsonl", 8)
    stock = build(args(tmp_path, data, "optim.max_steps=1", "optim.base_linear_backend=stock"))
    assert "linear layers on stock\n" in capsys.readouterr().out and linear_backend_of(stock.base) == "stock"
    fast = build(args(tmp_path, data, "optim.max_steps=1", "optim.base_linear_backend=onednn",
                      f"output_dir={tmp_path / 'fast'}"))
    assert "linear layers on onednn\n" in capsys.readouterr().out and linear_backend_of(fast.base) == "onednn"
    auto = build(args(tmp_path, data, "optim.max_steps=1", f"output_dir={tmp_path / 'auto'}"))  # the default
    assert f"linear layers on {auto.base_backend} (measured fastest here)" in capsys.readouterr().out
    a, b = stock.make_batch([0, 1, 2]), fast.make_batch([0, 1, 2])
    for layer in a["features"]:
        torch.testing.assert_close(b["features"][layer], a["features"][layer], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast.loss(b, fast.counts(b))[0], stock.loss(a, stock.counts(a))[0], rtol=1e-5,
                               atol=1e-6)


def test_cached_features_give_the_same_loss_as_running_the_base(tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 8)
    online = build(args(tmp_path, data, "optim.max_steps=1"))
    cached = build(args(tmp_path, data, "optim.max_steps=1", "cache_hidden_states=true",
                        f"hidden_cache_dir={tmp_path / 'cache'}"))
    a, b = online.make_batch([0, 3]), cached.make_batch([0, 3])
    for layer in a["features"]:
        torch.testing.assert_close(a["features"][layer], b["features"][layer], rtol=1e-5, atol=1e-5)
    cached.model.load_state_dict(online.model.state_dict())
    la, _ = online.loss(a, online.counts(a))
    lb, _ = cached.loss(b, cached.counts(b))
    assert float(la.detach()) == pytest.approx(float(lb.detach()), rel=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_narrower_cache_holds_the_fused_layers_rounded_and_the_teachers_state_exact(tmp_path, dtype):
    data = repetitive_conversations(tmp_path / "d.jsonl", 8)
    full = build(args(tmp_path, data, "optim.max_steps=1", "cache_hidden_states=true",
                      f"hidden_cache_dir={tmp_path / 'cache'}"))
    half = build(args(tmp_path, data, "optim.max_steps=1", "cache_hidden_states=true",
                      f"hidden_cache_dir={tmp_path / 'cache'}", f"hidden_cache_dtype={dtype}"))
    narrow = getattr(torch, dtype)
    for layer, states in half.hidden_cache.items():
        held = narrow if layer in half.aux_layers else torch.float32  # -1, the teacher's, stays float32
        for a, b in zip(full.hidden_cache[layer], states):
            assert a.dtype == torch.float32 and b.dtype == held and torch.equal(a.to(held), b)
    # the batches the model sees are float32 again, the fused states rounded, the teacher the same
    fb, hb = full.make_batch([1, 2]), half.make_batch([1, 2])
    for layer in fb["features"]:
        assert hb["features"][layer].dtype == torch.float32
        expected = fb["features"][layer].to(narrow).float() if layer in half.aux_layers else fb["features"][layer]
        torch.testing.assert_close(hb["features"][layer], expected, rtol=0, atol=0)
    assert torch.equal(fb["teacher_probs"], hb["teacher_probs"])
    with pytest.raises(ValueError, match="hidden_cache_dtype must be one of float32, bfloat16, float16"):
        build(args(tmp_path, data, "hidden_cache_dtype=fp8"))


def launch(argv: list[str], **kwargs):
    return launch_recipe(SCRIPT, argv, **kwargs)



@pytest.mark.slow
def test_time_budget_stops_cleanly_and_resume_finishes_the_same_run(tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 12)
    common = ["optim.max_steps=4", "logging.log_every=1", "logging.save_every=null"]
    launch(args(tmp_path, data, *common, f"output_dir={tmp_path / 'straight'}"))
    budget = args(tmp_path, data, *common, f"output_dir={tmp_path / 'cut'}")
    first = launch([*budget, "optim.max_minutes=0.000001"])
    assert "time budget" in first.stdout and "step 1 of 4" in first.stdout
    saved = json.loads((tmp_path / "cut" / "heads" / "config.json").read_text())["training"]["metrics"]
    assert saved["steps"] == 1 and saved["stopped_by_time_budget"] is True  # a usable drafter, marked as cut
    launch([*budget, "--resume"])
    assert_same_run(tmp_path / "straight", tmp_path / "cut", last_losses=3)


# Runs the recipe, sending itself a signal (or two) right after optimizer step 2, as a scheduler or Ctrl-C would.
SIGNAL_AFTER_STEP_2 = """
import os, runpy, signal, sys
import eagle.recipe
signal.signal(signal.SIGINT, signal.{sigint})  # a terminal's Ctrl-C (a background job, as CI's may be, ignores it)
step_record, calls = eagle.recipe.EagleRecipe.step_record, []
def signalled_step_record(self, terms):
    calls.append(1)
    if len(calls) == 2:
        for _ in range({times}):
            os.kill(os.getpid(), signal.{name})
    return step_record(self, terms)
eagle.recipe.EagleRecipe.step_record = signalled_step_record
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_sigterm_stops_cleanly_after_the_step_and_resume_finishes_the_same_run(tmp_path):
    """SIGTERM (a scheduler's) mid-run: checkpoint, evaluation and heads after the step, exit 143; --resume then
    ends where a straight run does."""
    data = repetitive_conversations(tmp_path / "d.jsonl", 12)
    common = ["optim.max_steps=4", "logging.log_every=1", "logging.save_every=null"]
    launch(args(tmp_path, data, *common, f"output_dir={tmp_path / 'straight'}"))
    cut = args(tmp_path, data, *common, f"output_dir={tmp_path / 'cut'}")
    # Sent twice, as a launcher and a scheduler may both forward it: the second is ignored, the stop stays clean.
    first = launch(cut, wrapper=SIGNAL_AFTER_STEP_2.format(script=str(SCRIPT), name="SIGTERM", times=2,
                                                              sigint="default_int_handler"), check=False)
    assert first.returncode == 128 + 15, first.stderr[-3000:]  # saved, then ends as a terminated command does
    assert "SIGTERM received at step 2 of 4" in first.stdout, first.stdout[-2000:]
    saved = json.loads((tmp_path / "cut" / "heads" / "config.json").read_text())["training"]["metrics"]
    assert saved["steps"] == 2 and saved["stopped_by"] == "SIGTERM" and saved["stopped_by_time_budget"] is False
    assert (tmp_path / "cut" / "checkpoints" / "step-00000002").is_dir()
    launch([*cut, "--resume"])
    assert_same_run(tmp_path / "straight", tmp_path / "cut", last_losses=2)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once(tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 12)
    run = args(tmp_path, data, "optim.max_steps=4", "logging.save_every=null")
    result = launch(run, wrapper=SIGNAL_AFTER_STEP_2.format(script=str(SCRIPT), name="SIGINT", times=2,
                                                            sigint="default_int_handler"), check=False)
    assert result.returncode != 0 and "KeyboardInterrupt" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "run" / "heads").exists()


@pytest.mark.slow
def test_an_ignored_ctrl_c_stays_ignored(tmp_path):
    # `python train/eagle.py ... &` from a script ignores SIGINT: the recipe must not start stopping on it.
    data = repetitive_conversations(tmp_path / "d.jsonl", 12)
    run = args(tmp_path, data, "optim.max_steps=4", "logging.save_every=null")
    result = launch(run, wrapper=SIGNAL_AFTER_STEP_2.format(script=str(SCRIPT), name="SIGINT", times=1,
                                                            sigint="SIG_IGN"))
    assert "received" not in result.stderr
    assert json.loads((tmp_path / "run" / "heads" / "config.json").read_text())["training"]["metrics"]["steps"] == 4


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 18)
    common = ["optim.max_steps=3", "data.eval_samples=2", "logging.log_every=1"]
    launch(args(tmp_path, data, *common, "optim.batch_size=4", f"output_dir={tmp_path / 'one'}"))
    two = launch(args(tmp_path, data, *common, "optim.batch_size=2", f"output_dir={tmp_path / 'two'}"), processes=2)
    assert "2 processes" in two.stdout
    assert logged_losses(tmp_path / "one") == pytest.approx(logged_losses(tmp_path / "two"), rel=1e-4)
    one = load_file(str(tmp_path / "one/heads/model.safetensors"))
    two = load_file(str(tmp_path / "two/heads/model.safetensors"))
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=1e-4, atol=1e-5)


def test_resume_refuses_a_changed_recipe_naming_the_keys_and_says_when_there_is_nothing(tmp_path, capsys):
    data = repetitive_conversations(tmp_path / "d.jsonl", 10)
    base = args(tmp_path, data, "optim.max_steps=2", "logging.save_every=1")
    eagle_recipe.main(base)
    with pytest.raises(ValueError, match=r"optim.lr: 0.003 in the checkpoint, 0.01 now.*--allow-changed optim.lr"):
        eagle_recipe.main([*base, "--resume", "optim.lr=0.01"])
    with pytest.raises(ValueError, match="draft.draft_vocab_size: 64 in the checkpoint, 32 now"):
        eagle_recipe.main([*base, "--resume", "draft.draft_vocab_size=32"])
    capsys.readouterr()
    eagle_recipe.main([*base, "--resume", "optim.lr=0.01", "--allow-changed", "optim.lr", "optim.max_steps=3"])
    assert "resumed from" in capsys.readouterr().out
    eagle_recipe.main([*base, "--resume", f"output_dir={tmp_path / 'empty'}"])
    assert "nothing to resume, starting from step 0" in capsys.readouterr().out


def test_a_resume_on_changed_data_keeps_the_checkpoints_draft_vocabulary_and_what_derives_from_it(tmp_path):
    first = repetitive_conversations(tmp_path / "a.jsonl", 10)
    other = repetitive_conversations(tmp_path / "b.jsonl", 10, seed=1, words=["zebra", "quiz", "jumps", "vex"])
    base = args(tmp_path, first, "optim.max_steps=2", "logging.save_every=1", "draft.draft_vocab_size=24")
    eagle_recipe.main(base)
    saved = load_file(str(tmp_path / "run/heads/model.safetensors"))["draft_vocab"]
    fresh = build(args(tmp_path, other, "draft.draft_vocab_size=24"))
    assert not torch.equal(fresh.model.draft_vocab, saved)  # the other data counts other tokens
    r = eagle_recipe.EagleRecipe.from_command_line(
        [*args(tmp_path, other, "optim.max_steps=3", "logging.save_every=1", "draft.draft_vocab_size=24"),
         "--resume", "--allow-changed", "data.source"], "test")
    r.setup()
    assert r.step > 0 and torch.equal(r.model.draft_vocab, saved)
    head = r.base.get_output_embeddings().weight
    assert torch.equal(r.model.shared_head.weight, head[saved])
    assert torch.equal(r.to_draft[saved], torch.arange(24)) and int((r.to_draft >= 0).sum()) == 24
    batch = r.make_batch([0, 1])
    last = batch["features"][-1].flatten(0, 1)
    lse = torch.logsumexp(torch.nn.functional.linear(last, head).float(), dim=-1)
    torch.testing.assert_close(r.draft_teacher(last, lse),
                               torch.softmax(torch.nn.functional.linear(last, head).float(), -1)[:, saved])


def assert_same_loss(saved: eagle_recipe.EagleRecipe, started: eagle_recipe.EagleRecipe) -> None:
    """A run started from ``saved``'s drafter computes, before its first step, the loss ``saved`` does on the same
    batch."""
    batch = saved.make_batch([0, 1])
    before, _ = saved.loss(batch, saved.counts(batch))
    after, _ = started.loss(batch, started.counts(batch))
    assert float(after.detach()) == pytest.approx(float(before.detach()), rel=1e-5)


def test_init_from_starts_where_a_saved_drafter_stopped(tmp_path, capsys):
    """Started from a saved drafter (another data mix, different frequent tokens), a run keeps its layers, draft
    vocabulary and weights: with lr 0 it saves the same drafter, and training goes on from its loss. The trees it
    had calibrated per kind of machine were chosen for its weights and are not carried over."""
    from eagle.model import from_pretrained, save_pretrained

    data = repetitive_conversations(tmp_path / "d.jsonl", 12)
    first = build(args(tmp_path, data, "optim.max_steps=6", "optim.lr=0.01", "logging.log_every=1", "loss=hard"))
    first.train()
    first.save_heads(first.evaluate())
    saved = tmp_path / "run" / "heads"
    calibrated = from_pretrained(saved, first.base)
    calibrated.config.decoding_by_machine = {"x86_64-avx2": {"policy": {"depth": 5, "nodes": 3}}}
    save_pretrained(calibrated, saved)
    other = repetitive_conversations(tmp_path / "other.jsonl", 9)
    again = build(["--config", str(TINY), f"output_dir={tmp_path / 'again'}", f"data.source={other}",
                   "data.eval_samples=2", "optim.max_steps=1", "optim.lr=0", "logging.log_every=1", "loss=hard",
                   f"init_from={saved}", "draft.aux_layers=[1]"])
    assert again.aux_layers == first.aux_layers and torch.equal(again.model.draft_vocab, first.model.draft_vocab)
    assert_same_loss(first, again)
    again.train()
    again.save_heads(again.evaluate())
    a, b = (load_file(str(d / "model.safetensors")) for d in (saved, tmp_path / "again" / "heads"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "again" / "heads" / "config.json").read_text())["decoding_by_machine"] == {}
    assert "trees calibrated per kind of machine (x86_64-avx2) are dropped" in capsys.readouterr().out
    with pytest.raises(ValueError, match="set heads_dir to another directory"):  # never overwrite what it starts from
        eagle_recipe.T.load_config(eagle_recipe.RecipeConfig, TINY, [f"init_from={saved}",
                                                                     f"output_dir={tmp_path / 'run'}"])


@pytest.mark.parametrize("share", [True, False])
def test_init_from_extends_the_draft_vocabulary_and_keeps_what_it_drafted(tmp_path, share, capsys):
    """A larger draft.draft_vocab_size with init_from keeps every saved id and adds the most frequent trained tokens
    the saved vocabulary lacks; the kept columns score as before (a trained head keeps its rows, new rows start
    from the base's LM head); a smaller size keeps the saved vocabulary and says so."""
    from collections import Counter

    data = repetitive_conversations(tmp_path / "d.jsonl", 12)
    flag = f"draft.share_lm_head={str(share).lower()}"
    first = build(args(tmp_path, data, "optim.max_steps=3", "optim.lr=0.01", flag))
    first.train()
    first.save_heads(first.evaluate())
    saved = tmp_path / "run" / "heads"
    other = repetitive_conversations(tmp_path / "other.jsonl", 9, seed=5, words=["QUIZ", "JAVA", "#{}", "~|^", "XY"])
    common = ["--config", str(TINY), f"output_dir={tmp_path / 'again'}", f"data.source={other}", "data.eval_samples=2",
              "optim.max_steps=1", f"init_from={saved}", flag]
    again = build(common + ["draft.draft_vocab_size=96"])
    old, new = first.model.draft_vocab.tolist(), again.model.draft_vocab.tolist()
    assert len(new) == 96 and set(old) <= set(new) and new == sorted(new)
    counts = Counter(t for e in again.train_examples for t, m in zip(e["input_ids"], e["loss_mask"]) if m)
    added = set(new) - set(old)
    left_out = set(range(again.base.config.vocab_size)) - set(new)
    assert min(counts[t] for t in added) >= max(counts[t] for t in left_out) and any(counts[t] for t in added)
    h = torch.randn(5, again.base.config.hidden_size)
    with torch.no_grad():
        before, after = first.model.logits(h), again.model.logits(h)
    columns = [new.index(t) for t in old]
    torch.testing.assert_close(after[:, columns], before)
    if not share:
        head = again.base.get_output_embeddings().weight
        fresh = [i for i, t in enumerate(new) if t in added]
        torch.testing.assert_close(again.model.lm_head.weight[fresh], head[[new[i] for i in fresh]])
    assert torch.equal(build(common).model.draft_vocab, first.model.draft_vocab)  # the same size: kept
    capsys.readouterr()
    assert torch.equal(build(common + ["draft.draft_vocab_size=32"]).model.draft_vocab, first.model.draft_vocab)
    assert "draft vocabulary of 64 is kept (draft.draft_vocab_size=32)" in capsys.readouterr().out


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one AcceleratorState per process and refuses another precision in it; a user's process runs
    one recipe, this test process many."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_bf16_mixed_precision_autocasts_the_step_and_keeps_fp32_weights(tmp_path, fresh_accelerator_state):
    data = repetitive_conversations(tmp_path / "d.jsonl", 12)
    r = build(args(tmp_path, data, "optim.max_steps=12", "optim.epochs=20", "optim.lr=0.01", "logging.log_every=1",
                   "loss=hard", "optim.mixed_precision=bf16"))
    seen = []
    loss = r.loss

    def recording_loss(batch, denominators):  # what the training step computes under
        total, terms = loss(batch, denominators)
        seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
        return total, terms

    r.loss = recording_loss
    r.train()
    assert seen and all(enabled and dtype == torch.bfloat16 for enabled, dtype in seen), seen
    assert all(p.dtype == torch.float32 for p in r.accelerator.unwrap_model(r.model).parameters())
    assert r.history[-1]["loss"] < 0.8 * r.history[0]["loss"]
    assert not torch.is_autocast_enabled("cpu")  # evaluation (and anything after the step) runs in fp32


def test_mixed_precision_is_checked():
    with pytest.raises(ValueError, match="optim.mixed_precision must be no, bf16, fp16 or null"):
        eagle_recipe.T.load_config(eagle_recipe.RecipeConfig, TINY, ["optim.mixed_precision=fp8"])


def test_train_speed_script_times_each_precision(capsys):
    import runpy
    import sys

    argv = sys.argv
    sys.argv = ["eagle_train_speed.py", "--model", "tiny:llama", "--heads", "none", "--batch", "2", "--seq", "12",
                "--ttt-steps", "2", "--repeats", "1"]
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(ROOT / "scripts/eagle_train_speed.py"), run_name="__main__")
    finally:
        sys.argv = argv
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 TTT steps" in lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == ["fp32, sparse attention", "bf16, sparse attention"]
    assert all("tokens/s" in x for x in lines[1:])


def test_group_by_length_reaches_the_recipes_batches(tmp_path):
    from selfspec.training.config import step_batches

    r = build(args(tmp_path, repetitive_conversations(tmp_path / "d.jsonl", 12), "optim.max_steps=2",
                   "optim.batch_size=2", "optim.group_by_length=true"))
    assert r.example_lengths == [len(e["input_ids"]) for e in r.train_examples]
    for step in range(r.steps_per_epoch):
        assert r._step_batches(step) == step_batches(len(r.train_examples), step, r.steps_per_epoch, r.cfg.optim,
                                                     r.accelerator, r.cfg.seed, r.example_lengths)


def test_init_from_grows_the_mlp_without_changing_what_the_drafter_computes(tmp_path):
    """A wider draft.intermediate_size with init_from widens the saved draft layer's MLP: before any step the grown
    drafter's loss is the saved one's (the new units are silent), the width is saved in its config, it trains, and
    a narrower width than the saved one is refused."""
    from eagle.model import from_pretrained

    data = repetitive_conversations(tmp_path / "d.jsonl", 12)
    first = build(args(tmp_path, data, "optim.max_steps=3", "optim.lr=0.01"))
    first.train()
    first.save_heads(first.evaluate())
    saved = tmp_path / "run" / "heads"
    narrow = first.model.layer.mlp.down_proj.in_features
    common = ["--config", str(TINY), f"output_dir={tmp_path / 'wide'}", f"data.source={data}", "data.eval_samples=2",
              "optim.max_steps=2", "optim.lr=0.01", f"init_from={saved}"]
    wide = build(common + [f"draft.intermediate_size={3 * narrow}"])
    mlp = wide.model.layer.mlp
    assert mlp.down_proj.in_features == mlp.gate_proj.out_features == 3 * narrow
    assert torch.count_nonzero(mlp.down_proj.weight[:, narrow:]) == 0
    assert torch.count_nonzero(mlp.gate_proj.weight[narrow:]) > 0  # the new units' inputs are initialised
    assert_same_loss(first, wide)
    wide.train()
    wide.save_heads(wide.evaluate())
    grown = from_pretrained(tmp_path / "wide" / "heads", first.base)
    assert grown.config.intermediate_size == 3 * narrow and grown.layer.mlp.up_proj.out_features == 3 * narrow
    assert torch.count_nonzero(grown.layer.mlp.down_proj.weight[:, narrow:]) > 0  # the new units trained
    with pytest.raises(ValueError, match="not shrink it"):
        build(["--config", str(TINY), f"output_dir={tmp_path / 'narrow'}", f"data.source={data}",
               "data.eval_samples=2", "optim.max_steps=1", f"init_from={tmp_path / 'wide' / 'heads'}",
               f"draft.intermediate_size={narrow}"])
    with pytest.raises(ValueError, match="intermediate_size must be an integer"):
        build(common + ["draft.intermediate_size=0"])
