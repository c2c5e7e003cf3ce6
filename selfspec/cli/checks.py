"""Argument types that check a value where the command line is read, before any model is loaded: a bad value ends
the command with one line naming the option, what was wrong and what it takes (argparse's exit code 2)."""

from __future__ import annotations

import argparse
import math


def _number(text: str, kind: type, name: str):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1 (token counts, prompt limits, threads, top-k)."""
    value = _number(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def temperature(text: str) -> float:
    """A temperature >= 0 (0 = greedy)."""
    value = _number(text, float, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = greedy decoding), got {value:g}")
    return value


def probability(text: str) -> float:
    """A top-p in (0, 1]."""
    value = _number(text, float, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] (1 keeps every token), got {value:g}")
    return value


def positive_ints(option: str, what: str):
    """An argument type for ``option``: comma-separated integers >= 1 (``what`` names them in the message)."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{option} takes comma-separated integers, got {text!r}") from None
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{option} takes {what} >= 1, got {text!r}")
        return values
    return parse
