"""Where drafters are found by name: ``selfspec generate --draft NAME``, benchmark methods ``NAME[:DIR]``.

A drafter package registers a factory ``factory(model, heads_dir=None, **options) -> Drafter`` under the
packaging entry-point group ``selfspec.drafters`` in its own ``pyproject.toml``::

    [project.entry-points."selfspec.drafters"]
    my-drafter = "my_package.drafter:make_my_drafter"

so ``decoding`` names no drafter package: a third-party drafter installs with no change here. ``register_drafter``
adds one at run time (a notebook, a test). A factory is imported only when its drafter is first built.
"""

from __future__ import annotations

import functools
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable, NamedTuple

from decoding.combine import combine, fallback
from decoding.drafter import Drafter

ENTRY_POINT_GROUP = "selfspec.drafters"

# name -> factory(model, heads_dir or None, **options) -> Drafter
DrafterFactory = Callable[..., Drafter]
_REGISTERED: dict[str, DrafterFactory] = {}


def register_drafter(name: str) -> Callable[[DrafterFactory], DrafterFactory]:
    """Register a drafter factory under ``name`` at run time; it takes precedence over an installed one."""

    def wrap(factory: DrafterFactory) -> DrafterFactory:
        _REGISTERED[name] = factory
        return factory

    return wrap


@functools.cache
def installed_drafters() -> dict[str, EntryPoint]:
    """The entry points of group ``selfspec.drafters`` of every installed distribution, by name (read once;
    ``installed_drafters.cache_clear()`` reads them again)."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available_drafters() -> list[str]:
    return sorted(set(_REGISTERED) | set(installed_drafters()))


def drafter_factory(name: str) -> DrafterFactory:
    """Raises: KeyError: no drafter of that name (the message lists the known ones)."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    installed = installed_drafters()
    if name not in installed:
        raise KeyError(f"unknown drafter {name!r}; available: {', '.join(available_drafters())}")
    return installed[name].load()


def _scalar(text: str) -> Any:
    import yaml

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return value if value is None or isinstance(value, (bool, int, float, str)) else text


def parse_part(text: str) -> tuple[str, str | None, dict[str, Any]]:
    """One drafter of a spec, ``NAME[:DIR][[key=value,...]]`` -> ``(name, dir or None, options)``:
    ``"datastore:runs/ds[nodes=3]"`` -> ``("datastore", "runs/ds", {"nodes": 3})``. Values are read as YAML scalars,
    as ``--draft-option`` reads them (``3``, ``0.5``, ``true``, ``null``; anything else stays a string, e.g. ``none``).

    Raises:
        ValueError: an option without ``=``.
    """
    text = text.strip()
    options: dict[str, str] = {}
    if text.endswith("]") and "[" in text:
        text, inner = text[:text.rindex("[")], text[text.rindex("[") + 1:-1]
        for item in filter(None, (i.strip() for i in inner.split(","))):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"drafter option {item!r} in {text}[{inner}]: write key=value")
            options[key.strip()] = _scalar(value.strip())
    name, _, directory = text.partition(":")
    return name, directory or None, options


class Part(NamedTuple):
    """One drafter of a spec: its name, its directory (or None), and whether it only drafts where the part before it
    proposes nothing (``a|b``: ``b`` is a fallback of ``a``)."""

    name: str
    directory: str | None
    fallback: bool = False


def make_drafter(name: str, model: Any, heads_dir: str | None = None, **options: Any) -> Drafter:
    """Build a registered drafter; ``"a+b"`` combines drafters into one tree (``decoding.combine``), ``"a|b"`` asks
    ``b`` only in the steps where ``a`` proposes nothing (``decoding.fallback``; ``|`` binds tighter than ``+``:
    ``"lookup|eagle:HEADS+datastore:STORE"`` merges the datastore's tree with lookup's, or with the feature
    drafter's where lookup has none).

    Each part may name its own directory and options, as benchmark methods do:
    ``"medusa:HEADS+lookup[nodes=8]+datastore:STORE"`` (``parse_part``). A part without a directory gets
    ``heads_dir`` if it is the first. Unprefixed ``options`` go to the first drafter; ``"b.key"`` options go to
    drafter ``b`` (e.g. ``make_drafter("medusa+lookup", model, DIR, **{"lookup.num_tokens": 6})``).

    Raises:
        KeyError: unknown drafter name (the message lists the known ones).
        ValueError: a directory given both in ``name`` and as ``heads_dir`` for the same drafter; a malformed option.
    """
    parts, options = resolve_spec(name, heads_dir, options)
    if len(parts) > 1:
        return make_combined(parts, model, options)
    return drafter_factory(parts[0][0])(model, parts[0][1], **options)


def resolve_spec(name: str, heads_dir: str | None = None,
                 options: dict[str, Any] | None = None) -> tuple[list[tuple[str, str | None]], dict[str, Any]]:
    """``(parts, options)`` of drafter spec ``name`` (see ``make_drafter``): ``[(drafter, directory or None)]``, and
    ``options`` with each part's own ``[key=value]`` options added, prefixed ``drafter.`` in a combination (the
    routing ``make_combined`` reads).

    Raises:
        ValueError: a directory given both in ``name`` and as ``heads_dir`` for the first drafter; a malformed option.
    """
    parts, options = [], dict(options or {})
    pieces = [(parse_part(alternative), j > 0) for part in name.split("+")
              for j, alternative in enumerate(part.split("|"))]
    for i, ((part_name, part_dir, part_options), falls_back) in enumerate(pieces):
        if not part_name:
            raise ValueError(f"drafter spec {name!r}: an empty part; write NAME[:DIR] between '+' and '|'")
        if part_dir and i == 0 and heads_dir is not None:
            raise ValueError(f"drafter {part_name!r} is given two directories: {part_dir!r} in {name!r} and "
                             f"{heads_dir!r}; give one")
        parts.append(Part(part_name, part_dir or (heads_dir if i == 0 else None), falls_back))
        prefix = f"{part_name}." if len(pieces) > 1 else ""
        options.update({prefix + key: value for key, value in part_options.items()})
    return parts, options


def make_combined(parts: list[Part] | list[tuple[str, str | None]], model: Any, options: dict[str, Any]) -> Drafter:
    """Drafters ``[Part(name, heads_dir, fallback), ...]`` (or ``(name, heads_dir)`` pairs) combined into one tree,
    a part marked ``fallback`` asked only where the one before it proposes nothing; see ``make_drafter`` for how
    options are routed.

    Raises:
        KeyError: an unknown drafter name. ValueError: a prefixed option for a drafter not in ``parts``; a fallback
        as the first part.
    """
    parts = [Part(*part) for part in parts]
    if parts and parts[0].fallback:
        raise ValueError(f"drafter {parts[0].name!r} falls back from nothing: write FIRST|{parts[0].name}")
    names = [p.name for p in parts]
    routed: dict[str, dict[str, Any]] = {n: {} for n in names}
    for key, value in options.items():
        target, dot, option = key.partition(".")
        if not dot:
            target, option = names[0], key
        if target not in routed:
            raise ValueError(f"option {key!r} is for drafter {target!r}, which is not among {names}")
        routed[target][option] = value
    groups: list[list[tuple[str, Drafter]]] = []
    for part in parts:
        drafter = make_drafter(part.name, model, part.directory, **routed[part.name])
        if part.fallback:
            groups[-1].append((part.name, drafter))
        else:
            groups.append([(part.name, drafter)])
    built = [group[0][1] if len(group) == 1 else fallback(*(d for _, d in group), names=[n for n, _ in group])
             for group in groups]
    return built[0] if len(built) == 1 else combine(*built)
