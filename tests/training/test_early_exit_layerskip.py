"""LayerSkip fine-tuning (``method: layerskip``): loss layers and weights, config errors, LoRA-only training, and
the saved classifier + backbone adapter: it loads onto the adapted model, drafts losslessly for it, and refuses
the plain base unless asked to merge the adapter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import early_exit.recipe as exit_recipe
from decoding.generate import generate
from decoding.registry import make_drafter
from early_exit import ExitClassifier
from early_exit.exit_loss import resolve_loss_layers
from selfspec import training as T
from selfspec.runtime.adapters import apply_backbone_adapter, resolve_backbone
from selfspec.runtime.identity import BaseModelMismatchError, base_model_identity
from selfspec.runtime.models import load_model
from selfspec.testing import early_exit_overrides

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "early_exit" / "tiny-layerskip.yaml"


def test_loss_layers_rule_and_explicit_lists():
    assert resolve_loss_layers(12, 30, loss_every=6) == [(6, 0.2), (12, 0.4), (18, 0.6), (24, 0.8), (30, 1.0)]
    # The rule always adds the exit layer and the final layer.
    assert resolve_loss_layers(5, 30, loss_every=8, weight_rule="uniform") == [(5, 1.0), (8, 1.0), (16, 1.0),
                                                                               (24, 1.0), (30, 1.0)]
    assert resolve_loss_layers(2, 4, loss_layers=[4, 2], layer_weights=[1.0, 0.25]) == [(2, 0.25), (4, 1.0)]


def test_early_exit_losses_are_the_cross_entropy_of_each_exit():
    """Layer l < L goes through the final norm and LM head; the final layer is the model's own logits (HF returns
    that state already normed, so it must not be normed twice)."""
    from early_exit.exit_loss import EarlyExitBackbone, early_exit_losses
    from selfspec.testing import tiny_model

    model = tiny_model("llama", dtype=torch.float64)
    ids = torch.randint(2, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 5:] = False
    targets = ids[:, 1:][valid]
    with torch.no_grad():
        states = EarlyExitBackbone(model.model)(ids)
        losses = early_exit_losses(states, model, valid, targets, [(2, 0.5), (4, 1.0)], chunk_size=5)
        out = model(ids, output_hidden_states=True)
        exit_logits = model.lm_head(model.model.norm(out.hidden_states[2]))
    ce = torch.nn.functional.cross_entropy
    torch.testing.assert_close(losses[0], ce(exit_logits[:, :-1][valid], targets, reduction="sum").float())
    torch.testing.assert_close(losses[1], ce(out.logits[:, :-1][valid], targets, reduction="sum").float())


@pytest.mark.parametrize("kwargs, message", [
    (dict(loss_layers=[1, 4]), "exit layer 2 must be one of the loss layers"),
    (dict(loss_layers=[2, 5]), r"integers in 1\.\.4"),
    (dict(loss_layers=[2, 2]), "repeat"),
    (dict(loss_layers=[2, 4], layer_weights=[1.0]), "2 non-negative numbers"),
    (dict(loss_layers=[2, 4], layer_weights=[1.0, -1.0]), "non-negative"),
    (dict(layer_weights=[1.0, 1.0]), "needs an explicit loss_layers"),
    (dict(loss_every=0), "loss_every must be an integer >= 1"),
    (dict(weight_rule="cubic"), "weight_rule must be one of"),
])
def test_bad_loss_layers_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve_loss_layers(2, 4, **kwargs)


@pytest.mark.parametrize("override, message", [
    ("classifier.adapter_layers=1", "layerskip trains only the backbone's LoRA"),
    ("classifier.own_norm=true", "layerskip trains only the backbone's LoRA"),
    ("layerskip.loss_layers=[1,4]", "exit layer 2 must be one of layerskip.loss_layers"),
    ("layerskip.layer_weights=[1.0]", "layer_weights needs an explicit layerskip.loss_layers"),
    ("layerskip.weight_rule=cubic", "weight_rule must be one of"),
    ("classifier.draft_vocab_size=40 loss_vocab=draft", "loss_vocab must be auto or full"),
])
def test_bad_layerskip_config_values_are_clear_errors(override, message):
    with pytest.raises(ValueError, match=message):
        T.load_config(exit_recipe.EarlyExitRecipeConfig, TINY, override.split())


def test_layerskip_trains_lora_only_and_saves_a_classifier_for_the_adapted_model(tmp_path):
    module = exit_recipe
    cfg = T.load_config(module.EarlyExitRecipeConfig, TINY, early_exit_overrides(tmp_path, "ls", **{"optim.max_steps": 2,
                                                                                       "optim.lr": 0.01}))
    run = module.EarlyExitRecipe(cfg, argv=[])
    run.setup()
    # 1. Trainable parameters: exactly the LoRA matrices of the target modules, r x (in + out) per module.
    plain, _ = load_model("tiny:llama", dtype=torch.float32)
    targets = [m for name, m in plain.named_modules() if name.split(".")[-1] in cfg.lora.target_modules]
    expected = sum(cfg.lora.r * (m.in_features + m.out_features) for m in targets)
    trainable = {n: p.numel() for n, p in run.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable) and sum(trainable.values()) == expected
    assert not list(run.classifier.parameters())
    assert not any(p.requires_grad for n, p in run.base.named_parameters() if "lora_" not in n)
    assert run.loss_layers == [(2, 0.5), (4, 1.0)]
    # 2. Two steps on the same batch: the loss goes down.
    run.train()
    losses = [r["loss"] for r in run.history]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    assert set(run.history[0]) >= {"layer2_loss", "layer4_loss"}
    run.save_heads(run.evaluate())
    run.cleanup()

    heads = tmp_path / "ls" / "heads"
    assert (heads / "backbone_adapter" / "adapter_config.json").is_file()
    config = json.loads((heads / "config.json").read_text())
    original = base_model_identity(plain)
    assert config["base_model"]["fingerprint"] == original["fingerprint"]  # the base the run started from
    assert config["backbone_adapter"]["adapted_model"]["fingerprint"] != original["fingerprint"]
    assert config["adapter_layers"] == 0 and not config["own_norm"] and config["metrics"]["steps"] == 2

    # 3. The plain base is refused, with the way out in the message.
    with pytest.raises(BaseModelMismatchError, match="merge_adapter=True"):
        ExitClassifier.from_pretrained(heads, plain)
    with pytest.raises(BaseModelMismatchError, match="LoRA adapter"):
        make_drafter("early-exit", plain, str(heads))

    # 4. The adapted model really differs from the base (the LoRA weights moved), and is what the run recorded.
    adapted, _ = load_model("tiny:llama", dtype=torch.float32)
    adapted = apply_backbone_adapter(adapted, heads, config["backbone_adapter"], config["base_model"], what="test")
    ids = torch.tensor([[2, 40, 41, 42, 43, 44]])
    with torch.no_grad():
        assert (adapted(ids).logits - plain(ids).logits).abs().max() > 1e-2
    assert base_model_identity(adapted)["fingerprint"] == config["backbone_adapter"]["adapted_model"]["fingerprint"]
    assert resolve_backbone(adapted, heads, config["base_model"], what="test") is adapted

    # 5. The drafter on the adapted model reproduces the adapted model's own greedy output.
    drafter = make_drafter("early-exit", adapted, str(heads))
    assert drafter.classifier.exit_layer == 2
    expected = adapted.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert not torch.equal(expected, plain.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0))
    assert torch.equal(generate(adapted, drafter, ids, max_new_tokens=24).sequences, expected)

    # 6. merge_adapter=True merges the adapter into a plain base in place: it becomes the adapted model.
    merged, _ = load_model("tiny:llama", dtype=torch.float32)
    drafter = make_drafter("early-exit", merged, str(heads), merge_adapter=True)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits)
    assert torch.equal(generate(merged, drafter, ids, max_new_tokens=24).sequences, expected)


# ---------------------------------------------------------------- layer dropout (LayerSkip's training recipe)
def test_layer_dropout_rates_follow_the_layerskip_scale():
    from early_exit.layer_dropout import dropout_rates

    exp = dropout_rates(4, 0.2, "exp")
    assert exp[0] == 0.0 and exp[-1] == pytest.approx(0.2)
    assert exp[1] == pytest.approx(0.2 * (2 ** (1 / 3) - 1)) and exp[2] == pytest.approx(0.2 * (2 ** (2 / 3) - 1))
    assert dropout_rates(5, 0.4, "linear") == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert dropout_rates(3, 0.3, "uniform") == pytest.approx([0.3] * 3)
    for p_max, scale, message in ((1.0, "exp", r"probability in \[0, 1\)"), (-0.1, "exp", "probability"),
                                  (0.1, "cubic", "exp, linear, uniform")):
        with pytest.raises(ValueError, match=message):
            dropout_rates(4, p_max, scale)


def test_layer_dropout_skips_layers_per_row_in_training_only():
    """A dropped layer passes its input through for that row; evaluation (and decoding) sees the whole model; the
    rows dropped are a function of the step, and their share follows the rate."""
    from early_exit.layer_dropout import LayerDropout
    from selfspec.testing import tiny_model

    model = tiny_model("llama", dtype=torch.float64).eval()
    ids = torch.randint(2, 96, (3, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids).logits
        without = model.model.layers[2]
        model.model.layers = torch.nn.ModuleList([m for m in model.model.layers if m is not without])
        model.config.num_hidden_layers -= 1
        skipped = model(ids, use_cache=False).logits
    model = tiny_model("llama", dtype=torch.float64)
    dropout = LayerDropout(model.model.layers, [0.0, 0.0, 0.9999, 0.0], seed=3)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids).logits, full, rtol=0, atol=0)  # eval: no dropout
        assert dropout.dropped == [0, 0, 0, 0]
        torch.testing.assert_close(model.train()(ids).logits, skipped, rtol=0, atol=0)  # every row skips layer 2
        assert dropout.dropped == [0, 0, 3, 0]
    dropout.remove()
    with torch.no_grad():
        torch.testing.assert_close(model.train()(ids).logits, full, rtol=0, atol=0)

    half = LayerDropout(model.model.layers, [0.5] * 4, seed=3)
    draws = []
    for step in (0, 1, 0):
        half.set_step(step)
        half.dropped = [0] * 4
        with torch.no_grad():
            model.train()(torch.randint(2, 96, (100, 3)))
        draws.append(list(half.dropped))
    assert draws[0] == draws[2] != draws[1]  # same step, same rows; another step, others
    assert all(30 <= d <= 70 for d in draws[0] + draws[1]), draws
    half.remove()


def test_layerskip_with_layer_dropout_trains_and_resumes_exactly(tmp_path):
    """The tiny LayerSkip config drops layers (p_max 0.2): the loss differs from a run without dropout, and a run
    stopped at step 2 and resumed to 4 ends with the same adapter as a straight run to 4."""
    from safetensors.torch import load_file

    def run(out, *extra, resume=False):
        return exit_recipe.main(["--config", str(TINY), *(["--resume"] if resume else []),
                                 *early_exit_overrides(tmp_path, out, **{"optim.lr": 0.01, **dict(extra)})])

    with_dropout = run("drop", ("optim.max_steps", 4))
    without = run("plain", ("optim.max_steps", 4), ("layerskip.layer_dropout", 0.0))
    assert [r["loss"] for r in with_dropout["history"]] != [r["loss"] for r in without["history"]]
    run("resumed", ("optim.max_steps", 2))
    run("resumed", ("optim.max_steps", 4), resume=True)
    name = "backbone_adapter/adapter_model.safetensors"
    straight = load_file(str(tmp_path / "drop" / "heads" / name))
    resumed = load_file(str(tmp_path / "resumed" / "heads" / name))
    assert straight.keys() == resumed.keys()
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=0)
