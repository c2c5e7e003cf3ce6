"""The ``selfspec`` command. Each subcommand lives in ``selfspec/cli/<name>.py`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` (called with the parsed args)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Order is the order of ``selfspec --help``. A module that is missing is simply not offered.
COMMANDS = ("models", "generate", "demo", "bench", "ablate", "calibrate", "cost", "train", "export", "datastore")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfspec", description="Self-speculative decoding for causal LMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"selfspec.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"selfspec.cli.{name}":
                continue
            raise
        module.register(sub)
    for command in sub.choices.values():  # accepted after the subcommand too: selfspec train ... --debug
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                             help="on an error, show the full traceback instead of one line")
    parser.add_argument("--debug", action="store_true", help="on an error, show the full traceback")
    return parser


def thread_environment_warning(environ=os.environ) -> str | None:
    """What the environment does to PyTorch's thread pool that costs decoding dearly, or None: under
    ``OMP_WAIT_POLICY=passive`` its threads sleep after every parallel region, and a decode step runs dozens of
    them (each kernel call, each layer), each waking the threads again."""
    if environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive":
        return ("OMP_WAIT_POLICY=passive: PyTorch's threads sleep after every parallel call and a decode step makes "
                "dozens, so decoding runs ~2x slower (a 2-core AMD EPYC: a plain step 10-11 -> 25 ms). Unset it for "
                "decoding.")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warning = thread_environment_warning()
    if warning:
        print(f"selfspec {args.command}: warning: {warning}", file=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as e:
        if args.debug:
            raise
        # User errors: one clear line, no traceback (--debug shows it).
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"selfspec {args.command}: error: {msg}", file=sys.stderr)
        return 2

