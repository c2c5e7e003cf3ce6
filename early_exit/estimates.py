"""Cheap, teacher-forced estimates of how good a self-draft is, for picking exit layers and skip sets.

Everything here reads calibration sequences the base model wrote itself (prompt + its own greedy continuation:
what a draft must predict at decode time) and compares the draft's top-1 with the full model's at every
continuation position, in one forward per sequence. The expected speedup of a chain draft of length ``k`` with
per-token acceptance ``a`` and relative draft cost ``c`` (a draft forward / a full forward) is
``(1 - a^(k+1)) / (1 - a) / (1 + k c)``: tokens per step over the cost of one verification plus ``k`` drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from early_exit.layers import additive_mask, crop_layers, run_layers
from selfspec.runtime.layers import num_decoder_layers


@dataclass(frozen=True)
class Calibration:
    """``sequences``: ``[1, n]`` token ids each; ``starts``: index of the first generated token in each;
    ``targets``: the full model's greedy next token at every position of each sequence; ``caches``: the full
    model's KV cache of each sequence (what a draft shares at decode time)."""

    sequences: list[torch.Tensor]
    starts: list[int]
    targets: list[torch.Tensor]
    caches: list


@torch.no_grad()
def calibration_set(model, prompts: Sequence[torch.Tensor], new_tokens: int = 48) -> Calibration:
    """Greedy continuations of ``prompts`` (``[1, seq]`` each) by the base model, and its targets on them."""
    from transformers import DynamicCache

    sequences, starts, targets, caches = [], [], [], []
    for ids in prompts:
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        cache = DynamicCache(config=model.config)
        sequences.append(out)
        starts.append(ids.shape[1])
        targets.append(model(out, cache=cache, use_cache=True).logits[0].argmax(-1))
        caches.append(cache)
    return Calibration(sequences, starts, targets, caches)


@torch.no_grad()
def agreement(model, calibration: Calibration, layer_ids: Sequence[int], head) -> float:
    """Fraction of continuation positions where ``head(hidden after layer_ids)`` has the full model's top-1.

    ``head`` maps ``[1, n, hidden]`` to logits ``[1, n, vocab]``. Exactly the first draft token's condition at
    every position at once: each position runs through the draft's layers attending to the full model's KV of
    the positions before it (the shared cache) and to its own draft KV.
    """
    dtype = next(model.parameters()).dtype
    hits = total = 0
    for ids, start, target, cache in zip(calibration.sequences, calibration.starts, calibration.targets,
                                         calibration.caches):
        n = ids.shape[1]
        positions = torch.arange(n, device=ids.device)[None]
        # Keys: the n full-model entries already cached, then the n draft entries this forward appends.
        eye = torch.eye(n, dtype=torch.bool, device=ids.device)
        allowed = torch.cat([torch.ones(n, n, dtype=torch.bool, device=ids.device).tril(-1), eye], dim=1)
        try:
            hidden = run_layers(model, layer_ids, ids, positions, additive_mask(allowed, 0, dtype), cache)
        finally:
            crop_layers(cache, layer_ids, n)
        predicted = head(hidden)[0].argmax(-1)
        # Position t predicts token t + 1; score the positions whose next token is generated text.
        span = slice(start - 1, n - 1)
        hits += int((predicted[span] == target[span]).sum())
        total += n - start
    return hits / max(total, 1)


@torch.no_grad()
def exit_agreement(model, calibration: Calibration, classifiers: dict) -> dict:
    """Top-1 agreement of each exit classifier (``name -> ExitClassifier``) with the full model, from one full
    forward per sequence: the hidden state after ``layers[:E]`` is the full model's own, as when drafting, and the
    classifier ranks what it drafts from (its draft vocabulary, if it has one)."""
    hits = {name: 0 for name in classifiers}
    total = 0
    for ids, start, target in zip(calibration.sequences, calibration.starts, calibration.targets):
        hidden_states = model(ids, output_hidden_states=True).hidden_states
        span = slice(start - 1, ids.shape[1] - 1)
        for name, classifier in classifiers.items():
            # The whole sequence: an attention adapter attends to every earlier position, as it was trained.
            logits, vocab = classifier.draft_logits(hidden_states[classifier.exit_layer], model)
            predicted = logits[0, span].argmax(-1)  # ranked as drafting ranks: over the draft vocabulary if any
            if vocab is not None:
                predicted = vocab[predicted]
            hits[name] += int((predicted == target[span]).sum())
        total += ids.shape[1] - start
    return {name: h / max(total, 1) for name, h in hits.items()}


def relative_cost(model, kept_layers: int, head_rows: int | None = None) -> float:
    """Draft forward cost / full forward cost for one token, counted in weight multiply-adds (parameters):
    machine-independent, and right for batch-1 decoding, which is bound by reading the weights."""
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    head = model.get_output_embeddings().weight
    full_head = head.numel()
    draft_head = full_head if head_rows is None else head_rows * head.shape[1]
    total = num_decoder_layers(model) * layer + full_head
    return (kept_layers * layer + draft_head) / total


def chain_speedup(acceptance: float, cost: float, max_depth: int,
                  verify_cost: Callable[[int], float] | None = None) -> tuple[float, int]:
    """``(best expected speedup, chain length achieving it)`` over lengths 1..max_depth.

    A chain of ``k`` draft tokens, each accepted with probability ``acceptance`` given its parent was, yields
    ``(1 - a^(k+1)) / (1 - a)`` tokens per step and costs ``verify_cost(k + 1) + k * cost`` plain steps
    (``verify_cost``: forward cost of ``n`` tokens over a 1-token forward; default 1, a flat curve).
    """
    best = (0.0, 1)
    for k in range(1, max_depth + 1):
        a = min(max(acceptance, 0.0), 1.0)
        tau = float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)
        verify = verify_cost(k + 1) if verify_cost is not None else 1.0
        best = max(best, (tau / (verify + k * cost), k))
    return best


def required_acceptance(target: float, cost: float, max_depth: int,
                        verify_cost: Callable[[int], float] | None = None) -> float | None:
    """The smallest per-token acceptance at which a chain (best length up to ``max_depth``) reaches ``target``
    speedup, or None when even acceptance 1 does not (the draft or the verification costs too much)."""
    if chain_speedup(1.0, cost, max_depth, verify_cost)[0] < target:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if chain_speedup(mid, cost, max_depth, verify_cost)[0] < target else (low, mid)
    return high
