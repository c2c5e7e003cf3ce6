"""The drafter interface every draft method implements, and the registry the CLI and benchmark read.

A drafter never runs the verification itself. The decode loop calls, in order::

    begin(state)            once, after the prefill forward
    propose(state) -> tree  before every verification (None or an empty tree: plain decoding this step)
    observe(state)          after every verification, once the cache holds the accepted tokens

``state.hidden`` holds the base model's hidden states (for the layers the drafter lists in ``hidden_layers``) of
the tokens the last forward appended to the cache and that were accepted: the whole prompt after prefill; the
root and the accepted nodes after a verification. ``state.hidden[-1][:, -1]`` is therefore always the hidden state
that predicted the current root, which is all Medusa heads need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, runtime_checkable

import torch

from .tree import DraftTree


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


class EmptyDrafter(DrafterBase):
    """Proposes nothing: the loop degenerates to plain decoding (one token per base forward)."""

    def propose(self, state: DecodeState) -> DraftTree | None:
        return None


# name -> factory(model, heads_dir or None, **options) -> Drafter
DrafterFactory = Callable[..., Drafter]
_REGISTRY: dict[str, DrafterFactory] = {}


def register_drafter(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    """Register a drafter factory under ``name`` for ``selfspec generate --draft NAME`` and the benchmark."""

    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = factory
        return factory

    return wrap


def _load_builtin_drafters() -> None:
    # Drafter packages register themselves on import; decoding itself never depends on them.
    import importlib

    for module in ("medusa", "early_exit"):
        try:
            importlib.import_module(module)
        except ImportError:
            pass


def available_drafters() -> list[str]:
    _load_builtin_drafters()
    return sorted(_REGISTRY)


def make_drafter(name: str, model: Any, heads: str | None = None, **options: Any) -> Drafter:
    """Build a registered drafter; ``"a+b"`` combines drafters into one tree (``decoding.lookup.combine``).

    In a combination, ``heads`` and the unprefixed ``options`` go to the first drafter; ``"b.key"`` options go to
    drafter ``b`` (e.g. ``make_drafter("medusa+lookup", model, DIR, **{"lookup.num_tokens": 6})``).

    Raises:
        KeyError: unknown drafter name (the message lists the known ones).
    """
    _load_builtin_drafters()
    if "+" in name:
        parts = name.split("+")
        return make_combined([(part, heads if i == 0 else None) for i, part in enumerate(parts)], model, options)
    if name not in _REGISTRY:
        raise KeyError(f"unknown drafter {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](model, heads, **options)


def make_combined(parts: list[tuple[str, str | None]], model: Any, options: dict[str, Any]) -> Drafter:
    """Drafters ``[(name, heads), ...]`` combined into one tree; see ``make_drafter`` for how options are routed.

    Raises:
        KeyError: an unknown drafter name. ValueError: a prefixed option for a drafter not in ``parts``.
    """
    from .lookup import combine

    names = [n for n, _ in parts]
    routed: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, value in options.items():
        target, dot, option = key.partition(".")
        if not dot:
            target, option = names[0], key
        if target not in routed:
            raise ValueError(f"option {key!r} is for drafter {target!r}, which is not among {names}")
        routed[target][option] = value
    return combine(*[make_drafter(n, model, h, **routed[n]) for n, h in parts])


register_drafter("none")(lambda model, heads=None, **_: EmptyDrafter())
