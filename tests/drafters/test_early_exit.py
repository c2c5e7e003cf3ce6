"""Early-exit classifiers and the self-draft from ``layers[:E]``: errors, save/load, the shared cache, the draft's
own computation, and greedy equality with the base model's ``generate`` across the Llama family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from decoding.generate import generate
from decoding.registry import make_drafter
from early_exit import (
    DraftPolicy,
    EarlyExitDrafter,
    ExitClassifier,
    check_supported,
    make_early_exit_drafter,
    new_classifier,
)
from selfspec.testing import LLAMA_FAMILY, attention_classifier, prefilled_state, random_prompt, snapshot, tiny_model


@pytest.mark.parametrize("exit_layer", [0, 4, -1, 7, 2.0])
def test_exit_layer_outside_range_is_a_clear_error(exit_layer):
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=r"exit_layer must be an integer in 1\.\.3"):
        new_classifier(model, exit_layer)
    with pytest.raises(ValueError, match=r"1\.\.3"):
        make_early_exit_drafter(model, exit_layer=exit_layer)


def test_unsupported_architecture_is_a_clear_error():
    with pytest.raises(ValueError, match="Llama family"):
        check_supported(tiny_model("gpt2"))
    with pytest.raises(ValueError, match="gpt2"):
        make_drafter("early-exit", tiny_model("gpt2"))


def test_sliding_window_model_is_refused():
    with pytest.raises(ValueError, match="sliding-window"):
        check_supported(tiny_model("mistral", sliding_window=16))


def test_untrained_adapter_is_the_training_free_classifier():
    model = tiny_model("llama", dtype=torch.float64)
    hidden = torch.randn(1, 5, model.config.hidden_size, dtype=torch.float64)
    plain = new_classifier(model, 2)
    adapted = new_classifier(model, 2, adapter_layers=2, own_norm=True)
    torch.testing.assert_close(adapted(hidden, model), plain(hidden, model))
    # The training-free classifier is exactly the base final norm + LM head.
    torch.testing.assert_close(plain(hidden, model), model.lm_head(model.model.norm(hidden)))


def test_save_load_round_trip(tmp_path):
    model = tiny_model("qwen2", dtype=torch.float64)
    vocab = torch.randperm(96, generator=torch.Generator().manual_seed(0))[:40]
    classifier = new_classifier(model, 3, adapter_layers=1, own_norm=True, draft_vocab=vocab)
    with torch.no_grad():
        for p in classifier.parameters():
            p.add_(0.01 * torch.randn_like(p))
    classifier.config.metrics = {"top1": 0.5}
    classifier.save_pretrained(tmp_path / "ee", model)
    names = sorted(p.name for p in (tmp_path / "ee").iterdir() if not p.name.startswith("."))
    assert names == ["README.md", "config.json", "model.safetensors"]
    loaded = ExitClassifier.from_pretrained(tmp_path / "ee", model)
    assert loaded.config.exit_layer == 3 and loaded.config.metrics == {"top1": 0.5}
    assert torch.equal(loaded.draft_vocab, vocab)
    hidden = torch.randn(2, model.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(loaded(hidden, model), classifier(hidden, model))
    # Only the classifier's own tensors are saved: never the shared LM head or norm.
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "ee" / "model.safetensors"))
    assert not any("lm_head" in k or "embed" in k for k in saved)
    drafter = make_drafter("early-exit", model, str(tmp_path / "ee"))
    assert isinstance(drafter, EarlyExitDrafter) and drafter.classifier.exit_layer == 3


def test_classifier_for_another_base_model_is_refused(tmp_path):
    model = tiny_model("llama", dtype=torch.float64)
    new_classifier(model, 2).save_pretrained(tmp_path / "ee", model)
    other = tiny_model("llama", dtype=torch.float64, hidden_size=64, intermediate_size=64)
    with pytest.raises(ValueError, match="trained for"):
        ExitClassifier.from_pretrained(tmp_path / "ee", other)
    with pytest.raises(ValueError, match="trained for"):
        make_drafter("early-exit", other, str(tmp_path / "ee"))
    from selfspec.runtime.identity import BaseModelWeightsWarning
    with pytest.warns(BaseModelWeightsWarning, match="other weights"):  # same shapes, other weights: loads
        ExitClassifier.from_pretrained(tmp_path / "ee", tiny_model("llama", dtype=torch.float64, seed=1))
    with pytest.raises(FileNotFoundError):
        ExitClassifier.from_pretrained(tmp_path / "missing", model)


@pytest.mark.parametrize("policy", [DraftPolicy.chain(5), DraftPolicy(max_depth=4, top_k=3, width=3, max_nodes=10)])
def test_cache_is_unchanged_after_propose(policy):
    model = tiny_model("llama", dtype=torch.float64)
    state = prefilled_state(model, random_prompt(9))
    before = snapshot(state.cache)
    tree = EarlyExitDrafter(model, new_classifier(model, 2), policy).propose(state)
    assert len(tree) > 1
    after = snapshot(state.cache)
    assert len(after) == len(before)
    for (k0, v0), (k1, v1) in zip(before, after):
        assert k1.shape == k0.shape and torch.equal(k0, k1) and torch.equal(v0, v1)


@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_chain_draft_is_the_truncated_model(arch):
    """Each draft token is the argmax of the classifier on the full model's own layer-E hidden state of the
    sequence so far: the shared cache gives the draft exactly the full model's shallow KV."""
    model = tiny_model(arch, dtype=torch.float64)
    ids = random_prompt(6)
    classifier = new_classifier(model, 2)
    tree = EarlyExitDrafter(model, classifier, DraftPolicy.chain(4)).propose(prefilled_state(model, ids))
    sequence = ids
    with torch.no_grad():
        for token in tree.tokens.tolist():
            hidden = model(sequence, output_hidden_states=True).hidden_states[2][:, -1]
            assert int(classifier(hidden, model).argmax(-1)) == token
            sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)


def test_tree_respects_the_policy_and_threshold():
    model = tiny_model("llama", dtype=torch.float64)
    state = prefilled_state(model, random_prompt(8))
    classifier = new_classifier(model, 3)
    tree = EarlyExitDrafter(model, classifier, DraftPolicy(max_depth=3, top_k=4, width=2, max_nodes=5)).propose(state)
    assert len(tree) <= 5 and tree.max_depth <= 3
    # Root children: the top-k ranked tokens, distinct.
    first = tree.tokens[tree.parents == -1]
    assert first.unique().numel() == first.numel()
    # A threshold nothing reaches still drafts the single best token.
    strict = EarlyExitDrafter(model, classifier, DraftPolicy(max_depth=6, top_k=2, width=2, max_nodes=12,
                                                             threshold=0.999)).propose(state)
    assert len(strict) == 1


def test_reduced_draft_vocabulary_maps_ids_back():
    model = tiny_model("llama", dtype=torch.float64)
    vocab = torch.arange(50, 96)  # the top-N list: ids far from 0..N-1 so a missed mapping shows
    classifier = new_classifier(model, 2, draft_vocab=vocab)
    tree = EarlyExitDrafter(model, classifier, DraftPolicy(max_depth=3, top_k=2, width=2, max_nodes=6)).propose(
        prefilled_state(model, random_prompt()))
    assert bool(((tree.tokens >= 50) & (tree.tokens < 96)).all())
    with pytest.raises(ValueError, match="repeat"):
        classifier.set_draft_vocab(torch.zeros(46, dtype=torch.long))


def _greedy_equal(model, drafter, ids, n):
    expected = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
    out = generate(model, drafter, ids, max_new_tokens=n)
    assert torch.equal(out.sequences, expected), (out.sequences, expected)
    return out


DRAFTS = {
    "chain": dict(exit_layer=2, max_depth=5),
    "tree": dict(exit_layer=3, max_depth=4, top_k=3, width=3, max_nodes=10),
    "threshold": dict(exit_layer=1, max_depth=6, top_k=2, threshold=0.4),
}


@pytest.mark.parametrize("draft", sorted(DRAFTS))
@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_greedy_equality(arch, draft):
    model = tiny_model(arch, dtype=torch.float64)
    out = _greedy_equal(model, make_drafter("early-exit", model, **DRAFTS[draft]), random_prompt(7), 40)
    assert out.stats.tau > 1.0  # the draft is accepted sometimes: the test exercises acceptance, not just fallback


def test_greedy_equality_reduced_vocabulary_and_adapter():
    model = tiny_model("qwen3", dtype=torch.float64)
    classifier = new_classifier(model, 2, adapter_layers=1, draft_vocab=torch.arange(10, 80))
    with torch.no_grad():
        classifier.adapter[0].linear.weight.normal_(0, 0.05)
    _greedy_equal(model, EarlyExitDrafter(model, classifier, DraftPolicy(max_depth=4, top_k=2, width=2, max_nodes=8)),
                  random_prompt(5, seed=3), 32)


@pytest.mark.parametrize("draft", ["chain", "tree"])
@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_greedy_equality_attention_adapter(arch, draft):
    model = tiny_model(arch, dtype=torch.float64)
    options = dict(DRAFTS[draft])
    # Small weights: the draft differs from the training-free one but is still accepted often enough.
    exit_layer = options.pop("exit_layer")
    classifier = attention_classifier(model, exit_layer, scale=0.02, seed=exit_layer)
    hidden = torch.randn(1, 6, model.config.hidden_size, dtype=torch.float64)
    assert not torch.allclose(classifier(hidden, model), new_classifier(model, classifier.exit_layer)(hidden, model))
    policy = DraftPolicy(max_depth=options["max_depth"], top_k=options.get("top_k", 1), width=options.get("width", 1),
                         max_nodes=options.get("max_nodes", options["max_depth"]))
    out = _greedy_equal(model, EarlyExitDrafter(model, classifier, policy), random_prompt(7), 40)
    assert out.stats.tau > 1.0


def test_attention_adapter_save_load_round_trip(tmp_path):
    model = tiny_model("qwen3", dtype=torch.float64)
    classifier = attention_classifier(model, 2, scale=0.05, seed=2, adapter_heads=2, draft_vocab=torch.arange(5, 90))
    classifier.config.policy = {"max_depth": 3, "top_k": 2}
    classifier.save_pretrained(tmp_path / "ee", model)
    names = sorted(p.name for p in (tmp_path / "ee").iterdir() if not p.name.startswith("."))
    assert names == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((tmp_path / "ee" / "config.json").read_text())
    assert config["adapter"] == "attention" and config["adapter_heads"] == 2 and config["backbone_adapter"] is None
    loaded = ExitClassifier.from_pretrained(tmp_path / "ee", model)
    assert loaded.attention.num_heads == 2 and loaded.needs_context
    for name, tensor in classifier.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    hidden = torch.randn(1, 5, model.config.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(loaded(hidden, model), classifier(hidden, model))
    drafter = make_drafter("early-exit", model, str(tmp_path / "ee"))
    assert drafter.hidden_layers == (2,) and drafter.policy.top_k == 2
    _greedy_equal(model, drafter, random_prompt(6, seed=4), 24)


def test_sampling_with_a_tree_draft_is_seeded():
    """Deterministic (top-k) drafts under speculative sampling run, and the same seed gives the same output
    (losslessness of the sampler itself is tested on its own in decoding's tests)."""
    model = tiny_model("llama", dtype=torch.float64)
    drafter = make_drafter("early-exit", model, exit_layer=2, max_depth=3, top_k=2)
    runs = [generate(model, drafter, random_prompt(), max_new_tokens=24, temperature=0.8, top_k=20, seed=7).sequences
            for _ in range(2)]
    assert torch.equal(runs[0], runs[1]) and runs[0].shape[1] == random_prompt().shape[1] + 24


def test_exit_layer_table_script(tmp_path):
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "table.md"
    subprocess.run([sys.executable, str(root / "scripts" / "exit_layer_table.py"), "--model", "tiny:llama",
                    "--stride", "1", "--num-prompts", "1", "--new-tokens", "12", "--output", str(out)],
                   check=True, cwd=root, capture_output=True, timeout=300)
    lines = out.read_text().splitlines()
    assert [line.split("|")[1].strip() for line in lines[-3:]] == ["1", "2", "3"]
    rows = json.loads(out.with_suffix(".json").read_text())
    assert all(r["shared_equal"] and r["shared_tau"] >= 1.0 for r in rows)


def test_required_acceptance_inverts_the_chain_speedup():
    from early_exit.estimates import chain_speedup, required_acceptance

    flat = required_acceptance(1.5, 0.1, 6)
    assert chain_speedup(flat, 0.1, 6)[0] >= 1.5 > chain_speedup(flat - 1e-3, 0.1, 6)[0]
    steep = required_acceptance(1.5, 0.1, 6, verify_cost=lambda n: 1 + 0.1 * (n - 1))
    assert steep > flat  # a costlier verification needs better drafts
    assert required_acceptance(1.5, 0.1, 6) < required_acceptance(1.5, 0.3, 6)  # and so does a costlier draft
    assert required_acceptance(1.5, 0.6, 6, verify_cost=lambda n: 1 + 0.2 * (n - 1)) is None  # out of reach


def test_half_precision_storage_loads_as_the_models_dtype(tmp_path):
    model = tiny_model("llama")
    vocab = torch.arange(50)
    classifier = new_classifier(model, 2, adapter_layers=1, adapter="attention", own_norm=True, draft_vocab=vocab)
    with torch.no_grad():
        for p in classifier.parameters():
            p.add_(0.05 * torch.randn_like(p))
    classifier.save_pretrained(tmp_path / "ee", model, dtype=torch.float16)
    from safetensors.torch import load_file
    saved = load_file(str(tmp_path / "ee" / "model.safetensors"))
    assert {v.dtype for k, v in saved.items() if k != "draft_vocab"} == {torch.float16}
    assert saved["draft_vocab"].dtype == torch.long and torch.equal(saved["draft_vocab"], vocab)
    loaded = ExitClassifier.from_pretrained(tmp_path / "ee", model)
    for (name, a), b in zip(loaded.state_dict().items(), classifier.state_dict().values()):
        assert a.dtype == b.dtype, name
        if a.is_floating_point():
            torch.testing.assert_close(a, b.half().float(), rtol=0, atol=0)


def test_exit_sweep_report_script(tmp_path):
    """The sweep's table from a benchmark's results.json and a cost curve: draft cost as a share of a plain step,
    and the acceptance each exit layer would need (none for a draft that costs too much)."""
    root = Path(__file__).resolve().parents[2]
    results = {"config": {"cpu": "test CPU", "num_prompts": 2, "prompts": "p.jsonl", "max_new_tokens": 8},
               "methods": {"vanilla": {"tokens_per_s": 20.0, "tau": 1.0, "speedup": 1.0},
                           "early-exit:runs/s/e2/heads": {"tokens_per_s": 10.0, "tau": 1.1, "speedup": 0.5,
                                                          "draft_ms_per_token": 5.0, "first_token_acceptance": 0.1},
                           "early-exit:runs/s/e12/heads": {"tokens_per_s": 8.0, "tau": 1.2, "speedup": 0.4,
                                                           "draft_ms_per_token": 40.0, "first_token_acceptance": 0.2}}}
    (tmp_path / "results.json").write_text(json.dumps(results))
    (tmp_path / "cost.json").write_text(json.dumps({"cpu": "test CPU", "ms": {"1": 50, "2": 55, "4": 65, "8": 95}}))
    out = subprocess.run([sys.executable, str(root / "scripts" / "exit_sweep_report.py"), str(tmp_path / "results.json"),
                          "--cost", str(tmp_path / "cost.json"), "--shapes"],
                         check=True, cwd=root, capture_output=True, text=True, timeout=300).stdout
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| early-exit")}
    assert "| 5.00 | 0.10 | 0.10 |" in rows["early-exit:runs/s/e2/heads"]  # 5 ms of a 50 ms plain step
    assert rows["early-exit:runs/s/e12/heads"].split("|")[7].strip() == "-"  # 0.8 of a step: 1.5x is out of reach
    assert "| Llama-2-7B | 32 x 4096 | 0.097 |" in out
