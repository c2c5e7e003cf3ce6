"""Tree-based speculative decoding for any Hugging Face causal LM, shared by every drafter."""

from .drafter import (DecodeState, Drafter, DrafterBase, EmptyDrafter, SamplingParams, available_drafters,
                      make_drafter, register_drafter)
from .generate import GenerateOutput, GenerationStats, generate
from .tree import DraftTree, TreeTemplate
from .verify import Verdict

__all__ = [
    "DecodeState", "Drafter", "DrafterBase", "DraftTree", "EmptyDrafter", "GenerateOutput", "GenerationStats",
    "SamplingParams", "TreeTemplate", "Verdict", "available_drafters", "generate", "make_drafter", "register_drafter",
]
