"""Self-speculative drafts from the base model's own shallow layers: early-exit classifiers (LayerSkip, Kangaroo)
and training-free layer skipping (Draft & Verify, SWIFT). The package registers the ``early-exit`` and
``layer-skip`` drafters through its entry points::

    from decoding import generate, make_drafter
    drafter = make_drafter("early-exit", model, exit_layer=18, max_depth=3)       # training-free classifier
    drafter = make_drafter("early-exit", model, "heads/smollm2-135m-instruct-early-exit")  # trained one
    drafter = make_drafter("early-exit", model, exit_layer=18, max_depth=4, top_k=2)   # dynamic top-k tree
    drafter = make_drafter("early-exit", model, "heads/smollm2-135m-instruct-layerskip")  # model: the ADAPTED one
    drafter = make_drafter("layer-skip", model, "heads/smollm2-135m-instruct-layer-skip")  # searched skip set
    out = generate(model, drafter, input_ids, max_new_tokens=128)   # equals model.generate(do_sample=False)

Train a classifier with ``train/early_exit.py`` (``method: distill`` on the frozen base, with a ResBlock or an
attention adapter; or ``method: layerskip``, LoRA on the backbone: load the adapted model with
``selfspec.runtime.models.load_model(heads_dir)`` or pass ``merge_adapter=True``); search a skip set with
``scripts/search_layer_skip.py``.
"""

from early_exit.adapter import ADAPTER_KINDS, AdapterCache, AttentionAdapter
from early_exit.classifier import ExitClassifier, ExitClassifierConfig, check_exit_layer, new_classifier
from early_exit.drafter import DraftPolicy, EarlyExitDrafter, LayerSkipDrafter, PartialForwardDrafter
from early_exit.factories import make_early_exit_drafter, make_layer_skip_drafter
from early_exit.layer_skip import LayerSkipConfig, default_skip_layers
from early_exit.layers import SUPPORTED_MODEL_TYPES, check_supported

__all__ = [
    "ADAPTER_KINDS", "AdapterCache", "AttentionAdapter", "DraftPolicy", "EarlyExitDrafter", "ExitClassifier", "ExitClassifierConfig", "LayerSkipConfig",
    "LayerSkipDrafter", "PartialForwardDrafter", "SUPPORTED_MODEL_TYPES", "check_exit_layer", "check_supported",
    "default_skip_layers", "make_early_exit_drafter", "make_layer_skip_drafter", "new_classifier",
]
