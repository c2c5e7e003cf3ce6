"""The feature drafter in the directory format vLLM serves EAGLE-3 drafters from (vLLM ``speculators``' ``eagle3``),
and back.

    selfspec export --format speculators --heads heads/smollm2-135m-instruct-eagle3 --out OUT
    vllm serve BASE --speculative-config '{"model": "OUT", "num_speculative_tokens": 4, "method": "eagle3"}'

Layout written (what speculators' ``Eagle3Speculator`` and vLLM's ``Eagle3LlamaForCausalLM`` read):

- ``config.json``: ``speculators_model_type: eagle3``, ``architectures: [Eagle3Speculator]``,
  ``transformer_layer_config`` (the base's decoder config with one layer), ``draft_vocab_size``,
  ``norm_before_residual: false``, ``eagle_aux_hidden_state_layer_ids`` (vLLM's convention: the input of decoder
  layer ``i``, i.e. ``output_hidden_states[i]``, which is selfspec's too), and ``speculators_config`` (algorithm,
  a greedy proposal method with the drafter's depth, the verifier's name and architecture);
- ``model.safetensors``: ``fc.weight``, ``layers.0.{input_layernorm, hidden_norm, post_attention_layernorm}.weight``,
  ``layers.0.self_attn.{q,k,v,o}_proj.weight`` (q/k/v over ``2 * hidden`` inputs: ``[embedding; hidden]``),
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight`` (``[draft_vocab, hidden]``;
  a drafter sharing the base LM head gets its rows copied in), ``d2t`` (int64: target id minus draft index) and
  ``t2d`` (bool over the target vocabulary). The embedding table is the verifier's and is not written.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle.model import EagleConfig, EagleDraftModel
from selfspec.runtime.identity import base_model_identity
from selfspec.runtime.io import WEIGHTS_NAME, atomic_directory

#: speculators' field values this export writes (the eagle3 model type of speculators 0.9)
SPECULATORS_MODEL_TYPE = "eagle3"
#: base architectures whose decoder layer the speculators / vLLM eagle3 draft layer reproduces
EXPORTABLE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _layer_state(draft: EagleDraftModel) -> dict[str, torch.Tensor]:
    state = {f"layers.0.{k}": v for k, v in draft.layer.state_dict().items()}
    state["layers.0.hidden_norm.weight"] = draft.hidden_norm.weight
    return state


def speculators_state(draft: EagleDraftModel) -> dict[str, torch.Tensor]:
    """The speculators ``eagle3`` weights of ``draft`` (see the module docstring)."""
    weight, _ = draft.head_weight()
    vocab = draft.draft_vocab.cpu()
    t2d = torch.zeros(draft.config.vocab_size, dtype=torch.bool)
    t2d[vocab] = True
    state = {"fc.weight": draft.fc.weight, **_layer_state(draft), "norm.weight": draft.norm.weight,
             "lm_head.weight": weight, "d2t": vocab - torch.arange(vocab.numel()), "t2d": t2d}
    return {k: v.detach().cpu().contiguous() for k, v in state.items()}


def speculators_config(draft: EagleDraftModel, verifier: str | None = None) -> dict:
    """The speculators ``eagle3`` config of ``draft``; ``verifier``: the target model's hub id or path (default: the
    name the base model was loaded under when the drafter was trained)."""
    base = draft.base_model
    layer_config = base.config.to_diff_dict() if hasattr(base.config, "to_diff_dict") else base.config.to_dict()
    layer_config = {**layer_config, "num_hidden_layers": 1, "model_type": base.config.model_type,
                    "architectures": ["LlamaForCausalLM"] if base.config.model_type == "llama"
                    else layer_config.get("architectures")}
    identity = draft.config.base_model or base_model_identity(base)
    depth = int((draft.config.decoding or {}).get("depth", 4))
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": SPECULATORS_MODEL_TYPE,
        "transformer_layer_config": layer_config,
        "draft_vocab_size": draft.config.draft_vocab_size,
        "norm_before_residual": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": list(draft.config.aux_layers),
        "speculators_config": {
            "algorithm": SPECULATORS_MODEL_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": depth, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier or identity.get("name_or_path") or None,
                         "architectures": [identity.get("architecture") or type(base).__name__]},
        },
        "selfspec": {"base_model": identity, "accuracy": draft.config.accuracy},
    }


def export_speculators(draft: EagleDraftModel, out: str | Path, verifier: str | None = None) -> Path:
    """Write ``draft`` to ``out`` in speculators' eagle3 format, atomically (``verifier``: see
    :func:`speculators_config`).

    Raises:
        ValueError: a base architecture vLLM's EAGLE-3 drafter cannot take (its draft layer is Llama's).
    """
    from safetensors.torch import save_file

    model_type = draft.base_model.config.model_type
    if model_type not in EXPORTABLE_MODEL_TYPES:
        raise ValueError(f"speculators' eagle3 format takes drafters of {', '.join(EXPORTABLE_MODEL_TYPES)} bases; "
                         f"got {model_type!r} (decode it with selfspec instead: --draft eagle)")
    out = Path(out)
    with atomic_directory(out) as tmp:
        tmp = Path(tmp)
        (tmp / "config.json").write_text(json.dumps(speculators_config(draft, verifier), indent=2) + "\n")
        save_file(speculators_state(draft), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def import_speculators(directory: str | Path, base_model) -> EagleDraftModel:
    """A speculators ``eagle3`` directory as a selfspec drafter on ``base_model`` (weights cast to its dtype).

    Raises:
        FileNotFoundError: no config.json or model.safetensors.
        ValueError: not an eagle3 directory, more than one draft layer, or shapes that do not fit ``base_model``.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"speculators drafter file {path} does not exist")
    config = json.loads(config_path.read_text())
    if config.get("speculators_model_type") != SPECULATORS_MODEL_TYPE:
        raise ValueError(f"{config_path}: speculators_model_type {config.get('speculators_model_type')!r} is not "
                         f"{SPECULATORS_MODEL_TYPE!r}")
    layers = config.get("transformer_layer_config", {}).get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"{config_path}: {layers} draft layers; selfspec's eagle drafter has exactly one")
    state = load_file(str(weights_path))
    vocab = torch.arange(state["d2t"].numel()) + state["d2t"].long() if "d2t" in state else None
    hidden = base_model.config.hidden_size
    aux = config.get("eagle_aux_hidden_state_layer_ids")
    if aux is None:
        from eagle.model import default_aux_layers
        aux = list(default_aux_layers(base_model.config.num_hidden_layers))
    ours = EagleConfig(hidden_size=hidden, vocab_size=base_model.config.vocab_size,
                       draft_vocab_size=int(config["draft_vocab_size"]), aux_layers=aux, share_lm_head=False,
                       base_model=base_model_identity(base_model),
                       decoding={"depth": config.get("speculators_config", {}).get("proposal_methods", [{}])[0]
                                 .get("speculative_tokens", 4)})
    draft = EagleDraftModel(ours, base_model, vocab)
    mapped = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"],
              "lm_head.weight": state["lm_head.weight"], "draft_vocab": draft.draft_vocab,
              "hidden_norm.weight": state["layers.0.hidden_norm.weight"]}
    mapped.update({k.removeprefix("layers.0."): v for k, v in state.items()
                   if k.startswith("layers.0.") and k != "layers.0.hidden_norm.weight"})
    mapped = {(f"layer.{k}" if not k.startswith(("fc.", "norm.", "lm_head.", "hidden_norm.", "draft_vocab")) else k): v
              for k, v in mapped.items()}
    dtype = base_model.get_output_embeddings().weight.dtype
    try:
        draft.load_state_dict({k: (v.to(dtype) if v.is_floating_point() else v) for k, v in mapped.items()},
                              strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights_path} does not fit this base model as an eagle3 drafter: {e}") from None
    draft.refresh_shared()
    return draft.to(dtype).eval().requires_grad_(False)
