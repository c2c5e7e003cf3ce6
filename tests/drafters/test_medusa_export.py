"""selfspec export --format vllm-medusa: the layout vLLM's Medusa drafter loads, refusals for heads it cannot run,
and export -> import giving the same drafts."""

from __future__ import annotations

import json

import pytest
import torch

from decoding.generate import generate
from medusa.drafter import MedusaDrafter
from medusa.export import export_vllm_medusa, import_vllm_medusa
from medusa.heads import MedusaHeads
from selfspec.runtime.tiny import tiny_model
from selfspec.testing import greedy_reference, random_prompt, randomize_heads, sequential_heads


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


# Parameter names and shapes of vLLM's Medusa (vllm/model_executor/models/medusa.py: ResidualBlock layers
# "blocks.{h}.layers.{l}" with bias when medusa_fc_bias, ParallelLMHead "lm_heads.{h}"; load_weights maps
# lm_heads.0.weight to the single lm_head when original_lm_head, and reads token_map when the vocabulary is truncated).
def vllm_expected(num_heads, num_layers, hidden, vocab, shared, truncated):
    shapes = {}
    for h in range(num_heads):
        for layer in range(num_layers):
            shapes[f"blocks.{h}.layers.{layer}.weight"] = (hidden, hidden)
            shapes[f"blocks.{h}.layers.{layer}.bias"] = (hidden,)
        if not shared:
            shapes[f"lm_heads.{h}.weight"] = (vocab, hidden)
    if shared:
        shapes["lm_heads.0.weight"] = (vocab, hidden)
    if truncated:
        shapes["token_map"] = (truncated,)
    return shapes


@pytest.mark.parametrize("shared, draft_vocab, layers", [(True, None, 1), (True, 40, 2), (False, None, 1)])
def test_export_has_vllms_layout_and_imports_back_to_the_same_drafts(llama, tmp_path, shared, draft_vocab, layers):
    heads = randomize_heads(MedusaHeads.for_model(llama, num_heads=3, num_layers=layers, share_lm_head=shared,
                                                  draft_vocab_size=draft_vocab), scale=0.1, seed=3)
    if draft_vocab:
        heads.set_draft_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(1))[:draft_vocab])
    export_vllm_medusa(heads, tmp_path / "v")
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "v" / "model.safetensors"))
    c = llama.config
    assert {k: tuple(v.shape) for k, v in state.items()} == vllm_expected(3, layers, c.hidden_size, c.vocab_size,
                                                                          shared, draft_vocab)
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert config["model_type"] == "medusa" and config["architectures"] == ["MedusaModel"]
    assert (config["num_heads"], config["num_hidden_layers"], config["original_lm_head"]) == (3, layers, shared)
    assert config["truncated_vocab_size"] == (draft_vocab or c.vocab_size) and config["medusa_fc_bias"] is True

    back = import_vllm_medusa(tmp_path / "v", llama)
    hidden = torch.randn(1, 5, c.hidden_size)
    with torch.no_grad():
        a, b = heads.features(hidden), back.features(hidden)
        torch.testing.assert_close(a, b)
        for k in range(3):
            la, ca = heads.head_draft_logits(a[k], k)
            lb, cb = back.head_draft_logits(b[k], k)
            torch.testing.assert_close(la, lb)
            assert (ca is None and cb is None) or torch.equal(ca, cb)
    tree = [[0], [1], [0, 0], [0, 0, 0]]
    ids = random_prompt(7, seed=2)
    outs = [generate(llama, MedusaDrafter(h, tree=tree), ids, max_new_tokens=16) for h in (heads, back)]
    assert all(torch.equal(o.sequences, greedy_reference(llama, ids, 16)) for o in outs)
    assert outs[0].stats.accepted_per_step == outs[1].stats.accepted_per_step


def test_heads_vllm_cannot_run_are_refused_naming_the_alternative(llama, tmp_path):
    with pytest.raises(ValueError, match="parallel heads only.*--format speculators"):
        export_vllm_medusa(sequential_heads(llama), tmp_path / "s")
    assert not (tmp_path / "s").exists()


def test_export_command_takes_medusa_heads_and_refuses_the_wrong_format(tmp_path, capsys):
    from selfspec.cli import main as cli
    from selfspec.runtime.models import load_model

    model, _ = load_model("tiny:llama")
    randomize_heads(MedusaHeads.for_model(model, num_heads=2), seed=1).save_pretrained(tmp_path / "h")
    assert cli(["export", "--format", "vllm-medusa", "--heads", str(tmp_path / "h"), "--out", str(tmp_path / "o"),
                "--model", "tiny:llama"]) == 0
    assert json.loads((tmp_path / "o" / "config.json").read_text())["num_heads"] == 2
    capsys.readouterr()
    assert cli(["export", "--format", "speculators", "--heads", str(tmp_path / "h"), "--out", str(tmp_path / "x"),
                "--model", "tiny:llama"]) == 2
    assert "not an EAGLE-3 feature drafter" in capsys.readouterr().err and not (tmp_path / "x").exists()


@pytest.mark.parametrize("suffix, prefix", [("safetensors", ""), ("pt", "medusa_head.")])
def test_fasterdecoding_checkpoints_load_with_medusa_load_and_decode_losslessly(llama, tmp_path, suffix, prefix):
    """A directory in FasterDecoding/Medusa's exact layout (config medusa_num_heads / medusa_num_layers; per head
    ``{h}.{l}.linear.weight|bias`` ResBlocks and ``{h}.{L}.weight`` LM head; Medusa-2's ``medusa_head.`` prefix)."""
    import medusa

    c = llama.config
    g = torch.Generator().manual_seed(5)
    heads, layers = 3, 2
    state = {}
    for h in range(heads):
        for layer in range(layers):
            state[f"{prefix}{h}.{layer}.linear.weight"] = torch.randn(c.hidden_size, c.hidden_size, generator=g) * 0.05
            state[f"{prefix}{h}.{layer}.linear.bias"] = torch.randn(c.hidden_size, generator=g) * 0.05
        state[f"{prefix}{h}.{layers}.weight"] = llama.lm_head.weight.detach() + 0.01 * torch.randn(
            c.vocab_size, c.hidden_size, generator=g)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                      "base_model_name_or_path": "tiny-llama"}))
    if suffix == "safetensors":
        from safetensors.torch import save_file
        save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    else:
        torch.save(state, tmp_path / "medusa_lm_head.pt")
    drafter = medusa.load(llama, tmp_path, tree=[[0], [1], [0, 0], [0, 0, 0]])
    loaded = drafter.heads
    hidden = torch.randn(1, 4, c.hidden_size, generator=g)
    with torch.no_grad():  # head h = ResBlocks then its own LM head, as FasterDecoding computes it
        for h in range(heads):
            x = hidden
            for layer in range(layers):
                x = x + torch.nn.functional.silu(x @ state[f"{prefix}{h}.{layer}.linear.weight"].T
                                                 + state[f"{prefix}{h}.{layer}.linear.bias"])
            expected = x @ state[f"{prefix}{h}.{layers}.weight"].T
            got, _ = loaded.head_draft_logits(loaded.features(hidden)[h], h)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    ids = random_prompt(6, seed=3)
    assert torch.equal(generate(llama, drafter, ids, max_new_tokens=16).sequences, greedy_reference(llama, ids, 16))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": layers}))
    with pytest.raises(ValueError, match="does not fit this base model as 5 Medusa heads"):
        medusa.load(llama, tmp_path)
