"""EAGLE-3-class feature drafter: one decoder layer of the base model's own class over its fused low/mid/high
hidden states and the next token's embedding, drafting on its own outputs (``eagle.model``), grown into EAGLE-2
dynamic trees or static trees and verified losslessly by ``decoding.generate`` (``eagle.drafter``), trained with
training-time test against the base model's own distribution (``eagle.recipe``, ``train/eagle.py``).

    selfspec generate --draft eagle --heads DIR --prompt "..."
    selfspec bench --methods vanilla,eagle:DIR,eagle:DIR+lookup
"""

from eagle.drafter import EagleDrafter, EaglePolicy, load, make_eagle_drafter
from eagle.model import EagleConfig, EagleDraftModel, default_aux_layers, from_pretrained, save_pretrained

__all__ = ["EagleConfig", "EagleDraftModel", "EagleDrafter", "EaglePolicy", "default_aux_layers", "from_pretrained",
           "load", "make_eagle_drafter", "save_pretrained"]
