"""The feature drafter in the directory formats serving engines load EAGLE-3 drafters from, and back.

    selfspec export --format speculators --heads heads/smollm2-135m-instruct-eagle3 --out OUT
    vllm serve BASE --speculative-config '{"model": "OUT", "num_speculative_tokens": 4, "method": "eagle3"}'

    selfspec export --format eagle3 --heads heads/smollm2-135m-instruct-eagle3 --out OUT
    python -m sglang.launch_server --model BASE --speculative-algorithm EAGLE3 --speculative-draft-model-path OUT

Either directory also loads back as a selfspec drafter (``--draft eagle:OUT``; :func:`load_drafter` tells the
formats apart).

**speculators** (vLLM ``speculators``' ``eagle3``). Layout written (what speculators' ``Eagle3Speculator`` and vLLM's ``Eagle3LlamaForCausalLM`` read):

- ``config.json``: ``speculators_model_type: eagle3``, ``architectures: [Eagle3Speculator]``,
  ``transformer_layer_config`` (the base's decoder config with one layer), ``draft_vocab_size``,
  ``norm_before_residual: false``, ``eagle_aux_hidden_state_layer_ids`` (vLLM's convention: the input of decoder
  layer ``i``, i.e. ``output_hidden_states[i]``, which is selfspec's too), and ``speculators_config`` (algorithm,
  a greedy proposal method with the depth of the drafter's tree for a GPU, ``decoding_by_machine["cuda"]``, where
  it has one, else of its default; the verifier's name and architecture), and a ``selfspec`` block (base identity,
  accuracy, and the drafting it saved: the default and the trees per kind of machine, which an import restores;
  engines ignore it);
- ``model.safetensors``: ``fc.weight``, ``layers.0.{input_layernorm, hidden_norm, post_attention_layernorm}.weight``,
  ``layers.0.self_attn.{q,k,v,o}_proj.weight`` (q/k/v over ``2 * hidden`` inputs: ``[embedding; hidden]``),
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight`` (``[draft_vocab, hidden]``;
  a drafter sharing the base LM head gets its rows copied in), ``d2t`` (int64: target id minus draft index) and
  ``t2d`` (bool over the target vocabulary). The embedding table is the verifier's and is not written.

**eagle3** (the EAGLE-3 reference checkpoint, as SpecForge trains and SGLang serves it, ``LlamaForCausalLMEagle3``):
the same tensors with the draft layer under ``midlayer.`` instead of ``layers.0.``, and a Llama config of one layer
with ``draft_vocab_size``, ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``, which count
in SGLang's and SpecForge's convention: id ``j`` is the *output* of decoder layer ``j``, ``output_hidden_states[j +
1]`` (selfspec's ``[2, 15, 27]`` on a 30-layer base is ``[1, 14, 26]`` there, which is also what they capture when
the ids are absent). The draft layer there is Llama's (no q/k/v bias, no q/k norm), so it takes drafters of Llama
and Mistral bases, whose layers are the same. Weights are written in bfloat16 by default (``torch_dtype`` too): a
float32 config would make SGLang's ``--dtype auto`` run the draft in float16 beside a bfloat16 target.

Both engines capture the residual stream at the input of decoder layers ``1 .. N-1``, in layer order, once each, so
an exported drafter's aux layers must be strictly increasing within that range (checked).
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


def draft_width(draft: EagleDraftModel) -> int:
    """The draft layer's MLP width: its own (``EagleConfig.intermediate_size``), else the base's."""
    return draft.config.intermediate_size or draft.base_model.config.intermediate_size


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
                    "intermediate_size": draft_width(draft),
                    "architectures": ["LlamaForCausalLM"] if base.config.model_type == "llama"
                    else layer_config.get("architectures")}
    identity = draft.config.base_model or base_model_identity(base)
    # engines serve on GPUs: the tree calibrated for one where there is such an entry, else the default
    depth = int(draft.config.policy_for("cuda")[0].get("depth", 4))
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
        "selfspec": {"base_model": identity, "accuracy": draft.config.accuracy, **_policies(draft.config)},
    }


def _policies(config: EagleConfig) -> dict:
    """The drafting a selfspec drafter saves (its default and its trees per kind of machine), for the ``selfspec``
    block of an export, from which an import restores them."""
    return {"decoding": dict(config.decoding or {}), "decoding_by_machine": dict(config.decoding_by_machine or {})}


def _restored_policies(block: dict | None, depth: int) -> dict:
    """``decoding`` and ``decoding_by_machine`` for an imported drafter: what a selfspec export saved in its
    ``selfspec`` block, else a tree of the engine's ``depth`` (a directory from another trainer)."""
    block = block or {}
    return {"decoding": dict(block.get("decoding") or {"depth": int(depth)}),
            "decoding_by_machine": dict(block.get("decoding_by_machine") or {})}


def check_captured_layers(draft: EagleDraftModel, fmt: str) -> None:
    """Raises: ValueError: aux layers an engine cannot capture as the drafter fused them. vLLM and SGLang capture
    the residual stream at the input of decoder layers ``1 .. N-1`` (``output_hidden_states[1 .. N-1]``), in layer
    order and once each, and concatenate them in that order for ``fc``."""
    aux = list(draft.config.aux_layers)
    total = draft.base_model.config.num_hidden_layers
    if aux != sorted(set(aux)) or not all(1 <= i <= total - 1 for i in aux):
        raise ValueError(f"the {fmt} format needs aux layers strictly increasing within 1..{total - 1} (the inputs "
                         f"of decoder layers the engine captures, in the order it concatenates them); this drafter "
                         f"fuses {aux}: decode it with selfspec instead (--draft eagle)")


def export_speculators(draft: EagleDraftModel, out: str | Path, verifier: str | None = None,
                       dtype: torch.dtype | None = None) -> Path:
    """Write ``draft`` to ``out`` in speculators' eagle3 format, atomically (``verifier``: see
    :func:`speculators_config`).

    ``dtype``: of the floating-point tensors written (default: as the drafter holds them).

    Raises:
        ValueError: a base architecture vLLM's EAGLE-3 drafter cannot take (its draft layer is Llama's), or aux
            layers it cannot capture (:func:`check_captured_layers`).
    """
    from safetensors.torch import save_file

    model_type = draft.base_model.config.model_type
    if model_type not in EXPORTABLE_MODEL_TYPES:
        raise ValueError(f"speculators' eagle3 format takes drafters of {', '.join(EXPORTABLE_MODEL_TYPES)} bases; "
                         f"got {model_type!r} (decode it with selfspec instead: --draft eagle)")
    check_captured_layers(draft, "speculators")
    out = Path(out)
    with atomic_directory(out) as tmp:
        tmp = Path(tmp)
        (tmp / "config.json").write_text(json.dumps(speculators_config(draft, verifier), indent=2) + "\n")
        save_file(_cast(speculators_state(draft), dtype), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def _cast(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return state
    return {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}


def _read_directory(directory: str | Path, what: str) -> tuple[Path, Path, dict, dict[str, torch.Tensor]]:
    """``(config path, weights path, config, tensors)`` of an exported drafter directory."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path, weights_path = directory / "config.json", directory / WEIGHTS_NAME
    for path in (config_path, weights_path):
        if not path.is_file():
            raise FileNotFoundError(f"{what} drafter file {path} does not exist")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not JSON: {e}") from None
    return config_path, weights_path, config, load_file(str(weights_path))


def _draft_from_state(state: dict[str, torch.Tensor], layer_prefix: str, aux: list[int] | None,
                      draft_vocab_size: int, policies: dict, base_model, weights_path: Path) -> EagleDraftModel:
    """A selfspec drafter on ``base_model`` from exported tensors whose draft layer sits under ``layer_prefix``."""
    vocab = torch.arange(state["d2t"].numel()) + state["d2t"].long() if "d2t" in state else None
    if aux is None:
        from eagle.model import default_aux_layers
        aux = list(default_aux_layers(base_model.config.num_hidden_layers))
    down = state.get(f"{layer_prefix}mlp.down_proj.weight")
    width = None  # the draft layer's MLP width, where it is not the base's (read off the weights)
    if down is not None and down.dim() == 2 and down.shape[1] != base_model.config.intermediate_size:
        width = int(down.shape[1])
    ours = EagleConfig(hidden_size=base_model.config.hidden_size, vocab_size=base_model.config.vocab_size,
                       draft_vocab_size=int(draft_vocab_size), aux_layers=aux, share_lm_head=False,
                       base_model=base_model_identity(base_model), intermediate_size=width, **policies)
    draft = EagleDraftModel(ours, base_model, vocab)
    missing = [k for k in ("fc.weight", "norm.weight", "lm_head.weight", f"{layer_prefix}hidden_norm.weight")
               if k not in state]
    if missing:
        raise ValueError(f"{weights_path} lacks {missing}: not an EAGLE-3 drafter's weights")
    mapped = {"fc.weight": state["fc.weight"], "norm.weight": state["norm.weight"],
              "lm_head.weight": state["lm_head.weight"], "draft_vocab": draft.draft_vocab,
              "hidden_norm.weight": state[f"{layer_prefix}hidden_norm.weight"]}
    mapped.update({f"layer.{k.removeprefix(layer_prefix)}": v for k, v in state.items()
                   if k.startswith(layer_prefix) and k != f"{layer_prefix}hidden_norm.weight"})
    head = base_model.get_output_embeddings().weight
    try:
        draft.load_state_dict(_cast(mapped, head.dtype), strict=True)
    except RuntimeError as e:
        raise ValueError(f"{weights_path} does not fit this base model as an eagle3 drafter: {e}") from None
    draft = draft.to(device=head.device, dtype=head.dtype)
    draft.refresh_shared()
    return draft.eval().requires_grad_(False)


def import_speculators(directory: str | Path, base_model) -> EagleDraftModel:
    """A speculators ``eagle3`` directory as a selfspec drafter on ``base_model`` (weights cast to its dtype).

    Raises:
        FileNotFoundError: no config.json or model.safetensors.
        ValueError: not an eagle3 directory, more than one draft layer, or shapes that do not fit ``base_model``.
    """
    config_path, weights_path, config, state = _read_directory(directory, "speculators")
    if config.get("speculators_model_type") != SPECULATORS_MODEL_TYPE:
        raise ValueError(f"{config_path}: speculators_model_type {config.get('speculators_model_type')!r} is not "
                         f"{SPECULATORS_MODEL_TYPE!r}")
    layers = config.get("transformer_layer_config", {}).get("num_hidden_layers", 1)
    if layers != 1:
        raise ValueError(f"{config_path}: {layers} draft layers; selfspec's eagle drafter has exactly one")
    depth = config.get("speculators_config", {}).get("proposal_methods", [{}])[0].get("speculative_tokens", 4)
    return _draft_from_state(state, "layers.0.", config.get("eagle_aux_hidden_state_layer_ids"),
                             config["draft_vocab_size"], _restored_policies(config.get("selfspec"), depth),
                             base_model, weights_path)


# ------------------------------------------------------------------ the EAGLE-3 reference checkpoint (SGLang)

#: the architecture name SpecForge writes and SGLang serves EAGLE-3 drafters under
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
#: bases whose decoder layer is Llama's (the only draft layer SGLang's EAGLE-3 model has)
EAGLE3_MODEL_TYPES = ("llama", "mistral")


def _rope(config) -> tuple[float, dict | None]:
    """``(rope_theta, rope_scaling)`` in the older transformers keys SGLang and SpecForge read."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = float(params.pop("rope_theta", getattr(config, "rope_theta", 10000.0)))
    scaling = params or getattr(config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        scaling = None
    return theta, scaling


#: what SpecForge trains in and SGLang serves this family of models in; a float32 config would make SGLang's
#: ``--dtype auto`` run the draft in float16 beside a bfloat16 target
EAGLE3_DEFAULT_DTYPE = torch.bfloat16


def eagle3_config(draft: EagleDraftModel, dtype: torch.dtype = EAGLE3_DEFAULT_DTYPE) -> dict:
    """The ``LlamaForCausalLMEagle3`` config of ``draft`` (see the module docstring), for weights in ``dtype``."""
    base = draft.base_model.config
    theta, scaling = _rope(base)
    identity = draft.config.base_model or base_model_identity(draft.base_model)
    hidden = base.hidden_size
    return {
        "architectures": [EAGLE3_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": draft_width(draft),
        "num_attention_heads": base.num_attention_heads,
        "num_key_value_heads": base.num_key_value_heads,
        "head_dim": getattr(base, "head_dim", None) or hidden // base.num_attention_heads,
        "hidden_act": getattr(base, "hidden_act", "silu"),
        "rms_norm_eps": base.rms_norm_eps,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": base.max_position_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "num_hidden_layers": 1,
        "vocab_size": base.vocab_size,
        "draft_vocab_size": draft.config.draft_vocab_size,
        "target_hidden_size": hidden,
        "tie_word_embeddings": False,
        "pad_token_id": getattr(base, "pad_token_id", None),
        "bos_token_id": getattr(base, "bos_token_id", None),
        "eos_token_id": getattr(base, "eos_token_id", None),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in draft.config.aux_layers],
                         "use_aux_hidden_state": True},
        "selfspec": {"base_model": identity, "accuracy": draft.config.accuracy, **_policies(draft.config)},
    }


def check_eagle3_exportable(draft: EagleDraftModel) -> None:
    """Raises: ValueError: a drafter SGLang's one-Llama-layer EAGLE-3 model cannot hold, naming the way out."""
    model_type = draft.base_model.config.model_type
    if model_type not in EAGLE3_MODEL_TYPES:
        raise ValueError(f"the eagle3 (SGLang / SpecForge) format's draft layer is Llama's and takes drafters of "
                         f"{', '.join(EAGLE3_MODEL_TYPES)} bases; got {model_type!r} (use --format speculators, "
                         "which vLLM serves)")
    base = draft.base_model.config
    if getattr(base, "attention_bias", False) or getattr(base, "mlp_bias", False):
        raise ValueError("the eagle3 format's Llama layer has no biases, and SGLang would drop this drafter's "
                         "attention / MLP biases without a word: use --format speculators")
    if len(draft.config.aux_layers) != 3:
        raise ValueError(f"the eagle3 format fuses exactly 3 base layers (SGLang's fc takes 3 x hidden); this "
                         f"drafter fuses {len(draft.config.aux_layers)} ({draft.config.aux_layers}): use --format "
                         "speculators, or train with 3 aux_layers")
    check_captured_layers(draft, "eagle3")


def export_eagle3(draft: EagleDraftModel, out: str | Path, dtype: torch.dtype = EAGLE3_DEFAULT_DTYPE) -> Path:
    """Write ``draft`` to ``out`` as an EAGLE-3 reference checkpoint (SGLang, SpecForge), atomically, its
    floating-point tensors in ``dtype`` (and so its ``torch_dtype``).

    Raises:
        ValueError: see :func:`check_eagle3_exportable`.
    """
    from safetensors.torch import save_file

    check_eagle3_exportable(draft)
    state = {(f"midlayer.{k.removeprefix('layers.0.')}" if k.startswith("layers.0.") else k): v
             for k, v in speculators_state(draft).items()}
    out = Path(out)
    with atomic_directory(out) as tmp:
        tmp = Path(tmp)
        (tmp / "config.json").write_text(json.dumps(eagle3_config(draft, dtype), indent=2) + "\n")
        save_file(_cast(state, dtype), str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    return out


def import_eagle3(directory: str | Path, base_model) -> EagleDraftModel:
    """An EAGLE-3 reference checkpoint (``LlamaForCausalLMEagle3``: SpecForge's output, what SGLang serves) as a
    selfspec drafter on ``base_model``.

    Raises:
        FileNotFoundError: no config.json or model.safetensors.
        ValueError: another architecture, more than one draft layer, or shapes that do not fit ``base_model``.
    """
    config_path, weights_path, config, state = _read_directory(directory, "eagle3")
    if EAGLE3_ARCHITECTURE not in (config.get("architectures") or []):
        raise ValueError(f"{config_path}: architectures {config.get('architectures')} do not name "
                         f"{EAGLE3_ARCHITECTURE}")
    if config.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"{config_path}: {config['num_hidden_layers']} draft layers; selfspec's eagle drafter has "
                         "exactly one")
    plain = {"fc_norm": False, "norm_output": True, "norm_before_residual": False, "attention_bias": False,
             "mlp_bias": False}  # SpecForge's switches, as the plain EAGLE-3 layer has them
    other = {k: config[k] for k, value in plain.items() if k in config and bool(config[k]) != value}
    if other:
        raise ValueError(f"{config_path}: an EAGLE-3 variant selfspec's drafter does not compute ({other}); it "
                         "imports the plain EAGLE-3 layer only")
    known = ("fc.", "norm.", "lm_head.", "midlayer.", "d2t", "t2d", "embed_tokens.")
    extra = sorted(k for k in state if not k.startswith(known))
    if extra:
        raise ValueError(f"{weights_path}: tensors {extra[:5]} that the plain EAGLE-3 layer does not have")
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    draft_vocab = config.get("draft_vocab_size") or config.get("vocab_size")
    return _draft_from_state(state, "midlayer.", None if ids is None else [i + 1 for i in ids], draft_vocab,
                             _restored_policies(config.get("selfspec"), 4), base_model, weights_path)


def directory_format(directory: str | Path) -> str:
    """``selfspec``, ``speculators`` or ``eagle3``: which kind of drafter directory this is (by its config)."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return "selfspec"  # from_pretrained names the missing or broken file
    return config_format(config)


def config_format(config: dict) -> str:
    """:func:`directory_format` of an already-read ``config.json``."""
    if config.get("speculators_model_type"):
        return "speculators"
    if EAGLE3_ARCHITECTURE in (config.get("architectures") or []):
        return "eagle3"
    return "selfspec"


def load_drafter(directory: str | Path, base_model) -> EagleDraftModel:
    """A feature drafter from a selfspec, speculators ``eagle3`` or EAGLE-3 reference (SGLang) directory."""
    kind = directory_format(directory)
    if kind == "speculators":
        return import_speculators(directory, base_model)
    if kind == "eagle3":
        return import_eagle3(directory, base_model)
    from eagle.model import from_pretrained
    return from_pretrained(directory, base_model)
