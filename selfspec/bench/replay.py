"""Acceptance without decoding: replay a drafter against known greedy continuations.

Under greedy verification a step accepts the longest tree path that matches the base model's own continuation,
then adds the next token of that continuation. Given the continuation (from one plain greedy run) and the base
model's hidden states along it (ONE forward over prompt + continuation), the whole decode loop can be replayed
without a single verification forward: propose, match the tree against the continuation, jump ahead, let the
drafter observe what the loop would have shown it. tau comes out as in real decoding (up to fp32 near-ties), at
the cost of the drafter alone, so trees and drafter settings can be compared in seconds instead of minutes.

Works for drafters that read ``state.sequence`` and ``state.hidden`` (Medusa heads in every form, prompt lookup,
their combinations); drafters that run the base model's layers themselves (early exit) need real decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from decoding.drafter import DecodeState, Drafter, SamplingParams
from decoding.tree import DraftTree


@dataclass
class Reference:
    """A prompt and the base model's greedy continuation of it, with the hidden states the replay needs."""

    prompt: torch.Tensor  # [1, p]
    continuation: torch.Tensor  # [c]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [1, p + c, hidden]

    @property
    def ids(self) -> torch.Tensor:
        return torch.cat([self.prompt[0], self.continuation])[None]


@torch.inference_mode()
def make_references(model: Any, prompts: Sequence[torch.Tensor], max_new_tokens: int, *,
                    eos_token_id: int | list[int] | None = None,
                    layers: Sequence[int] = (-1,)) -> list[Reference]:
    """Greedy continuations of ``prompts`` (``model.generate``) and the hidden states of ``layers`` along them."""
    out = []
    for prompt in prompts:
        generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                                   pad_token_id=eos_token_id if isinstance(eos_token_id, int) else 0)
        reference = Reference(prompt, generated[0, prompt.shape[1]:])
        add_hidden(model, [reference], layers)
        out.append(reference)
    return out


@torch.inference_mode()
def add_hidden(model: Any, references: Sequence[Reference], layers: Sequence[int]) -> None:
    """Fill in the hidden states of ``layers`` that ``references`` lack (one forward each)."""
    for reference in references:
        missing = [layer for layer in layers if layer not in reference.hidden]
        if missing:
            states = model(input_ids=reference.ids, output_hidden_states=True).hidden_states
            reference.hidden.update({layer: states[layer] for layer in missing})


def matched_path(tree: DraftTree, target: torch.Tensor) -> list[int]:
    """The longest path of ``tree`` whose tokens are ``target[0], target[1], ...`` (node indices, root first)."""
    path, node_depth = [], 0
    children = tree.children
    parent = -1
    while node_depth < target.numel():
        want = int(target[node_depth])
        nxt = next((c for c in children[parent + 1] if int(tree.tokens[c]) == want), None)
        if nxt is None:
            break
        path.append(nxt)
        parent, node_depth = nxt, node_depth + 1
    return path


@dataclass
class Replay:
    """What a replay measured: tokens per step (``tau``), per prompt and overall, and the tree sizes used."""

    steps: int = 0
    tokens: int = 0
    tree_nodes: int = 0
    per_prompt: list[float] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)  # draft nodes of every step's tree, in order

    @property
    def tau(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    @property
    def mean_tree(self) -> float:
        return self.tree_nodes / self.steps if self.steps else 0.0


@torch.inference_mode()
def replay(drafter: Drafter, references: Sequence[Reference], model: Any = None) -> Replay:
    """Replay greedy speculative decoding of every reference with ``drafter``; returns the measured tau.

    Raises:
        ValueError: a reference lacks hidden states the drafter needs (``add_hidden``).
    """
    result = Replay()
    layers = tuple(getattr(drafter, "hidden_layers", ()))
    for reference in references:
        missing = [layer for layer in layers if layer not in reference.hidden]
        if missing:
            raise ValueError(f"reference lacks the hidden states of layers {missing}; call add_hidden first")
        ids, prompt_length = reference.ids, reference.prompt.shape[1]
        total = ids.shape[1]
        root = prompt_length  # index of the root: the first generated token, produced by the prefill
        state = DecodeState(model=model, cache=None, sequence=ids[:, :root + 1], sampling=SamplingParams(),
                            hidden={layer: reference.hidden[layer][:, :root] for layer in layers})
        steps = tokens = 0
        if root + 1 < total:
            drafter.begin(state)
        while root + 1 < total:
            tree = drafter.propose(state)
            accepted = [] if tree is None or len(tree) == 0 else matched_path(tree, ids[0, root + 1:])
            step = min(len(accepted) + 1, total - root - 1)
            steps, tokens = steps + 1, tokens + step
            result.tree_nodes += 0 if tree is None else len(tree)
            result.tree_sizes.append(0 if tree is None else len(tree))
            new_root = root + step
            state.sequence = ids[:, :new_root + 1]
            state.hidden = {layer: reference.hidden[layer][:, root:new_root] for layer in layers}
            root = new_root
            if root + 1 < total:
                drafter.observe(state)
        result.steps, result.tokens = result.steps + steps, result.tokens + tokens
        result.per_prompt.append(tokens / steps if steps else 0.0)
    return result
