"""The drafter interface every draft method implements (the registry that finds them by name: ``decoding.registry``).

A drafter never runs the verification itself. The decode loop calls, in order::

    begin(state)            once, after the prefill forward
    propose(state) -> tree  before every verification (None or an empty tree: plain decoding this step)
    observe(state)          after every verification, once the cache holds the accepted tokens

Drafters that score tokens keep one contract for it: ``draft_logits(...) -> (logits, column_ids)``, logits
``[..., columns]`` over their draft vocabulary and the token id of each column (``None``: column ``j`` is token
``j``), as Medusa heads, exit classifiers and layer skipping do.

``state.hidden`` holds the base model's hidden states (for the layers the drafter lists in ``hidden_layers``) of
the tokens the last forward appended to the cache and that were accepted: the whole prompt after prefill; the
root and the accepted nodes after a verification. ``state.hidden[-1][:, -1]`` is therefore always the hidden state
that predicted the current root, which is all Medusa heads need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from decoding.tree import DraftTree


@dataclass(frozen=True)
class SamplingParams:
    """How the base model's next-token distribution is shaped. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class DecodeState:
    """What the decode loop shares with the drafter. The drafter may read everything and must not change the
    prefix of ``cache`` (it may append to it temporarily, and must crop back what it appended)."""

    model: Any
    cache: Any
    # [1, seq] every token so far; the last one is the root, the only one not yet in the cache.
    sequence: torch.Tensor
    sampling: SamplingParams
    generator: torch.Generator | None = None
    # layer index -> [1, m, hidden] hidden states of the tokens the last forward added to the cache.
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def root(self) -> int:
        return int(self.sequence[0, -1])

    @property
    def cache_length(self) -> int:
        return self.sequence.shape[1] - 1


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft trees. ``hidden_layers`` names the base hidden states it needs (HF indexing of
    ``output_hidden_states``: 0 = embeddings, ``i`` = after decoder layer ``i``, -1 = last, after the final norm)."""

    hidden_layers: tuple[int, ...]

    def begin(self, state: DecodeState) -> None: ...

    def propose(self, state: DecodeState) -> DraftTree | None: ...

    def observe(self, state: DecodeState) -> None: ...


class DrafterBase:
    """Convenience base: no hidden states needed, no state to keep. Subclasses implement ``propose``."""

    hidden_layers: tuple[int, ...] = ()
    #: vocabulary size the drafter's token ids live in; None when it uses the model's own.
    vocab_size: int | None = None

    def begin(self, state: DecodeState) -> None:
        pass

    def propose(self, state: DecodeState) -> DraftTree | None:
        raise NotImplementedError

    def observe(self, state: DecodeState) -> None:
        pass


class ContextDrafter(DrafterBase):
    """Base of drafters that keep a KV cache of their own over the verified positions (Medusa's prefix attention,
    Kangaroo's attention adapter), fed with the base model's hidden states at ``context_layer`` of every token the
    decode loop accepts: ``begin`` starts it from the prompt, ``observe`` appends each step's accepted tokens.

    Subclasses set ``context_cache`` (``length``, ``reset()``; None: the drafter keeps no context, and ``begin`` and
    ``observe`` do nothing), list ``context_layer`` in ``hidden_layers`` and implement ``extend_context``.
    """

    context_layer: int = -1
    context_cache: Any = None

    def begin(self, state: DecodeState) -> None:
        if self.context_cache is not None:
            self.context_cache.reset()
            self._feed(state)

    def observe(self, state: DecodeState) -> None:
        if self.context_cache is not None:
            self._feed(state)

    def extend_context(self, state: DecodeState, hidden: torch.Tensor, positions: torch.Tensor) -> None:
        """Append the positions ``positions`` ``[1, m]`` with base hidden states ``hidden`` ``[1, m, hidden]`` to
        ``context_cache`` (called without autograd)."""
        raise NotImplementedError

    def check_context(self, state: DecodeState) -> None:
        """Raises: RuntimeError: the context cache does not hold exactly the base cache's positions (``begin``
        was not called after the prefill)."""
        if self.context_cache.length != state.cache_length:
            raise RuntimeError(f"{type(self).__name__}: its context cache holds {self.context_cache.length} "
                               f"positions but the base cache {state.cache_length}: call begin(state) after the "
                               "prefill (decoding.generate does)")

    def _feed(self, state: DecodeState) -> None:
        """Raises: RuntimeError: no hidden states of ``context_layer`` in ``state``, or they do not line up with
        the base cache."""
        hidden = state.hidden.get(self.context_layer)
        if hidden is None:
            raise RuntimeError(f"{type(self).__name__} needs the layer-{self.context_layer} hidden states of "
                               "accepted tokens (DecodeState.hidden); run it through decoding.generate")
        start, new = self.context_cache.length, hidden.shape[1]
        if start + new != state.cache_length:
            raise RuntimeError(f"{type(self).__name__}: context cache out of step: {start} + {new} new positions, "
                               f"but the base cache holds {state.cache_length}; call begin(state) after the prefill")
        positions = torch.arange(start, start + new, device=hidden.device)[None]
        with torch.no_grad():
            self.extend_context(state, hidden, positions)


class EmptyDrafter(DrafterBase):
    """Proposes nothing: the loop degenerates to plain decoding (one token per base forward)."""

    def propose(self, state: DecodeState) -> DraftTree | None:
        return None


def make_empty_drafter(model: Any, heads_dir: str | None = None, **options: Any) -> EmptyDrafter:
    """Registry factory of ``--draft none`` (plain decoding through the tree loop).

    Raises:
        ValueError: a heads directory or an option (the empty drafter takes none).
    """
    if heads_dir is not None or options:
        raise ValueError("the 'none' drafter takes no heads directory and no options")
    return EmptyDrafter()
