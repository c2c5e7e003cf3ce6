"""Drafting policies saved per kind of machine, for every drafter family that saves one.

What a draft tree costs against what it returns depends on the machine: on a CPU a verified node costs time (more
on an AVX2 core than on an AVX-512 one), on a GPU it is nearly free. So a saved drafter keeps, beside its default
policy, one calibrated policy per kind of machine (``selfspec.runtime.kernels.machine_class``: ``x86_64-avx2``,
``x86_64-avx512``, ``x86_64-avx512-amx``, ``cuda``...), each as ``{"policy": {...}, "calibrated_on": "<CPU or GPU
name>", "date": "YYYY-MM-DD"}``. A drafter loaded on a machine of a class with an entry drafts with that entry's
policy, whole (not merged over the default: a policy is measured as one), else with the default; explicit options
override either. ``selfspec calibrate`` writes the entries.

Feature drafters keep them in ``decoding_by_machine``, early-exit classifiers in ``policy_by_machine``, Medusa heads
in ``drafting_by_machine`` (whose policies are ``{"tree": [...], "dynamic_tree": {...} or null}``). Layer-skip sets
have none: the set itself is searched per model (``scripts/search_layer_skip.py``).
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Callable, NamedTuple


def check_entries(entries: dict | None, where: str) -> None:
    """Raises: ValueError: ``entries`` (a config's per-machine field, named ``where``) is not ``{class: {"policy":
    {...}, ...}}``, naming the bad entry."""
    if entries is None:
        return
    if not isinstance(entries, dict):
        raise ValueError(f"{where} must be an object {{machine class: {{'policy': {{...}}}}}}, got {entries!r}")
    for machine, entry in entries.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("policy"), dict):
            raise ValueError(f"{where}[{machine!r}] must be an object with a 'policy' object (as `selfspec "
                             f"calibrate` writes it), got {entry!r}; fix or remove the entry")


def policy_for(default: dict | None, entries: dict | None, machine: str,
               fields: tuple[str, str]) -> tuple[dict, str]:
    """``(options, where)``: the policy saved for machines of class ``machine`` (its entry in ``entries``, whole),
    else ``default``; ``where`` names which, by the config's ``fields`` (default's, entries'): ``"decoding"`` or
    ``"decoding_by_machine['x86_64-avx512']"``, say."""
    entry = (entries or {}).get(machine)
    if entry is not None:
        return dict(entry["policy"]), f"{fields[1]}[{machine!r}]"
    return dict(default or {}), fields[0]


def source_label(where: str, machine: str) -> str:
    """What a loaded drafter reports as the origin of its policy (``policy_for``'s ``where``): ``default`` or
    ``calibrated for <machine>``."""
    return f"calibrated for {machine}" if where.endswith("]") else "default"


class Saved(NamedTuple):
    """What a saved drafter asks for on a machine (``saved_for``)."""

    options: dict  # the policy's options
    where: str  # the config field they come from, e.g. "decoding_by_machine['x86_64-avx512']" (for messages)
    source: str  # what the loaded drafter reports: "default" or "calibrated for <machine class>"


def saved_for(lookup: Callable[[str], tuple[dict, str]], device: Any = None) -> Saved:
    """The policy a saved drafter drafts with on this machine: ``lookup`` (its config's ``policy_for`` or
    ``drafting_for``, ``machine class -> (options, where)``) asked for the class of the machine ``device`` is on
    (``selfspec.runtime.kernels.machine_class``; None: this CPU)."""
    from selfspec.runtime.kernels import machine_class

    machine = machine_class(device)
    options, where = lookup(machine)
    return Saved(options, where, source_label(where, machine))


def with_entry(entries: dict | None, machine: str, policy: dict[str, Any], calibrated_on: str) -> dict:
    """``entries`` with ``machine``'s entry set to ``policy``, calibrated on ``calibrated_on`` today."""
    return {**(entries or {}), machine: {"policy": dict(policy), "calibrated_on": calibrated_on,
                                         "date": datetime.date.today().isoformat()}}


def card_lines(entries: dict | None, describe: Callable[[dict], str] | None = None) -> list[str]:
    """Markdown for a drafter card: a table of the per-machine policies (none: no lines), each shown as JSON or as
    ``describe(policy)`` says."""
    if not entries:
        return []
    lines = ["## Drafting calibrated per kind of machine", "",
             "Used instead of the default where the machine is of this class "
             "(`selfspec.runtime.kernels.machine_class`); explicit options override either.", "",
             "| machine class | policy | calibrated on |", "|---|---|---|"]
    describe = describe or (lambda policy: f"`{json.dumps(policy)}`")
    lines += [f"| {machine} | {describe(entry['policy'])} | "
              f"{' '.join(str(entry[k]) for k in ('calibrated_on', 'date') if entry.get(k)) or '-'} |"
              for machine, entry in sorted(entries.items())]
    return lines + [""]


__all__ = ["card_lines", "check_entries", "policy_for", "source_label", "with_entry"]
