"""Acceptance rules: which draft nodes the base model agrees with, and the token that follows them.

Glossary (fixed for the whole package):
    p         the *target* distribution: the base model's next-token distribution after temperature/top-k/top-p.
    q         the *draft* distribution a node's token was drawn from (one-hot for deterministic top-k drafts).
    accepted  draft nodes kept, a path from the root down (node indices, in order).
    next      the token appended after the accepted path: the *bonus* token when the path ends at a node whose
              children were all wrong or that has none (sampled from p, or the argmax), or the *recovered* token
              sampled from the residual distribution after rejections. Either way the base model produced it.

Every rule is a pure function of the tree, the verification logits (row 0 = the root, row i + 1 = node i) and an
explicit ``torch.Generator``. ``greedy`` and ``speculative`` are exact: greedy reproduces the base model's argmax
decoding, speculative reproduces its sampling distribution. ``typical`` is Medusa's typical acceptance: faster
at high temperature, but NOT lossless; it is opt-in only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from decoding.drafter import SamplingParams
from decoding.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    """The outcome of one verification step."""

    accepted: list[int]  # node indices of the accepted path, root excluded, parent before child
    next_token: int


def target_warper(sampling: SamplingParams) -> LogitsProcessorList:
    """The same warpers, in the same order, as transformers' ``generate(do_sample=True)`` applies."""
    warpers = LogitsProcessorList()
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
    if sampling.top_p is not None and sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=sampling.top_p))
    return warpers


def target_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """``[rows, vocab]`` logits -> target probabilities p (float32 or wider)."""
    warped = target_warper(sampling)(None, logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits)
    return torch.softmax(warped, dim=-1)


def _best_accepted_node(tree: DraftTree, correct: torch.Tensor) -> int:
    """The deepest node whose whole path is correct (lowest index on ties), or -1 for none."""
    # A node is accepted when no node on its root path (itself included) is wrong.
    wrong_on_path = (tree.ancestor_mask[1:, 1:] & ~correct.unsqueeze(0)).any(dim=1)
    ok = ~wrong_on_path
    if not bool(ok.any()):
        return -1
    depth = torch.where(ok, tree.depth, torch.zeros_like(tree.depth))
    return int(torch.argmax(depth))  # argmax returns the first maximum


def _path_to(tree: DraftTree, node: int) -> list[int]:
    path = []
    parents = tree._parents_list
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximal index (NaN first) on the CPU: the skinny extension's one pass where it is loaded and
    the rows are float32 CPU ones, else ``max(dim).indices`` (the same indices)."""
    from selfspec.runtime import skinny

    if skinny.loaded() and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2:
        return skinny.argmax_rows(logits.contiguous())
    return logits.max(dim=-1).indices.cpu()


def greedy(tree: DraftTree, logits: torch.Tensor) -> Verdict:
    """Longest path on which every token is the base model's argmax; next = argmax after it.

    ``logits``: ``[n + 1, vocab]``, row 0 for the root. Of several such paths (siblings that repeat a token), the
    deepest, and of those the one ending at the lowest node index.
    """
    # Each row's argmax (the first maximal index, NaN first, as documented and tested) in one pass; then the walk
    # down from the root over the children that hold their parent's argmax, in Python on a few dozen numbers (the
    # tensor version, masks over the tree's ancestor matrix, took ~10 small ops a step)
    target = _argmax(logits).tolist()
    if len(tree) == 0:
        return Verdict([], target[0])
    tokens, children = tree.token_list, tree.children
    best, best_depth = -1, 0
    frontier = [(-1, 0)]
    while frontier:
        node, depth = frontier.pop()
        want, depth = target[node + 1], depth + 1
        for child in children[node + 1]:
            if tokens[child] == want:
                if depth > best_depth or (depth == best_depth and child < best):
                    best, best_depth = child, depth
                frontier.append((child, depth))
    if best < 0:
        return Verdict([], target[0])
    return Verdict(_path_to(tree, best), target[best + 1])


def _sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    # On the CPU, where the caller's generator lives (the draw is one per step; p is one vocabulary row).
    return int(torch.multinomial(p.cpu(), 1, generator=generator))


def speculative(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Verdict:
    """Multi-candidate speculative sampling over a tree (SpecInfer / Sequoia): lossless for any sampling params.

    At each accepted node, its children are tried in order. Child ``c`` with token ``x`` drawn from ``q_c`` is
    accepted with probability ``min(1, p(x) / q_c(x))``; on rejection the target becomes the residual
    ``norm(max(p - q_c, 0))`` and the next sibling is tried against it. Each round is one standard speculative
    sampling step against the current residual, so the emitted token is distributed exactly as ``p``. This needs each
    child's token to be drawn from its ``q_c`` independently of its siblings (or chosen deterministically, q one-hot).
    """
    p_all = target_probs(logits, sampling)  # [n + 1, vocab]
    tokens = tree.tokens.tolist()
    accepted: list[int] = []
    node = -1
    while True:
        p = p_all[node + 1]
        advanced = False
        for child in tree.children[node + 1]:
            x = tokens[child]
            if tree.draft_probs is None:
                q_x = 1.0
            else:
                q = tree.draft_probs[child].to(device=p.device, dtype=p.dtype)
                q_x = float(q[x])
            p_x = float(p[x])
            if q_x > 0 and float(torch.rand((), generator=generator, dtype=torch.float64)) * q_x < p_x:
                accepted.append(child)
                node = child
                advanced = True
                break
            # Rejected: continue against the residual distribution.
            if tree.draft_probs is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = torch.clamp(p - q, min=0.0)
            total = residual.sum()
            if float(total) <= 0.0:
                # p == q exactly, so a rejection had probability zero; keep p rather than divide by zero.
                continue
            p = residual / total
        if not advanced:
            return Verdict(accepted, _sample(p, generator))


def typical(tree: DraftTree, logits: torch.Tensor, sampling: SamplingParams,
            generator: torch.Generator | None = None, *, posterior_threshold: float = 0.09,
            posterior_alpha: float = 0.3) -> Verdict:
    """Medusa's typical acceptance. NOT lossless: it changes the output distribution.

    A node is plausible when ``p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p)))`` at its parent;
    the longest plausible path is kept and the next token is sampled from p after it.
    """
    p_all = target_probs(logits, sampling)
    entropy = -(p_all * torch.log(p_all.clamp_min(1e-30))).sum(-1)  # [n + 1]
    threshold = torch.minimum(torch.full_like(entropy, posterior_threshold), posterior_alpha * torch.exp(-entropy))
    if len(tree) == 0:
        return Verdict([], _sample(p_all[0], generator))
    parent_rows = tree.parents + 1
    plausible = p_all[parent_rows, tree.tokens] > threshold[parent_rows]
    best = _best_accepted_node(tree, plausible)
    accepted = [] if best < 0 else _path_to(tree, best)
    return Verdict(accepted, _sample(p_all[best + 1], generator))
