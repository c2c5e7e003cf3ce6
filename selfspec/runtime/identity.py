"""Which base model a draft module (Medusa heads, an exit classifier) was trained on, and a check against it.

The identity is a small JSON-able dict saved with the heads. Its ``fingerprint`` hashes a few elements of every
weight tensor (exact float32 values), so two checkpoints of one architecture are told apart even when only a few
layers were fine-tuned, and computing it costs a few milliseconds. Because the same weights loaded in another
precision hash differently, the identity also keeps ``weight_sample``: the first values of a few tensors,
compared with a tolerance (relative to the largest of them) when the dtypes differ.
"""

from __future__ import annotations

import hashlib
import warnings

import torch

# Elements taken from the start of every tensor for the fingerprint: enough to see any trained change in any
# tensor, few enough that the whole hash costs milliseconds on a 135M model.
_ELEMENTS_PER_TENSOR = 64
_SAMPLED_TENSORS = 16
_SAMPLE_ELEMENTS = 8
# bf16 keeps 8 mantissa bits (relative error < 0.4%); 2% leaves room while still telling distinct weights apart.
_SAMPLE_RTOL = 2e-2
_SHAPE_FIELDS = ("architecture", "model_type", "hidden_size", "vocab_size", "num_hidden_layers")


class BaseModelMismatchError(ValueError):
    """Saved heads (or another draft module) belong to a different base model than the one given."""


class BaseModelWeightsWarning(UserWarning):
    """Saved heads meet a model of their base's architecture, shapes and vocabulary whose weights differ (the
    original fp32 checkpoint of a quantized base, a fine-tune): they load, and may be accepted less often."""


def base_model_identity(model: torch.nn.Module) -> dict:
    """Describe ``model`` (a transformers causal LM) well enough to recognise it again.

    Returns:
        ``name_or_path``, ``architecture`` (class name), ``model_type``, ``hidden_size``, ``vocab_size``,
        ``num_hidden_layers``, ``dtype``, ``fingerprint`` (16 hex digits) and ``weight_sample`` (lists of floats).
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    tensors = _weight_tensors(model)
    digest = hashlib.sha256()
    for name, tensor in tensors:
        head = tensor.detach().reshape(-1)[:_ELEMENTS_PER_TENSOR].to("cpu", torch.float32)
        digest.update(f"{name}:{tuple(tensor.shape)}".encode())
        digest.update(head.numpy().tobytes())
    step = max(1, len(tensors) // _SAMPLED_TENSORS)
    sample = [tensor.detach().reshape(-1)[:_SAMPLE_ELEMENTS].to("cpu", torch.float32).tolist()
              for _, tensor in tensors[::step][:_SAMPLED_TENSORS]]
    return {
        "name_or_path": str(getattr(model, "name_or_path", "") or getattr(config, "_name_or_path", "")),
        "architecture": type(model).__name__,
        "model_type": getattr(config, "model_type", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "dtype": str(tensors[0][1].dtype).removeprefix("torch.") if tensors else None,
        "fingerprint": digest.hexdigest()[:16],
        "weight_sample": sample,
    }


def check_base_model(expected: dict, model: torch.nn.Module, what: str = "heads", *,
                     on_weights: str = "refuse") -> None:
    """Refuse ``model`` if it is not the base model described by ``expected`` (a saved identity).

    Shape fields (architecture, hidden size, vocabulary, depth) must be equal; the weights must have the same
    fingerprint, or, when the saved identity was taken in another dtype, the same sampled values within a
    tolerance. Fields missing from ``expected`` are not checked. The name alone never decides: the same weights
    loaded from an alias, a local directory or a hub id are the same base model.

    ``on_weights="warn"``: a model that differs only in its weights gets a ``BaseModelWeightsWarning`` instead
    (draft modules load on it; decoding stays exact). Adapter checks keep the default: there the weights are the
    difference between the plain and the adapted model.

    Raises:
        BaseModelMismatchError: naming each field that differs, and what to do about it.
    """
    actual = base_model_identity(model)
    differences = [
        f"{field} {expected[field]!r} vs {actual[field]!r}"
        for field in _SHAPE_FIELDS
        if expected.get(field) is not None and expected[field] != actual[field]
    ]
    if not differences and not _same_weights(expected, actual):
        if on_weights == "warn":
            warnings.warn(BaseModelWeightsWarning(
                f"these {what} were trained on {_describe(expected)}; this model has the same architecture, shapes "
                f"and vocabulary but other weights (fingerprint {expected.get('fingerprint')} vs "
                f"{actual['fingerprint']}: another checkpoint or a fine-tune). They load: outputs stay exactly this "
                f"model's (verification decides every token), but fewer drafts may be accepted; retrain the {what} "
                "on this model for full speed"), stacklevel=2)
            return
        differences.append(f"weights differ (fingerprint {expected.get('fingerprint')} vs {actual['fingerprint']})")
    if differences:
        raise BaseModelMismatchError(
            f"these {what} were trained for {_describe(expected)}, but the model given is {_describe(actual)}: "
            f"{'; '.join(differences)}. Load them with that base model, or retrain the {what} on this one."
        )


def _weight_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    # named_parameters() skips tied duplicates and follows module order, so the list is the same every load.
    return [(name, p) for name, p in model.named_parameters() if p.numel() > 0]


def _same_weights(expected: dict, actual: dict) -> bool:
    if expected.get("fingerprint") in (None, actual["fingerprint"]):
        return True
    sample = expected.get("weight_sample")
    if expected.get("dtype") == actual["dtype"] or not sample or len(sample) != len(actual["weight_sample"]):
        return False
    for old, new in zip(sample, actual["weight_sample"]):
        # Scaled by the largest value: rounding moves each value by a fraction of its own size, and a
        # near-zero value may even flush to zero in float16, so a per-value relative test would fail.
        scale = max(map(abs, old + new), default=0.0)
        if len(old) != len(new) or any(abs(a - b) > _SAMPLE_RTOL * scale + 1e-12 for a, b in zip(old, new)):
            return False
    return True


def _describe(identity: dict) -> str:
    name = identity.get("name_or_path") or "an unnamed model"
    return (f"{name} ({identity.get('architecture')}, hidden_size={identity.get('hidden_size')}, "
            f"vocab_size={identity.get('vocab_size')}, layers={identity.get('num_hidden_layers')})")
