"""Tree-based speculative decoding for any Hugging Face causal LM, shared by every drafter."""

from .drafter import (DecodeState, Drafter, DrafterBase, EmptyDrafter, SamplingParams, available_drafters,
                      make_drafter, register_drafter)
from .generate import GenerateOutput, GenerationStats, generate
from .lookup import CombinedDrafter, LookupDrafter, combine, merge_trees
from .tree import DraftTree, TreeTemplate
from .verify import Verdict

__all__ = [
    "CombinedDrafter", "DecodeState", "Drafter", "DrafterBase", "LookupDrafter", "DraftTree", "EmptyDrafter", "GenerateOutput", "GenerationStats",
    "SamplingParams", "TreeTemplate", "Verdict", "available_drafters", "combine", "generate", "make_drafter",
    "merge_trees", "register_drafter",
]
