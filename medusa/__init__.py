"""Medusa heads: extra decoding heads on a frozen base model's last hidden state, drafting several tokens ahead.

Python API::

    import decoding, medusa
    drafter = medusa.load(model, "heads/smollm2-135m-instruct-medusa")
    out = decoding.generate(model, drafter, input_ids, max_new_tokens=128)

The package registers the ``medusa`` drafter through its entry point (``decoding.make_drafter("medusa", model, heads_dir)``,
``--draft medusa --heads DIR``). Training: ``medusa.recipe`` (``accelerate launch train/medusa.py --config ...``).
"""

from medusa.config import MedusaConfig
from medusa.drafter import MedusaDrafter, load, resolve_tree
from medusa.dynamic import DynamicTreeSelector
from medusa.heads import MedusaHeads
from medusa.trees import default_tree, expected_accept_length

__all__ = ["DynamicTreeSelector", "MedusaConfig", "MedusaDrafter", "MedusaHeads", "default_tree", "expected_accept_length", "load",
           "resolve_tree"]
