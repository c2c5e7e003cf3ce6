"""The benchmark's method registry: a method spec such as ``vanilla``, ``hf-pld:10`` or ``medusa:DIR`` becomes a
``Method`` that generates one prompt's continuation and says how long it took.

Built in: ``vanilla`` (HF greedy ``generate``, the baseline), ``hf-pld[:N]`` (HF prompt lookup, N draft tokens),
``hf-early-exit:E`` (HF ``assistant_early_exit=E``). Every drafter in ``decoding.available_drafters()`` is a method
too (``none``, ``medusa:DIR``, ``early-exit:DIR``, ``layer-skip:DIR``...), run through ``decoding.generate``. Any
spec may end in ``@stock`` / ``@onednn`` to run on that linear backend (``selfspec.runtime.kernels``) instead of the run's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Callable, Protocol

import torch

from decoding import fallback_counts, generate
from decoding.drafter import SamplingParams
from decoding.registry import available_drafters, make_combined, make_drafter, parse_part, resolve_spec
from selfspec.runtime.cache import generate_kwargs
from selfspec.runtime.kernels import BACKENDS, DRAFT_WEIGHTS, linear_backend, using_draft_weights
from selfspec.runtime.layers import decoder_layers
from selfspec.runtime.lean import COUNTS_ONLY, stack_calls


@dataclass(frozen=True)
class GenSettings:
    """What every method is asked to do, identically: stop at ``eos_token_id`` or after ``max_new_tokens``, choosing
    tokens as ``sampling`` says (``decoding.SamplingParams``; greedy by default), sampling seeded with ``seed``."""

    max_new_tokens: int = 256
    eos_token_id: int | list[int] | None = None
    sampling: SamplingParams = SamplingParams()
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.sampling.greedy

    def to_dict(self) -> dict:
        """Flat, JSON-ready: the sampling fields beside the others (the ``config`` of results.json)."""
        return {"max_new_tokens": self.max_new_tokens, "eos_token_id": self.eos_token_id, **asdict(self.sampling),
                "seed": self.seed}


@dataclass(frozen=True)
class Generation:
    """One method's output for one prompt. ``steps`` counts base-model forwards that produced tokens (``None`` when
    unknown); ``tau`` is tokens per such step; ``phases`` maps a phase name to seconds."""

    tokens: list[int]
    seconds: float
    steps: int | None = None
    tau: float | None = None
    phases: dict[str, float] = field(default_factory=dict)
    drafted: int | None = None  # draft tokens proposed (tree nodes), when the method drafts
    first_accepted: int | None = None  # steps whose draft's first token was accepted
    # steps whose tree came from each member of a fallback (``a|b``), by name; None without a fallback
    fallback: dict[str, int] | None = None


class Method(Protocol):
    name: str

    def generate(self, model: Any, input_ids: torch.Tensor, settings: GenSettings) -> Generation: ...


# name -> factory(argument after the colon or None, options) -> Method
MethodFactory = Callable[[str | None, dict], Method]
_METHODS: dict[str, MethodFactory] = {}


def register_method(name: str) -> Callable[[MethodFactory], MethodFactory]:
    """Register a benchmark method under ``name`` (tests register deliberately broken ones)."""

    def wrap(factory: MethodFactory) -> MethodFactory:
        _METHODS[name] = factory
        return factory

    return wrap


def available_methods() -> list[str]:
    return sorted(set(_METHODS) | set(available_drafters()))


def split_methods(text: str) -> list[str]:
    """A comma-separated list of method specs, commas inside a drafter's ``[...]`` options kept:
    ``"vanilla,lookup[nodes=8,num_tokens=4]"`` -> ``["vanilla", "lookup[nodes=8,num_tokens=4]"]``.

    Raises:
        ValueError: unbalanced brackets.
    """
    specs, current, depth = [], [], 0
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            raise ValueError(f"methods {text!r}: a ']' without its '['")
        if char == "," and depth == 0:
            specs.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise ValueError(f"methods {text!r}: a '[' without its ']'")
    specs.append("".join(current))
    return [s.strip() for s in specs if s.strip()]


def parse_method(spec: str, **options: Any) -> Method:
    """Build the method named by ``spec`` (``NAME``, ``NAME:ARG``, each drafter optionally with ``[key=value,...]``:
    ``lookup[nodes=8]+datastore:DIR``); ``options`` go to a drafter's factory.

    Raises:
        KeyError: unknown method name (the message lists the known ones).
        ValueError: a malformed argument, such as a non-integer exit layer.
    """

    body, at, backend = spec.strip().rpartition("@") if "@" in spec else (spec.strip(), "", "")
    if at:
        if backend in DRAFT_WEIGHTS:
            return DraftWeightsMethod(spec.strip(), parse_method(body, **options), backend)
        if backend not in BACKENDS:
            raise ValueError(f"method {spec!r}: unknown linear backend or draft weights {backend!r} after '@' "
                             f"(a backend: {', '.join(BACKENDS)}; draft weights: {', '.join(DRAFT_WEIGHTS)})")
        return BackendMethod(spec.strip(), parse_method(body, **options), backend)
    if "+" in body or "|" in body:  # drafters combined, each NAME[:ARG][[options]]: medusa:DIR+lookup[nodes=8]
        parts, routed = resolve_spec(body, None, options)
        unknown = [p.name for p in parts if p.name not in available_drafters()]
        if unknown:
            raise KeyError(f"unknown drafter {unknown[0]!r} in {body!r}; available: {', '.join(available_drafters())}")
        label = "".join(("|" if p.fallback else "+") * (i > 0) + p.name for i, p in enumerate(parts))
        return DrafterMethod(body, label, None, routed, parts=parts)
    name, arg, part_options = parse_part(body)
    if name in _METHODS:
        return _METHODS[name](arg, {**options, **part_options})
    if name in available_drafters():
        return DrafterMethod(body, name, arg, {**options, **part_options})
    raise KeyError(f"unknown method {name!r}; available: {', '.join(available_methods())}")


class BackendMethod:
    """``METHOD@BACKEND``: ``METHOD`` with the model's linear layers on another backend (``selfspec.runtime.kernels``) for
    the duration of each generation, e.g. ``vanilla@stock`` beside a run on oneDNN."""

    def __init__(self, name: str, inner: Method, backend: str):
        self.name, self.inner, self.backend = name, inner, backend

    @property
    def suffix(self) -> str:
        """What follows ``@`` in its spec."""
        return self.backend

    def _scope(self, model: Any):
        return linear_backend(model, self.backend)

    def generate(self, model: Any, input_ids: torch.Tensor, settings: GenSettings) -> Generation:
        with self._scope(model):
            return self.inner.generate(model, input_ids, settings)


class DraftWeightsMethod(BackendMethod):
    """``METHOD@WEIGHTS``: ``METHOD`` with its drafters' own layers on these draft weights (``float16``, ``float32``,
    ``q8_0``, ``q4_1``; ``selfspec.runtime.kernels.set_draft_weights``) for the duration of each generation, so that
    two draft formats compare in one run: ``eagle:DIR@float16,eagle:DIR@q4_1``."""

    def __init__(self, name: str, inner: Method, weights: str):
        self.name, self.inner, self.weights = name, inner, weights

    @property
    def suffix(self) -> str:
        return self.weights

    def _scope(self, model: Any):
        return using_draft_weights(self.weights)


class _HFMethod:
    """HF ``model.generate`` with extra generation kwargs. Steps are counted by a hook on the last decoder layer, so
    an early-exit assistant's shallow drafting forwards are not counted as base forwards.

    On the project's kernels (any linear backend but ``stock``) ``generate`` is handed the KV cache the speculative
    decoders use (``selfspec.runtime.cache.new_cache``: preallocated buffers where transformers' cache concatenates
    on every step, and with them the decoder layers' one-call path, ``selfspec.runtime.lean``), so that speedups are
    measured against the best plain decoding the same stack gives. On ``stock`` (``vanilla@stock``) it keeps
    transformers' own cache, as shipped. HF's early-exit assistant keeps its own too."""

    def __init__(self, name: str, **generate_kwargs: Any):
        self.name = name
        self.generate_kwargs = generate_kwargs

    def generate(self, model: Any, input_ids: torch.Tensor, settings: GenSettings) -> Generation:
        input_ids = input_ids.to(model.device)
        eos = settings.eos_token_id
        pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
        sampling = {} if settings.greedy else asdict(settings.sampling)
        # forwards through the last layer (not HF's early-exit assistant's shallow ones), and whole-stack calls (a
        # hook that only counts leaves them on: selfspec.runtime.lean.COUNTS_ONLY)
        forwards = [-stack_calls(model)]

        def count(*_):
            forwards[0] += 1

        setattr(count, COUNTS_ONLY, True)
        hook = decoder_layers(model)[-1].register_forward_hook(count)
        try:
            if not settings.greedy:
                torch.manual_seed(settings.seed)
            cache = {} if "assistant_early_exit" in self.generate_kwargs else \
                generate_kwargs(model, input_ids.shape[1] + settings.max_new_tokens + 8)
            start = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                     do_sample=not settings.greedy, max_new_tokens=settings.max_new_tokens,
                                     eos_token_id=eos, pad_token_id=pad, **sampling, **self.generate_kwargs, **cache)
            seconds = time.perf_counter() - start
        finally:
            hook.remove()
            forwards[0] += stack_calls(model)
        tokens = out[0, input_ids.shape[1]:].tolist()
        steps = forwards[0] or None
        return Generation(tokens, seconds, steps, len(tokens) / steps if steps else None)


@register_method("vanilla")
def _vanilla(arg: str | None, options: dict) -> Method:
    return _HFMethod("vanilla")


@register_method("hf-pld")
def _hf_pld(arg: str | None, options: dict) -> Method:
    num_tokens = _int_arg("hf-pld", arg or options.get("num_tokens", 10))
    return _HFMethod(f"hf-pld:{num_tokens}" if arg else "hf-pld", prompt_lookup_num_tokens=num_tokens)


@register_method("hf-early-exit")
def _hf_early_exit(arg: str | None, options: dict) -> Method:
    if arg is None and "exit_layer" not in options:
        raise ValueError("hf-early-exit needs an exit layer: hf-early-exit:E")
    exit_layer = _int_arg("hf-early-exit", arg or options["exit_layer"])
    return _HFMethod(f"hf-early-exit:{exit_layer}", assistant_early_exit=exit_layer)


def _int_arg(method: str, value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{method}: expected an integer argument, got {value!r}") from None


def drafter_settings(drafter: Any) -> list[dict]:
    """What each drafter inside ``drafter`` (the members of combinations and fallbacks, in order) runs with: its
    class, its policy's fields (a dataclass ``policy``, or the attributes a class lists in ``SETTINGS``) and, where
    the drafter says, where its policy came from (``policy_source``: a feature drafter's default or the entry
    calibrated for this kind of machine)."""
    from decoding.combine import CombinedDrafter, FallbackDrafter

    if isinstance(drafter, (CombinedDrafter, FallbackDrafter)):
        return [s for member in drafter.drafters for s in drafter_settings(member)]
    policy = getattr(drafter, "policy", None)
    if is_dataclass(policy) and not isinstance(policy, type):
        fields = asdict(policy)
    else:
        fields = {name: getattr(drafter, name) for name in getattr(drafter, "SETTINGS", ())}
    entry = {"drafter": type(drafter).__name__, "settings": fields}
    if getattr(drafter, "policy_source", None):
        entry["policy_source"] = drafter.policy_source
    return [entry]


class DrafterMethod:
    """A registered drafter run through selfspec's own loop (``decoding.generate``). The drafter is built once per
    model and reused for every prompt."""

    def __init__(self, name: str, drafter: str, heads_dir: str | None, options: dict,
                 parts: list | None = None):
        self.name, self.drafter_name, self.heads_dir, self.options = name, drafter, heads_dir, dict(options)
        self.parts = parts  # [registry.Part] of a combination, else None
        self._built: tuple[Any, Any] | None = None  # (model, drafter)

    def drafter(self, model: Any) -> Any:
        if self._built is None or self._built[0] is not model:
            built = (make_combined(self.parts, model, self.options) if self.parts
                     else make_drafter(self.drafter_name, model, self.heads_dir, **self.options))
            self._built = (model, built)
        return self._built[1]

    def generate(self, model: Any, input_ids: torch.Tensor, settings: GenSettings) -> Generation:
        drafter = self.drafter(model)
        input_ids = input_ids.to(model.device)
        generator = None if settings.greedy else torch.Generator().manual_seed(settings.seed)
        before = fallback_counts(drafter)
        start = time.perf_counter()
        with torch.inference_mode():
            out = generate(model, drafter, input_ids, max_new_tokens=settings.max_new_tokens,
                           **asdict(settings.sampling), eos_token_id=settings.eos_token_id, generator=generator)
        seconds = time.perf_counter() - start
        stats = out.stats
        phases = {phase: float(getattr(stats, f"time_{phase}", 0.0) or 0.0)
                  for phase in ("prefill", "draft", "verify", "accept", "compact", "observe")}
        after = fallback_counts(drafter)
        return Generation(out.sequences[0, input_ids.shape[1]:].tolist(), seconds, getattr(stats, "steps", None),
                          getattr(stats, "tau", None), phases, drafted=sum(stats.tree_sizes),
                          first_accepted=sum(a > 0 for a in stats.accepted_per_step),
                          fallback={name: n - before.get(name, 0) for name, n in after.items()} if after else None)
