"""Batched tree speculative decoding: several prompts of different lengths decoded together, each row drafting its
own tree and accepting its own number of tokens per step, each row's output equal to its own ``generate``.

Design: one KV cache for the batch, *right-ragged*. Row ``r`` owns the slots ``[0, length_r)`` of every layer; the
cache is as long as the longest row, and the slots of a shorter row past its length hold stale (finite) entries
that its attention mask hides. A step appends every row's root + tree (padded to the largest tree) at the same
slots ``[L, L + N)``, with position ids ``length_r + depth`` and a per-row 4D mask (its own valid prefix plus its
own ancestors; a padding query sees only itself, so every value stays finite). After acceptance each row's root
and accepted nodes are moved down to ``[length_r, length_r + 1 + accepted_r)`` and the cache is cut to the new
longest row. Rows that finish leave the batch (their cache rows are dropped), so a long answer does not keep the
others' compute. Per-row drafters are forks of the one given (shared weights, private state).

Drafters that write into the base model's own cache (early exit, layer skipping: ``uses_base_cache``) and models
with sliding-window layers are refused: their cache cannot be ragged.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from decoding import verify
from decoding.drafter import DecodeState, Drafter, EmptyDrafter, SamplingParams
from decoding.generate import (
    _CPU,
    _TREE_SLACK,
    GenerationStats,
    _choose,
    _eos_set,
    context_length,
    model_vocab_size,
    prune_to_depth,
)
from decoding.tree import DraftTree
from selfspec.runtime import cache as kv


@dataclass
class BatchOutput:
    """``sequences[r]``: ``[1, prompt_r + new_r]`` (no padding); ``stats[r]``: that row's statistics (the time fields
    are the whole batch's, which every row shared)."""

    sequences: list[torch.Tensor]
    stats: list[GenerationStats]


def fork(drafter: Drafter) -> Drafter:
    """A copy of ``drafter`` with its own per-sequence state (caches, last hidden states...) and the same modules
    (weights are shared, never copied)."""
    memo: dict[int, Any] = {}

    def share(obj: Any, depth: int) -> None:
        if isinstance(obj, nn.Module):
            memo[id(obj)] = obj
            return
        if depth > 3:
            return
        values = vars(obj).values() if hasattr(obj, "__dict__") else (obj if isinstance(obj, (list, tuple)) else ())
        for value in values:
            if isinstance(value, (nn.Module, list, tuple)) or hasattr(value, "__dict__"):
                share(value, depth + 1)

    share(drafter, 0)
    return copy.deepcopy(drafter, memo)


def _check(model, drafter: Drafter, prompts: Sequence[torch.Tensor], max_new_tokens: int) -> None:
    if not prompts:
        raise ValueError("no prompts: generate_batch needs at least one")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit, vocab = context_length(model), model_vocab_size(model)
    for i, p in enumerate(prompts):
        if p.numel() < 1:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if limit is not None and p.numel() + max_new_tokens > limit:
            raise ValueError(f"prompt {i} ({p.numel()} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                             f"model's context of {limit} tokens")
        if int(p.max()) >= vocab or int(p.min()) < 0:
            raise ValueError(f"prompt {i} holds token ids outside the model's vocabulary (0..{vocab - 1})")
    if getattr(drafter, "uses_base_cache", False):
        raise ValueError(f"{type(drafter).__name__} drafts inside the base model's own KV cache, which a batch "
                         "shares between rows: decode those prompts one at a time (batch size 1), or use a drafter "
                         "with its own state (medusa, eagle, lookup)")
    drafter_vocab = getattr(drafter, "vocab_size", None)
    if drafter_vocab is not None and drafter_vocab != vocab:
        raise ValueError(f"the drafter proposes tokens from a vocabulary of {drafter_vocab} but the model's has "
                         f"{vocab}: use a drafter trained for this model")


@torch.inference_mode()
def generate_batch(
    model,
    drafter: Drafter | Sequence[Drafter] | None,
    prompts: Sequence[torch.Tensor | Sequence[int]],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    seed: int | None = None,
    pad_token_id: int = 0,
) -> BatchOutput:
    """Decode ``prompts`` (each ``[1, len]``, ``[len]`` or a list of ids; lengths may differ) together.

    ``drafter``: one drafter, forked per row (:func:`fork`), or one drafter per row, or None (plain decoding).

    Greedy rows equal ``generate(model, drafter, prompt)`` (and ``model.generate(do_sample=False)``) token for
    token, up to floating-point near-ties between the batched and the single-row forward. With ``temperature > 0``
    each row samples losslessly with its own generator (``seed + row`` when ``seed`` is given).

    Raises:
        ValueError: no prompts, an empty prompt, ids outside the vocabulary, a prompt + ``max_new_tokens`` beyond the
            context, a drafter that writes into the base cache, or a model with sliding-window layers.
    """
    rows_in = [torch.as_tensor(p, dtype=torch.long).reshape(-1).cpu() for p in prompts]  # prompts on any device
    if isinstance(drafter, (list, tuple)):
        if len(drafter) != len(rows_in):
            raise ValueError(f"{len(drafter)} drafters for {len(rows_in)} prompts: give one per prompt, or one to fork")
        drafters = list(drafter)
    else:
        drafters = None
        drafter = drafter if drafter is not None else EmptyDrafter()
    for d in drafters or [drafter]:
        _check(model, d, rows_in, max_new_tokens)
    if drafters is None:
        drafters = [fork(drafter) for _ in rows_in]
    drafter = drafters[0]
    sampling = SamplingParams(temperature=float(temperature or 0.0), top_k=top_k, top_p=top_p)
    generators = [None if sampling.greedy else
                  (torch.Generator().manual_seed(seed + r) if seed is not None else torch.Generator())
                  for r in range(len(rows_in))]
    if not sampling.greedy and seed is None:
        for g in generators:
            g.seed()
    eos = _eos_set(model, eos_token_id)
    device = model.get_output_embeddings().weight.device
    batch = len(rows_in)
    lengths = [p.numel() for p in rows_in]
    hidden_layers = tuple(sorted({layer for d in drafters for layer in getattr(d, "hidden_layers", ())}))
    want_hidden = bool(hidden_layers)
    vocab = model_vocab_size(model)
    stats = [GenerationStats(prompt_tokens=n) for n in lengths]
    start = time.perf_counter()

    # 1. Prefill, right-padded: row r's prompt at slots [0, len_r); logits at each row's last prompt position.
    width = max(lengths)
    ids = torch.full((batch, width), pad_token_id, dtype=torch.long)
    mask2d = torch.zeros(batch, width, dtype=torch.long)
    for r, p in enumerate(rows_in):
        ids[r, :p.numel()], mask2d[r, :p.numel()] = p, 1
    cache = kv.new_cache(model, capacity=width + max_new_tokens + _TREE_SLACK)
    if kv.sliding_window_by_layer_type(model) or any(not isinstance(layer, kv.BufferedLayer)
                                            for layer in getattr(cache, "layers", [])):
        raise ValueError(f"{type(model).__name__} has sliding-window (or other special) cache layers, which a "
                         "ragged batch cannot share: decode its prompts one at a time (batch size 1)")
    last = torch.tensor([n - 1 for n in lengths])
    keep, where = torch.unique(last, return_inverse=True)
    out = model(input_ids=ids.to(device), attention_mask=mask2d.to(device), cache=cache, use_cache=True,
                output_hidden_states=want_hidden, logits_to_keep=keep.to(device))
    states: list[DecodeState] = []
    done = [False] * batch
    new_tokens: list[list[int]] = []
    for r in range(batch):
        root = _choose(out.logits[r, int(where[r])], sampling, generators[r])
        new_tokens.append([root])
        hidden = ({layer: out.hidden_states[layer][r:r + 1, :lengths[r]] for layer in hidden_layers}
                  if want_hidden else {})
        states.append(DecodeState(model=model, cache=None, sampling=sampling, generator=generators[r],
                                  sequence=torch.cat([rows_in[r], torch.tensor([root])])[None].to(device),
                                  hidden=hidden))
        done[r] = root in eos or max_new_tokens == 1
        if not done[r]:
            drafters[r].begin(states[r])
    in_cache = list(range(batch))  # original row of each cache batch row
    prefill = time.perf_counter() - start
    for s in stats:
        s.time_prefill = prefill

    while not all(done):
        t0 = time.perf_counter()
        active = [r for r in range(batch) if not done[r]]
        trees: dict[int, DraftTree] = {}
        for r in active:
            tree = drafters[r].propose(states[r])
            tree = prune_to_depth((tree if tree is not None else DraftTree.empty()).to(_CPU),
                                  max_new_tokens - len(new_tokens[r]) - 1)
            if len(tree) and int(tree.tokens.max()) >= vocab:
                raise ValueError(f"drafter proposed token id {int(tree.tokens.max())} outside the model's "
                                 f"vocabulary ({vocab})")
            trees[r] = tree
        t1 = time.perf_counter()
        if active != in_cache:  # rows that finished leave the batch
            kv.select_rows(cache, [in_cache.index(r) for r in active])
            in_cache = active

        # 2. One forward: every row's root + tree at slots [L, L + n_r), padded to N.
        slots = cache.get_seq_length()
        n_max = max(len(trees[r]) + 1 for r in active)
        step_ids = torch.full((len(active), n_max), pad_token_id, dtype=torch.long)
        positions = torch.zeros(len(active), n_max, dtype=torch.long)
        allowed = torch.zeros(len(active), 1, n_max, slots + n_max, dtype=torch.bool)
        for i, r in enumerate(active):
            tree, n, length = trees[r], len(trees[r]) + 1, lengths[r]
            step_ids[i, 0], step_ids[i, 1:n] = states[r].root, tree.tokens
            positions[i, :n] = length + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])
            positions[i, n:] = length
            allowed[i, 0, :, :length] = True
            allowed[i, 0, :n, slots:slots + n] = tree.ancestor_mask
            pad = torch.arange(n, n_max)
            allowed[i, 0, pad, slots + pad] = True
        dtype = model.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
        out = model(input_ids=step_ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                    cache=cache, use_cache=True, output_hidden_states=want_hidden)
        t2 = time.perf_counter()

        # 3. Each row accepts its own path; its root and accepted nodes move down to its own slots.
        moves, new_lengths = [], {}
        for i, r in enumerate(active):
            tree, logits = trees[r], out.logits[i, :len(trees[r]) + 1]
            if sampling.greedy:
                verdict = verify.greedy(tree, logits)
            else:
                verdict = verify.speculative(tree, logits, sampling, generators[r])
            step_tokens = [tree.token_list[i] for i in verdict.accepted] + [verdict.next_token]
            for j, token in enumerate(step_tokens):
                if token in eos:
                    step_tokens, done[r] = step_tokens[:j + 1], True
                    break
            remaining = max_new_tokens - len(new_tokens[r])
            if len(step_tokens) >= remaining:
                step_tokens, done[r] = step_tokens[:remaining], True
            kept = [0] + [a + 1 for a in verdict.accepted]
            moves += [(i, slots + k, lengths[r] + j) for j, k in enumerate(kept)]
            new_lengths[r] = lengths[r] + len(kept)
            if want_hidden:
                index = torch.tensor(kept, device=device)
                states[r].hidden = {layer: out.hidden_states[layer][i:i + 1].index_select(1, index)
                                    for layer in hidden_layers}
            new_tokens[r].extend(step_tokens)
            states[r].sequence = torch.cat([states[r].sequence, states[r].sequence.new_tensor([step_tokens])], dim=1)
            s = stats[r]
            s.steps += 1
            s.accepted_per_step.append(len(verdict.accepted))
            s.tokens_per_step.append(len(step_tokens))
            s.tree_sizes.append(len(tree))
        t3 = time.perf_counter()
        kv.move_entries(cache, moves)
        for r, length in new_lengths.items():
            lengths[r] = length
        kv.crop(cache, max(lengths[r] for r in active))
        t4 = time.perf_counter()
        for r in active:
            if not done[r]:
                drafters[r].observe(states[r])
        t5 = time.perf_counter()
        for r in active:
            s = stats[r]
            s.time_draft += t1 - t0
            s.time_verify += t2 - t1
            s.time_accept += t3 - t2
            s.time_compact += t4 - t3
            s.time_observe += t5 - t4

    total = time.perf_counter() - start
    for r, s in enumerate(stats):
        s.new_tokens, s.time_total = len(new_tokens[r]), total
    return BatchOutput([s.sequence for s in states], stats)
