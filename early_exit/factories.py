"""Factories behind ``--draft early-exit`` and ``--draft layer-skip`` (``make_drafter(name, model, heads_dir, **options)``),
registered under the ``selfspec.drafters`` entry points in pyproject.toml."""

from __future__ import annotations

from decoding import by_machine
from early_exit.classifier import ExitClassifier, new_classifier
from early_exit.drafter import DraftPolicy, EarlyExitDrafter, LayerSkipDrafter
from early_exit.layer_skip import LayerSkipConfig, default_skip_layers
from early_exit.layers import check_supported
from selfspec.runtime.layers import num_decoder_layers

POLICY_OPTIONS = ("max_depth", "top_k", "width", "max_nodes", "threshold")


def _policy(**options) -> DraftPolicy:
    """Raises: ValueError: an option that is not a draft-policy option, or an invalid value."""
    unknown = sorted(set(options) - set(POLICY_OPTIONS))
    if unknown:
        raise ValueError(f"unknown draft option(s) {unknown}; known: {', '.join(POLICY_OPTIONS)}")
    return _build_policy(**options)


def _build_policy(max_depth: int = 6, top_k: int = 1, width: int | None = None, max_nodes: int | None = None,
                  threshold: float = 0.0) -> DraftPolicy:
    # A chain unless asked otherwise; a tree keeps top_k nodes per depth by default.
    width = width if width is not None else top_k
    max_nodes = max_nodes if max_nodes is not None else max_depth * width
    return DraftPolicy(max_depth=max_depth, top_k=top_k, width=width, max_nodes=max_nodes, threshold=threshold)


def make_early_exit_drafter(model, heads_dir: str | None = None, *, exit_layer: int | None = None,
                            merge_adapter: bool = False, **policy) -> EarlyExitDrafter:
    """A trained classifier from ``heads_dir``, or the training-free one (base norm + LM head) at ``exit_layer``
    (default: half the layers). ``policy``: max_depth, top_k, width, max_nodes, threshold (see DraftPolicy).

    A classifier trained with a backbone adapter (LayerSkip) needs the adapted model; with ``merge_adapter`` the
    plain base is accepted and the adapter is merged into ``model`` in place.

    Raises:
        ValueError: unsupported model, exit layer outside 1..L-1, both ``heads_dir`` and a different ``exit_layer``.
        selfspec.runtime.identity.BaseModelMismatchError: a classifier for another base model, or for the adapted model
            and ``model`` is the plain base without ``merge_adapter``.
        FileNotFoundError: ``heads_dir`` is not a classifier directory.
    """
    check_supported(model)
    if heads_dir is not None:
        classifier = ExitClassifier.from_pretrained(heads_dir, model, merge_adapter=merge_adapter)
        if exit_layer is not None and exit_layer != classifier.exit_layer:
            raise ValueError(f"{heads_dir} is trained for exit layer {classifier.exit_layer}, not {exit_layer}")
    else:
        classifier = new_classifier(model, exit_layer if exit_layer is not None else num_decoder_layers(model) // 2)
    saved, where, source = by_machine.saved_for(classifier.config.policy_for, next(model.parameters()).device)
    try:
        options = _policy(**{**saved, **policy})
    except ValueError as e:
        if heads_dir is None:
            raise
        raise ValueError(f"{e} (from the options given or the classifier's saved {where} in {heads_dir}/config.json; "
                         "fix the entry or recalibrate with `selfspec calibrate`)") from None
    drafter = EarlyExitDrafter(model, classifier, options)
    if heads_dir is not None:
        drafter.policy_source = source + " + options" * bool(policy)
    return drafter


def make_layer_skip_drafter(model, heads_dir: str | None = None, *, skip_layers: list[int] | None = None,
                            **policy) -> LayerSkipDrafter:
    """The skip set searched into ``heads_dir``, or ``skip_layers``, or every other layer of the second half.

    Raises:
        ValueError: unsupported model, bad layer indices, or a set searched on another base model.
        FileNotFoundError: ``heads_dir`` is not a layer-skip directory.
    """
    check_supported(model)
    source = "given"
    if heads_dir is not None and skip_layers is None:
        config = LayerSkipConfig.load(heads_dir, model)
        source = "default" + " + options" * bool(policy)  # a layer-skip set saves one policy
        skip_layers, policy = config.skip_layers, {**config.policy, **policy}
    if skip_layers is None:
        skip_layers = default_skip_layers(num_decoder_layers(model))
    drafter = LayerSkipDrafter(model, skip_layers, _policy(**policy))
    drafter.policy_source = source
    return drafter
