"""The decode loop: prefill, then propose -> verify (one base forward over the whole tree) -> accept -> compact.

Invariant between steps: the KV cache holds every token of ``sequence`` except the last one, the *root*. The root
is always a token the base model itself produced (argmax or sample), so each verification step yields the
accepted draft nodes plus one more token, and a step with no draft is exactly one step of plain decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from decoding import verify
from decoding.drafter import DecodeState, Drafter, EmptyDrafter, SamplingParams
from decoding.tree import DraftTree
from selfspec.runtime import cache as kv

# Cache entries preallocated beyond prompt + max_new_tokens, for the tree of the last step (more grows the buffer).
_TREE_SLACK = 128
_CPU = torch.device("cpu")


@dataclass
class GenerationStats:
    """Per-call statistics. ``tau`` is the mean number of tokens produced per verification step."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    tokens_per_step: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_accept: float = 0.0  # choosing the accepted path (greedy or speculative sampling)
    time_compact: float = 0.0  # rolling the KV cache back to the accepted path
    time_observe: float = 0.0  # the drafter's bookkeeping after a step (e.g. prefix attention, adapter caches)
    time_total: float = 0.0

    @property
    def tau(self) -> float:
        return sum(self.tokens_per_step) / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens, "new_tokens": self.new_tokens, "steps": self.steps,
            "tau": self.tau, "tokens_per_s": self.tokens_per_s,
            "accepted_per_step": self.accepted_per_step, "tree_sizes": self.tree_sizes,
            "time": {"prefill": self.time_prefill, "draft": self.time_draft, "verify": self.time_verify,
                     "accept": self.time_accept, "compact": self.time_compact, "observe": self.time_observe,
                     "total": self.time_total},
        }


@dataclass
class GenerateOutput:
    sequences: torch.Tensor  # [1, prompt + new]
    stats: GenerationStats


def context_length(model) -> int | None:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return None


def model_vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


def _eos_set(model, eos_token_id: int | Iterable[int] | None) -> set[int]:
    if eos_token_id is None:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return set()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    return {int(t) for t in eos_token_id}


def prune_to_depth(tree: DraftTree, max_depth: int) -> DraftTree:
    """Drop nodes deeper than ``max_depth`` (their tokens could not be used within the token budget)."""
    if tree.max_depth <= max_depth:
        return tree
    keep = tree.depth <= max_depth
    new_index = torch.cumsum(keep.long(), 0) - 1
    parents = tree.parents[keep]
    parents = torch.where(parents >= 0, new_index[parents.clamp_min(0)], parents)
    probs = None if tree.draft_probs is None else tree.draft_probs[keep]
    return DraftTree(tree.tokens[keep], parents, probs)


def tree_attention_mask(tree: DraftTree, prefix_length: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[1, 1, n + 1, prefix + n + 1]`` additive mask: every tree token sees the prefix and its own ancestors."""
    n1 = len(tree) + 1
    mask = torch.zeros(1, 1, n1, prefix_length + n1, dtype=dtype, device=device)
    mask[0, 0, :, prefix_length:].masked_fill_(~tree.ancestor_mask.to(device), torch.finfo(dtype).min)
    return mask


def verify_forward(model, cache, root: int, tree: DraftTree, *, output_hidden_states: bool = False):
    """One base forward over the root and every tree node, each seeing the cached prefix and its own ancestors
    (depth position ids, tree attention mask). Appends ``len(tree) + 1`` entries to ``cache``; returns the model
    output, whose ``logits[0]`` is ``[n + 1, vocab]`` with row 0 for the root."""
    prefix_length = cache.get_seq_length()
    device = model.get_output_embeddings().weight.device
    step_ids = torch.cat([torch.tensor([root]), tree.tokens.cpu()]).unsqueeze(0).to(device)
    positions = (prefix_length + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])).unsqueeze(0).to(device)
    mask = None if len(tree) == 0 else tree_attention_mask(tree, prefix_length, model.dtype, device)
    window = kv.sliding_window_by_layer_type(model)
    if mask is not None and window:
        mask = _per_layer_type(mask, positions[0], prefix_length, window)
    return model(input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                 output_hidden_states=output_hidden_states)


def _per_layer_type(mask: torch.Tensor, positions: torch.Tensor, prefix_length: int, window: int) -> dict:
    """A tree mask as the per-layer-type mapping a decoder with sliding-window layers takes: the full-attention
    layers' is ``mask``; the sliding layers' also hides each row's prefix keys at or before its position minus the
    ``window`` (transformers' rule: key ``j`` is seen from position ``p`` when ``j > p - window``). A node's own
    ancestors are never that far back: a tree is shallower than any window."""
    keys = torch.arange(prefix_length, device=mask.device)
    too_old = keys[None, :] <= (positions.to(mask.device)[:, None] - window)
    sliding = mask.clone()
    sliding[0, 0, :, :prefix_length].masked_fill_(too_old, torch.finfo(mask.dtype).min)
    return {"full_attention": mask, "sliding_attention": sliding}


def _check_inputs(model, drafter, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"selfspec.generate decodes one sequence at a time (batch size 1), got batch size {input_ids.shape[0]}; "
            "decode several prompts together with decoding.batch.generate_batch(model, drafter, prompts)"
        )
    if input_ids.shape[1] < 1:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    limit = context_length(model)
    if limit is not None and input_ids.shape[1] + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
            f"of {limit} tokens; shorten the prompt or lower max_new_tokens to {max(limit - input_ids.shape[1], 0)}"
        )
    drafter_vocab = getattr(drafter, "vocab_size", None)
    vocab = model_vocab_size(model)
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab:
        bad = int(input_ids.max()) if int(input_ids.max()) >= vocab else int(input_ids.min())
        raise ValueError(f"input_ids holds token id {bad}, outside the model's vocabulary (0..{vocab - 1}): were the "
                         "prompt ids made by another tokenizer?")
    if drafter_vocab is not None and drafter_vocab != vocab:
        raise ValueError(
            f"the drafter proposes tokens from a vocabulary of {drafter_vocab} but the model's has {vocab}: "
            "it was built for another tokenizer; use a drafter trained for this model"
        )


def _stops(criteria, sequence: torch.Tensor, scores: torch.Tensor) -> bool:
    """Whether transformers stopping ``criteria`` (None: none) end generation at ``sequence``."""
    if criteria is None:
        return False
    return bool(torch.as_tensor(criteria(sequence, scores)).any())


def process_rows(processor, sequence: torch.Tensor, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    """Apply transformers logits ``processor`` to every verification row with that row's own prefix: row 0 (the
    root's) reads ``sequence``, row ``i + 1`` (node ``i``) reads ``sequence`` followed by the tokens on the path down
    to node ``i``, exactly the ``input_ids`` ``model.generate`` would hand the processor at that point."""
    rows = []
    paths = tree.token_paths
    for i in range(len(tree) + 1):
        prefix = sequence if i == 0 else torch.cat([sequence, sequence.new_tensor([paths[i - 1]])], dim=1)
        rows.append(processor(prefix, logits[i:i + 1]))
    return torch.cat(rows, dim=0)


def _choose(logits: torch.Tensor, sampling: SamplingParams, generator) -> int:
    if sampling.greedy:
        return int(logits.max(-1).indices)  # argmax (first maximal index), vectorised (see verify.greedy)
    return int(torch.multinomial(verify.target_probs(logits[None], sampling)[0], 1, generator=generator))


@torch.inference_mode()
def generate(
    model,
    drafter: Drafter | None,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    streamer=None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    acceptance: str = "auto",
    generation_config=None,
    stopping_criteria=None,
    logits_processor=None,
) -> GenerateOutput:
    """Generate with tree speculative decoding; greedy output equals ``model.generate(do_sample=False)``.

    Args:
        model: a transformers causal LM (stock modeling code), in eval mode.
        drafter: any :class:`Drafter`; ``None`` decodes plainly.
        input_ids: ``[1, seq]`` prompt.
        temperature: 0 for greedy; otherwise sampling with ``top_k`` / ``top_p`` exactly as transformers applies them.
        eos_token_id: one id or several; ``None`` takes the model's generation config. EOS inside an accepted path
            ends generation there (the EOS token is kept, as in transformers).
        streamer: a transformers streamer (``TextStreamer``...): receives the prompt, then each step's new tokens.
        acceptance: ``"auto"`` (greedy, or speculative sampling when temperature > 0), ``"greedy"``,
            ``"speculative"`` or ``"typical"`` (Medusa's typical acceptance: faster, NOT lossless).
        generation_config: a transformers ``GenerationConfig``; when given, its ``max_new_tokens``, ``do_sample``,
            ``temperature``, ``top_k``, ``top_p`` and ``eos_token_id`` replace the keyword arguments.
        stopping_criteria: transformers ``StoppingCriteria`` (or a ``StoppingCriteriaList``, e.g. with
            ``StopStringCriteria``): checked after every new token, in order, with the scores that chose it, as
            ``generate`` does; the token that triggers one is kept and decoding ends there.
        logits_processor: transformers ``LogitsProcessor``(s) that change the target distribution (repetition
            penalty, no-repeat n-grams, bad words...): applied to every tree node's logits with that node's own
            prefix (:func:`process_rows`), before greedy or sampling acceptance, so that the output still equals
            ``model.generate`` with the same processors.

    Raises:
        ValueError: batch size > 1, max_new_tokens < 1, prompt + max_new_tokens beyond the context, a drafter whose
            vocabulary differs from the model's, an unknown acceptance rule.
    """
    if generation_config is not None:
        gc = generation_config
        max_new_tokens = gc.max_new_tokens if gc.max_new_tokens is not None else max_new_tokens
        temperature = (gc.temperature if gc.temperature is not None else 1.0) if gc.do_sample else 0.0
        top_k, top_p = (gc.top_k, gc.top_p) if gc.do_sample else (None, None)
        eos_token_id = gc.eos_token_id if gc.eos_token_id is not None else eos_token_id
    drafter = drafter if drafter is not None else EmptyDrafter()
    _check_inputs(model, drafter, input_ids, max_new_tokens)
    sampling = SamplingParams(temperature=float(temperature or 0.0), top_k=top_k, top_p=top_p)
    if acceptance == "auto":
        acceptance = "greedy" if sampling.greedy else "speculative"
    if acceptance not in ("greedy", "speculative", "typical"):
        raise ValueError(f"unknown acceptance rule {acceptance!r}; use auto, greedy, speculative or typical")
    if acceptance == "greedy" and not sampling.greedy:
        raise ValueError("acceptance='greedy' needs temperature 0; use 'speculative' to sample losslessly")
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(seed)
    eos = _eos_set(model, eos_token_id)
    device = input_ids.device
    hidden_layers = tuple(getattr(drafter, "hidden_layers", ()))
    want_hidden = bool(hidden_layers)
    vocab = model_vocab_size(model)
    stats = GenerationStats(prompt_tokens=input_ids.shape[1])
    start = time.perf_counter()

    # 1. Prefill: the whole prompt, logits for the last position only.
    cache = kv.new_cache(model, capacity=input_ids.shape[1] + max_new_tokens + _TREE_SLACK)
    out = model(input_ids=input_ids, cache=cache, use_cache=True, output_hidden_states=want_hidden, logits_to_keep=1)
    if logits_processor is not None:
        out.logits[0, -1:] = logits_processor(input_ids, out.logits[0, -1:])
    root = _choose(out.logits[0, -1], sampling, generator)
    new_tokens = [root]
    state = DecodeState(model=model, cache=cache, sampling=sampling, generator=generator,
                        sequence=torch.cat([input_ids, input_ids.new_tensor([[root]])], dim=1),
                        hidden={layer: out.hidden_states[layer] for layer in hidden_layers} if want_hidden else {})
    if streamer is not None:
        streamer.put(input_ids.cpu())
        streamer.put(torch.tensor([root]))
    done = root in eos or max_new_tokens == 1 or _stops(stopping_criteria, state.sequence, out.logits[0, -1:])
    if not done:
        drafter.begin(state)
    stats.time_prefill = time.perf_counter() - start

    while not done:
        prefix_length = state.cache_length
        remaining = max_new_tokens - len(new_tokens)

        # 2. Propose a tree below the root; nodes deeper than the budget could never be emitted.
        t0 = time.perf_counter()
        tree = drafter.propose(state)
        if tree is None:
            tree = DraftTree.empty()
        # Tree structure lives on the CPU (depth, masks, paths); drafters on a GPU may build it there.
        tree = prune_to_depth(tree.to(_CPU), remaining - 1)
        if len(tree) and int(tree.tokens.max()) >= vocab:
            raise ValueError(f"drafter proposed token id {int(tree.tokens.max())} outside the model's vocabulary ({vocab})")
        t1 = time.perf_counter()

        # 3. Verify: one forward over root + all nodes, each seeing the prefix and its own ancestors.
        out = verify_forward(model, state.cache, root, tree, output_hidden_states=want_hidden)
        logits = out.logits[0]  # [n + 1, vocab]
        if logits_processor is not None:
            logits = process_rows(logits_processor, state.sequence, tree, logits)
        t2 = time.perf_counter()

        # 4. Accept the longest path the base model agrees with, and the token that follows it.
        if acceptance == "greedy":
            verdict = verify.greedy(tree, logits)
        elif acceptance == "speculative":
            verdict = verify.speculative(tree, logits, sampling, generator)
        else:
            verdict = verify.typical(tree, logits, sampling, generator)
        step_tokens = [tree.token_list[i] for i in verdict.accepted] + [verdict.next_token]

        # 5. Stop at EOS or the budget, then keep only prefix + root + accepted nodes in the cache.
        for i, token in enumerate(step_tokens):
            if token in eos:
                step_tokens = step_tokens[: i + 1]
                done = True
                break
        if len(step_tokens) >= remaining:
            step_tokens = step_tokens[:remaining]
            done = True
        if stopping_criteria is not None:  # token i was chosen by logits row rows[i]: the root's, then each node's
            rows = [0] + [i + 1 for i in verdict.accepted]
            for i in range(len(step_tokens)):
                candidate = torch.cat([state.sequence, state.sequence.new_tensor([step_tokens[: i + 1]])], dim=1)
                if _stops(stopping_criteria, candidate, logits[rows[i]:rows[i] + 1]):
                    step_tokens = step_tokens[: i + 1]
                    done = True
                    break
        t3 = time.perf_counter()
        kv.keep_accepted(state.cache, prefix_length, verdict.accepted)
        t4 = time.perf_counter()
        keep_rows = [0] + [i + 1 for i in verdict.accepted]
        if want_hidden:
            index = torch.tensor(keep_rows, device=device)
            state.hidden = {layer: out.hidden_states[layer].index_select(1, index) for layer in hidden_layers}
        new_tokens.extend(step_tokens)
        root = step_tokens[-1]
        state.sequence = torch.cat([state.sequence, state.sequence.new_tensor([step_tokens])], dim=1)
        if streamer is not None:
            streamer.put(torch.tensor(step_tokens))

        stats.steps += 1
        stats.accepted_per_step.append(len(verdict.accepted))
        stats.tokens_per_step.append(len(step_tokens))
        stats.tree_sizes.append(len(tree))
        t5 = time.perf_counter()
        if not done:
            drafter.observe(state)
        t6 = time.perf_counter()
        stats.time_draft += t1 - t0
        stats.time_verify += t2 - t1
        stats.time_accept += (t3 - t2) + (t5 - t4)
        stats.time_compact += t4 - t3
        stats.time_observe += t6 - t5

    if streamer is not None:
        streamer.end()
    stats.new_tokens = len(new_tokens)
    stats.time_total = time.perf_counter() - start
    return GenerateOutput(sequences=state.sequence, stats=stats)
