"""train/medusa.py on a tiny random Llama: smoke tests per recipe, trainable-parameter contracts, bad input before
training, 1 vs 2 processes, and kill -9 + --resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import medusa.recipe as medusa_recipe
from selfspec.runtime.kernels import linear_backend_of
from selfspec.runtime.models import load_model
from selfspec.testing import assert_same_run, launch_recipe, logged_losses, repetitive_conversations

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "train/medusa.py"
TINY = ROOT / "configs/medusa/tiny.yaml"


@pytest.fixture(scope="module")
def recipe():
    return medusa_recipe


def args(tmp_path: Path, data: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY), f"output_dir={tmp_path / 'run'}", f"data.source={data}", "data.eval_samples=2",
            *extra]


def run_recipe(recipe, argv):
    parsed = recipe.T.parse_recipe_args(argv, "test")
    r = recipe.MedusaRecipe(recipe.T.load_config(recipe.RecipeConfig, parsed.config, parsed.overrides), parsed.resume)
    r.setup()
    r.train()
    return r


@pytest.mark.parametrize("method, extra", [("medusa1", []), ("medusa1", ["cache_hidden_states=false"]),
                                           ("medusa2", ["heads_warmup_steps=0"]), ("medusa2", ["base_loss=kl"])])
def test_two_steps_on_a_repeated_batch_lower_the_loss(recipe, tmp_path, method, extra):
    # 6 examples, 2 held out, batch 4: every step sees the same 4 examples.
    data = repetitive_conversations(tmp_path / "d.jsonl", 6)
    r = run_recipe(recipe, args(tmp_path, data, f"method={method}", "optim.max_steps=2", "optim.epochs=2", *extra))
    first, second = (h["loss"] for h in r.history)
    assert second < first, r.history
    if method == "medusa2" and "base_loss=kl" in extra:
        # LoRA starts as the identity (B = 0): the adapted model is the frozen one, KL exactly 0, then it moves.
        assert r.history[0]["base_loss"] == pytest.approx(0, abs=1e-6) and r.history[1]["base_loss"] >= 0
    elif method == "medusa2":
        assert all(h["base_loss"] > 0 for h in r.history)


def test_trainable_parameters_are_exactly_the_recipes(recipe, tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 6)
    r1 = run_recipe(recipe, args(tmp_path, data, "optim.max_steps=1"))
    names = {n for n, p in r1.model.named_parameters() if p.requires_grad}
    assert names == {"heads.resblock_weight", "heads.resblock_bias"}
    r2 = run_recipe(recipe, args(tmp_path, data, "method=medusa2", "optim.max_steps=1", f"output_dir={tmp_path / 'm2'}"))
    names = {n for n, p in r2.model.named_parameters() if p.requires_grad}
    assert {"heads.resblock_weight", "heads.resblock_bias"} < names
    # the adapted base's forwards carry gradients: back on stock kernels, whatever optim.base_linear_backend chose
    assert r2.base_backend == "stock" and linear_backend_of(r2.base) == "stock"
    assert all("lora_" in n for n in names - {"heads.resblock_weight", "heads.resblock_bias"})
    r2.model.backbone.layers[0].mlp.up_proj.weight.requires_grad_(True)
    with pytest.raises(AssertionError, match="LoRA"):
        r2._check_trainable()


def test_cached_hidden_states_give_the_same_loss_as_running_the_base(recipe, tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 10)
    cached = run_recipe(recipe, args(tmp_path, data, "optim.max_steps=2", f"output_dir={tmp_path / 'a'}"))
    live = run_recipe(recipe, args(tmp_path, data, "optim.max_steps=2", "cache_hidden_states=false",
                                   f"output_dir={tmp_path / 'b'}"))
    for a, b in zip(cached.history, live.history):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)


def test_main_saves_loadable_heads_with_accuracies(recipe, tmp_path):
    from medusa.heads import MedusaHeads
    data = repetitive_conversations(tmp_path / "d.jsonl", 10)
    metrics = recipe.main(args(tmp_path, data, "optim.max_steps=3"))
    heads_dir = tmp_path / "run" / "heads"
    model, _ = load_model("tiny:llama")
    heads = MedusaHeads.from_pretrained(heads_dir, model)
    torch.testing.assert_close(torch.tensor(heads.config.head_accuracy), torch.tensor(metrics["head_accuracy"]))
    assert len(heads.config.head_accuracy) == 3 and all(len(row) == 10 for row in heads.config.head_accuracy)
    assert all(0 <= sum(row) <= 1 for row in heads.config.head_accuracy)
    assert heads.config.tree and heads.config.training["command"].endswith("optim.max_steps=3")
    assert "top-1" in (heads_dir / "README.md").read_text()
    assert set(load_file(str(heads_dir / "model.safetensors"))) == {"resblock_weight", "resblock_bias"}


def test_medusa2_heads_carry_their_adapter_and_decode_the_adapted_model_losslessly(recipe, tmp_path, capsys):
    import decoding
    import medusa
    from selfspec.runtime.identity import BaseModelMismatchError
    from selfspec.runtime.models import load_model

    # A local base directory, so that the heads record a name load_model can resolve again.
    base, tokenizer = load_model("tiny:llama")
    base_dir = tmp_path / "base"
    base.save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    data = repetitive_conversations(tmp_path / "d.jsonl", 10)
    recipe.main(args(tmp_path, data, f"model={base_dir}", "method=medusa2", "optim.max_steps=3", "optim.lr=0.05",
                     "lora.target_modules=[q_proj,v_proj,o_proj]"))
    heads_dir = tmp_path / "run" / "heads"
    assert (heads_dir / "backbone_adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "run" / "lora").exists()
    config = medusa.MedusaConfig.load(heads_dir)
    assert config.backbone_adapter["path"] == "backbone_adapter"
    assert config.backbone_adapter["adapted_model"]["fingerprint"] != config.base_model["fingerprint"]
    assert "Medusa-2" in (heads_dir / "README.md").read_text()

    plain, _ = load_model(str(base_dir))
    with pytest.raises(BaseModelMismatchError, match="LoRA adapter.*load_model"):
        medusa.load(plain, heads_dir)
    other, _ = load_model("tiny:qwen2")
    with pytest.raises(BaseModelMismatchError):
        medusa.load(other, heads_dir, merge_adapter=True)

    adapted, _ = load_model(str(heads_dir))  # base + merged adapter
    prompt = torch.tensor([tokenizer("<|im_start|>user\nsay 3<|im_end|>\n<|im_start|>assistant\n")["input_ids"]])
    expected = adapted.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24)
    # The LoRA really moved the model: the plain base writes another continuation.
    assert plain.generate(prompt, max_new_tokens=24, do_sample=False, min_new_tokens=24).tolist() != expected.tolist()
    merged_in_place = medusa.load(plain, heads_dir, merge_adapter=True)  # plain is now the adapted model
    drafter = medusa.load(adapted, heads_dir, tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    for model, d in ((adapted, drafter), (plain, merged_in_place)):
        out = decoding.generate(model, d, prompt, max_new_tokens=24, eos_token_id=None)
        assert out.sequences.tolist() == expected.tolist()

    # The command line needs no --model: Medusa-2 heads name the adapted model they decode.
    from selfspec.cli import main as cli
    from selfspec.runtime.prompts import encode_prompt
    assert cli(["generate", "--draft", "medusa", "--heads", str(heads_dir), "--prompt", "say 3", "--max-new-tokens",
                "10", "--json"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = encode_prompt(tokenizer, "say 3")
    reference = adapted.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    assert record["token_ids"] == reference[0, ids.shape[1]:].tolist()
    # Drafters joined by '+' propose one merged tree; an unknown name is refused before anything loads.
    assert cli(["generate", "--draft", "medusa+lookup", "--heads", str(heads_dir), "--prompt", "say 3",
                "--max-new-tokens", "10", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"] == record["token_ids"]
    with pytest.raises(SystemExit):
        cli(["generate", "--draft", "medusa+bogus", "--prompt", "say 3"])
    assert "unknown drafter 'bogus'" in capsys.readouterr().err


def test_draft_vocabulary_comes_from_the_training_data_and_accuracy_is_measured_within_it(recipe, tmp_path):
    from medusa.heads import MedusaHeads
    data = repetitive_conversations(tmp_path / "d.jsonl", 10)
    metrics = recipe.main(args(tmp_path, data, "optim.max_steps=2", "heads.draft_vocab_size=30"))
    model, tokenizer = load_model("tiny:llama")
    heads = MedusaHeads.from_pretrained(tmp_path / "run" / "heads", model)
    trained = {t for line in data.read_text().splitlines()
               for t in tokenizer(json.loads(line)["conversations"][1]["value"])["input_ids"]}
    # The replies use few distinct byte tokens: all of them are in the 30 most frequent trained tokens.
    assert len(trained) < 30 and trained <= set(heads.draft_vocab.tolist())
    assert 0.9 <= metrics["draft_vocab_coverage"] <= 1.0
    assert heads.config.training["metrics"]["draft_vocab_coverage"] == metrics["draft_vocab_coverage"]


def test_draft_vocabulary_loss_trains_on_its_own_rows(recipe, tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 6)
    r = run_recipe(recipe, args(tmp_path, data, "heads.draft_vocab_size=12", "optim.max_steps=2", "optim.epochs=2"))
    first, second = (h["loss"] for h in r.history)
    assert second < first, r.history
    heads = r.model.heads
    batch = r.make_batch(list(range(4)))
    rows, cols, targets, weight, bias = r.loss_targets(batch, 0)
    _, _, all_targets = recipe.head_targets(batch, 0)
    kept = [t for t in all_targets.tolist() if t in set(heads.draft_vocab.tolist())]
    assert 0 < len(kept) < len(all_targets)  # 12 rows do not cover every trained token: some targets are dropped
    assert heads.draft_vocab[targets].tolist() == kept and bias is None
    torch.testing.assert_close(weight, heads.shared_lm_head.weight[heads.draft_vocab])
    full = run_recipe(recipe, args(tmp_path, data, "heads.draft_vocab_size=12", "loss_vocab=full", "optim.max_steps=1",
                                   f"output_dir={tmp_path / 'full'}"))
    assert full.draft_rows is None and len(full.loss_targets(batch, 0)[2]) == len(all_targets)
    with pytest.raises(ValueError, match="loss_vocab: draft needs heads.draft_vocab_size"):
        run_recipe(recipe, args(tmp_path, data, "loss_vocab=draft", f"output_dir={tmp_path / 'bad'}"))


def test_a_resume_on_changed_data_trains_through_the_checkpoints_draft_vocabulary(recipe, tmp_path):
    first = repetitive_conversations(tmp_path / "a.jsonl", 8)
    other = repetitive_conversations(tmp_path / "b.jsonl", 8, seed=1, words=["zebra", "quiz", "jumps", "vex"])
    vocab = "heads.draft_vocab_size=16"
    recipe.main(args(tmp_path, first, vocab, "optim.max_steps=2", "logging.save_every=1"))
    saved = load_file(str(tmp_path / "run/heads/model.safetensors"))["draft_vocab"]
    r = recipe.MedusaRecipe.from_command_line(
        [*args(tmp_path, other, vocab, "optim.max_steps=3", "logging.save_every=1"),
         "--resume", "--allow-changed", "data.source"], "test")
    r.setup()
    heads = r.model.heads
    assert r.step > 0 and torch.equal(heads.draft_vocab, saved)
    torch.testing.assert_close(r.draft_rows, heads.shared_lm_head.weight[saved])
    assert torch.equal(r.to_draft[saved], torch.arange(16)) and int((r.to_draft >= 0).sum()) == 16
    fresh = run_recipe(recipe, args(tmp_path, other, vocab, "optim.max_steps=1", f"output_dir={tmp_path / 'fresh'}"))
    assert not torch.equal(fresh.model.heads.draft_vocab, saved)  # the other data counts other tokens


def assert_lossless_tiny_llama(recipe, heads_dir):
    """Saved heads decode the tiny Llama exactly as its own greedy ``generate``; returns the drafter."""
    import decoding
    import medusa
    model, _ = load_model("tiny:llama")
    drafter = medusa.load(model, heads_dir, tree=8)
    ids = torch.tensor([[1, 17, 4, 33, 8]])
    out = decoding.generate(model, drafter, ids, max_new_tokens=20)
    reference = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                               min_new_tokens=20, pad_token_id=0)
    assert out.sequences.tolist() == reference.tolist()
    return drafter


def test_sequential_heads_train_save_and_decode_losslessly(recipe, tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 6)
    r = run_recipe(recipe, args(tmp_path, data, "heads.sequential=true", "optim.max_steps=2", "optim.epochs=2"))
    first, second = (h["loss"] for h in r.history)
    assert second < first, r.history
    names = {n for n, p in r.model.named_parameters() if p.requires_grad}
    assert names == {"heads.resblock_weight", "heads.resblock_bias", "heads.token_weight"}
    assert float(r.model.heads.token_weight.detach().abs().sum()) > 0  # the token projection did learn
    recipe.main(args(tmp_path, data, "heads.sequential=true", "optim.max_steps=3", f"output_dir={tmp_path / 's'}"))
    heads_dir = tmp_path / "s" / "heads"
    assert set(load_file(str(heads_dir / "model.safetensors"))) == {"resblock_weight", "resblock_bias", "token_weight"}
    drafter = assert_lossless_tiny_llama(recipe, heads_dir)
    assert drafter.plan is not None


def test_prefix_attention_with_distillation_trains_saves_and_decodes_losslessly(recipe, tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 6)
    overrides = ["heads.sequential=true", "heads.prefix_attention=true", "heads.prefix_mlp_size=16",
                 "distill_weight=0.5"]
    r = run_recipe(recipe, args(tmp_path, data, *overrides, "optim.max_steps=2", "optim.epochs=2"))
    first, second = (h["loss"] for h in r.history)
    assert second < first, r.history
    names = {n for n, p in r.model.named_parameters() if p.requires_grad}
    assert {"heads.token_weight", "heads.prefix.q_proj.weight", "heads.prefix.o_proj.weight",
            "heads.prefix.down_proj.weight"} <= names and not any(n.startswith("backbone") for n in names)
    assert float(r.model.heads.prefix.o_proj.weight.detach().abs().sum()) > 0  # left its zero initialisation
    recipe.main(args(tmp_path, data, *overrides, "optim.max_steps=3", f"output_dir={tmp_path / 's'}"))
    heads_dir = tmp_path / "s" / "heads"
    drafter = assert_lossless_tiny_llama(recipe, heads_dir)
    assert drafter.context_cache is not None and drafter.heads.config.prefix_mlp_size == 16


def test_distillation_term_is_the_kl_to_the_base_distribution(recipe, tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 6)
    ce = run_recipe(recipe, args(tmp_path, data, "optim.max_steps=1", "optim.lr=0"))
    kl = run_recipe(recipe, args(tmp_path, data, "optim.max_steps=1", "optim.lr=0", "distill_weight=1.0",
                                 f"output_dir={tmp_path / 'kl'}"))
    batch = kl.make_batch(list(range(4)))
    _, terms = kl.loss(batch, kl.counts(batch))
    # Zero-initialised heads predict the base's next token from h_t; the KL compares that with the base's own
    # distribution one position later, computed independently here.
    hidden = kl.model.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    rows, cols, _ = recipe.head_targets(batch, 0)
    lm = kl.base.get_output_embeddings()
    log_q = torch.log_softmax(lm(hidden[rows, cols]), -1)
    log_p = torch.log_softmax(lm(hidden[rows, cols + 1]), -1)
    expected = (log_p.exp() * (log_p - log_q)).sum() / kl.counts(batch)[0]
    torch.testing.assert_close(terms[0], expected.float(), rtol=1e-4, atol=1e-6)
    assert ce.history[0]["loss"] != kl.history[0]["loss"]
    with pytest.raises(ValueError, match="distill_weight must be in"):
        run_recipe(recipe, args(tmp_path, data, "distill_weight=1.5", f"output_dir={tmp_path / 'bad'}"))


# ---------------------------------------------------------------- bad input fails before training

@pytest.mark.parametrize("rows, message", [
    ([], "empty"),
    ([{"question": "q", "answer": "a"}], "unknown dataset format"),
    ([{"conversations": [{"from": "human", "value": "hi"}]}], "no assistant turn"),
])
def test_bad_data_fails_before_training(recipe, tmp_path, rows, message):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=message):
        recipe.main(args(tmp_path, data))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_num_heads_below_one_fails_before_training(recipe, tmp_path):
    with pytest.raises(ValueError, match="num_heads must be an integer >= 1"):
        recipe.main(args(tmp_path, tmp_path / "unused.jsonl", "heads.num_heads=0"))


# ---------------------------------------------------------------- processes, kill and resume (subprocesses)

def launch(argv: list[str], **kwargs):
    return launch_recipe(SCRIPT, argv, **kwargs)



@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 18)
    common = ["optim.max_steps=3", "data.eval_samples=2"]
    launch(args(tmp_path, data, *common, "optim.batch_size=4", f"output_dir={tmp_path / 'one'}"))
    two = launch(args(tmp_path, data, *common, "optim.batch_size=2", f"output_dir={tmp_path / 'two'}"), processes=2)
    assert "2 processes" in two.stdout
    assert logged_losses(tmp_path / "one") == pytest.approx(logged_losses(tmp_path / "two"), rel=1e-4)
    one = load_file(str(tmp_path / "one/heads/model.safetensors"))
    two = load_file(str(tmp_path / "two/heads/model.safetensors"))
    for name in one:
        torch.testing.assert_close(one[name], two[name], rtol=1e-4, atol=1e-5)


# Runs the recipe, but SIGKILLs itself in the middle of writing the second checkpoint (state files written, the
# directory not yet complete): the harshest moment to die.
KILL_DURING_SECOND_CHECKPOINT = """
import os, runpy, signal, sys
import accelerate
save_state, calls = accelerate.Accelerator.save_state, []
def dying_save_state(self, output_dir=None, **kwargs):
    calls.append(output_dir)
    result = save_state(self, output_dir, **kwargs)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return result
accelerate.Accelerator.save_state = dying_save_state
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


@pytest.mark.slow
def test_kill_9_then_resume_ends_with_the_same_heads(tmp_path):
    from selfspec.runtime.io import is_complete
    data = repetitive_conversations(tmp_path / "d.jsonl", 14)
    common = ["optim.max_steps=6", "optim.schedule=cosine", "optim.warmup_steps=1", "logging.save_every=2",
              "data.eval_samples=2"]
    launch(args(tmp_path, data, *common, f"output_dir={tmp_path / 'straight'}"))
    killed = args(tmp_path, data, *common, f"output_dir={tmp_path / 'killed'}")
    result = launch(killed, wrapper=KILL_DURING_SECOND_CHECKPOINT.format(script=str(SCRIPT)), check=False)
    assert result.returncode == -9, result.stderr[-3000:]
    checkpoints = tmp_path / "killed" / "checkpoints"
    visible = sorted(p.name for p in checkpoints.iterdir() if not p.name.startswith("."))
    assert visible == ["step-00000002"] and is_complete(checkpoints / visible[0])
    assert any(p.name.startswith(".step-00000004") for p in checkpoints.iterdir())  # the half-written one, hidden
    assert not (tmp_path / "killed" / "heads").exists()
    launch([*killed, "--resume"])
    assert_same_run(tmp_path / "straight", tmp_path / "killed", last_losses=2)
    assert all(is_complete(p) for p in checkpoints.iterdir() if not p.name.startswith("."))


@pytest.mark.parametrize("weight_grad", [False, True])
def test_chunked_cross_entropy_matches_the_plain_loss_and_gradients(weight_grad):
    from selfspec.training import chunked_cross_entropy
    g = torch.Generator().manual_seed(0)
    features = torch.randn(37, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, generator=g, dtype=torch.float64, requires_grad=weight_grad)
    bias = torch.randn(50, generator=g, dtype=torch.float64, requires_grad=weight_grad)
    targets = torch.randint(50, (37,), generator=g)
    plain = torch.nn.functional.cross_entropy(features @ weight.T + bias, targets, reduction="sum")
    expected = torch.autograd.grad(3 * plain, [features, weight, bias] if weight_grad else [features])
    chunked = chunked_cross_entropy(features, weight, targets, chunk_size=10, bias=bias)
    got = torch.autograd.grad(3 * chunked, [features, weight, bias] if weight_grad else [features])
    torch.testing.assert_close(chunked.double(), plain, rtol=1e-6, atol=1e-6)
    for e, a in zip(expected, got):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)  # logits are formed in float32


@pytest.mark.slow
def test_wandb_logs_offline_without_an_account(tmp_path):
    data = repetitive_conversations(tmp_path / "d.jsonl", 8)
    env_free = {k: v for k, v in os.environ.items() if not k.startswith("WANDB")}
    result = subprocess.run([sys.executable, str(SCRIPT), *args(tmp_path, data, "optim.max_steps=2",
                                                               "logging.report_to=wandb")],
                            cwd=ROOT, env={**env_free, "WANDB_SILENT": "true"}, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
