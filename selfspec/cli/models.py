"""``selfspec models``: list the model aliases and their cache state; ``--prepare ALIAS`` converts one now."""

from __future__ import annotations

import argparse

from selfspec.runtime.models import DEFAULT_MODEL, cache_home, list_models, resolve_model


def register(subparsers) -> None:
    parser = subparsers.add_parser("models", help="list model aliases and their cached copies",
                                   description="List the model aliases, whether each is converted in the cache "
                                               "($SELFSPEC_HOME, default ~/.cache/selfspec), where, and its size.")
    parser.add_argument("--prepare", metavar="NAME", action="append", default=[],
                        help="convert (or download) NAME now, so that later loads are fast; repeatable")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    for name in args.prepare:
        print(f"{name}: ready in {resolve_model(name)}")
    entries = list_models()
    width = max(len(e["name"]) for e in entries)
    print(f"cache: {cache_home()}")
    for e in entries:
        state = f"cached {_size(e['size_bytes']):>8}" if e["cached"] else "not cached     "
        default = " (default)" if e["name"] == DEFAULT_MODEL else ""
        print(f"{e['name']:<{width}}  {state}  {e['path']}  {e['description']}{default}")
    return 0


def _size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")
