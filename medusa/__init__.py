"""Medusa heads: extra decoding heads on a frozen base model's last hidden state, drafting several tokens ahead.

Python API::

    import decoding, medusa
    drafter = medusa.load(model, "heads/smollm2-135m-instruct-medusa")
    out = decoding.generate(model, drafter, input_ids, max_new_tokens=128)

Importing this package registers the ``medusa`` drafter (``decoding.make_drafter("medusa", model, heads_dir)``).
"""

from .config import MedusaConfig
from .drafter import MedusaDrafter, load, resolve_tree
from .dynamic import DynamicTreeSelector
from .heads import MedusaHeads
from .trees import default_tree, expected_accept_length

__all__ = ["DynamicTreeSelector", "MedusaConfig", "MedusaDrafter", "MedusaHeads", "default_tree", "expected_accept_length", "load",
           "resolve_tree"]
