"""Tree-based speculative decoding for any Hugging Face causal LM, shared by every drafter.

``decoding`` names no drafter: drafters register under the entry-point group ``selfspec.drafters``
(``decoding.registry``) and are built by name with ``make_drafter``.
"""

from decoding.combine import CombinedDrafter, FallbackDrafter, combine, fallback, fallback_counts, merge_trees
from decoding.drafter import ContextDrafter, DecodeState, Drafter, DrafterBase, EmptyDrafter, SamplingParams
from decoding.generate import GenerateOutput, GenerationStats, generate
from decoding.registry import available_drafters, make_drafter, register_drafter
from decoding.tree import DraftTree, TreeTemplate
from decoding.verify import Verdict

__all__ = [
    "CombinedDrafter", "ContextDrafter", "DecodeState", "Drafter", "DrafterBase", "DraftTree", "EmptyDrafter",
    "FallbackDrafter",
    "GenerateOutput", "GenerationStats", "SamplingParams", "TreeTemplate", "Verdict", "available_drafters",
    "combine", "fallback", "fallback_counts", "generate", "make_drafter", "merge_trees", "register_drafter",
]
