"""Writing a benchmark's results: ``results.json``, ``results.md`` (a markdown table) and ``results.png``."""

from __future__ import annotations

import json
from pathlib import Path

# The object-oriented matplotlib API needs no backend choice and touches no global pyplot state.
from matplotlib.figure import Figure


def _fmt(value, spec: str = ".2f") -> str:
    return "N/A" if value is None else format(value, spec)


def lossless_cell(entry: dict) -> str:
    """``"10/10"``, or ``"9/10 (1 near-tie)"``, ``"8/10 (2 BUG)"``; ``"N/A"`` when sampling."""
    if entry.get("identical") is None:
        return "N/A"
    text = f"{entry['identical']}/{entry['total']}"
    ties = sum(d["near_tie"] for d in entry["divergences"])
    notes = [f"{ties} near-tie"] * bool(ties) + [f"{entry['bugs']} BUG"] * bool(entry["bugs"])
    return f"{text} ({', '.join(notes)})" if notes else text


def markdown_table(results: dict) -> str:
    """One row per method: tokens/s, speedup over vanilla (and its 95% interval over the prompts), tau, identical
    outputs and where the time went."""
    lines = ["| method | tokens/s | speedup | tau | first-token acceptance | draft ms/token | identical to vanilla "
             "| time per phase (s) |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for name, e in results["methods"].items():
        phases = ", ".join(f"{k} {v:.2f}" for k, v in e["time_per_phase"].items()) or "-"
        interval = e.get("speedup_ci")
        speedup = f"{_fmt(e['speedup'])}x" + (f" ({interval[0]:.2f}-{interval[1]:.2f})" if interval else "")
        lines.append(f"| {name} | {_fmt(e['tokens_per_s'])} | {speedup} | {_fmt(e['tau'])} | "
                     f"{_fmt(e.get('first_token_acceptance'))} | {_fmt(e.get('draft_ms_per_token'))} | "
                     f"{lossless_cell(e)} | {phases} |")
    return "\n".join(lines) + "\n"


def category_lines(results: dict) -> str:
    """Speedup over vanilla (and tau) per method and prompt category, or an empty string when the prompts carry
    fewer than two categories."""
    methods = {name: e.get("per_category") for name, e in results["methods"].items() if e.get("per_category")}
    categories = list(dict.fromkeys(c for per in methods.values() for c in per))
    if len(categories) < 2:
        return ""
    prompts = {c: next(per[c]["prompts"] for per in methods.values() if c in per) for c in categories}
    lines = ["Speedup over vanilla (tau) per prompt category", "",
             "| method | " + " | ".join(f"{c} ({prompts[c]})" for c in categories) + " |",
             "|---|" + "---:|" * len(categories)]
    for name, per in methods.items():
        cells = []
        for c in categories:
            e = per.get(c)
            cells.append("-" if e is None else f"{_fmt(e['speedup'])}x ({_fmt(e['tau'])})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _paragraph(text: str) -> str:
    return text + "\n" if text else ""


def fallback_lines(results: dict) -> str:
    """For each method with a fallback (``a|b``): the share of its steps whose tree came from each drafter, or an
    empty string when no method has one."""
    rows = []
    for name, e in results["methods"].items():
        counts, steps = e.get("fallback_steps"), e.get("steps")
        if not counts or not steps:
            continue
        shares = [f"{drafter} {n / steps:.0%}" for drafter, n in counts.items()]
        rows.append(f"| {name} | {', '.join(shares)} | {1 - sum(counts.values()) / steps:.0%} |")
    if not rows:
        return ""
    return "\n".join(["Fallbacks: the share of steps whose tree came from each drafter", "",
                      "| method | tree from | no tree |", "|---|---|---:|", *rows]) + "\n"


def drafter_lines(results: dict) -> str:
    """What each method's drafters ran with (``drafter_settings``: a feature drafter's tree resolved for this kind of
    machine, lookup's budget...), or an empty string when no method records any."""
    rows = [f"| {name} | {d['drafter']} | " + ", ".join(f"{k}={v}" for k, v in d["settings"].items())
            + f" | {d.get('policy_source', '-')} |"
            for name, e in results["methods"].items() for d in e.get("drafters") or ()]
    if not rows:
        return ""
    return "\n".join(["Drafters as run", "", "| method | drafter | settings | policy from |", "|---|---|---|---|",
                      *rows]) + "\n"


def divergence_lines(results: dict) -> str:
    """A table of every output that differs from vanilla's, or an empty string when none does."""
    rows = [f"| {name} | {d['prompt']} | {d['position']} | {_fmt(d['gap'], '.2e')} | "
            f"{'near-tie (fp32 rounding)' if d['near_tie'] else 'BUG'} |"
            for name, e in results["methods"].items() for d in e["divergences"]]
    if not rows:
        return ""
    return "\n".join(["## Divergences from vanilla", "", "| method | prompt | first differing token | vanilla top-2 "
                      "logit gap | verdict |", "|---|---|---:|---:|---|", *rows]) + "\n\n"


def config_lines(config: dict) -> str:
    return "\n".join(f"- {k}: `{v}`" for k, v in config.items()) + "\n"


def plot_results(results: dict, path: Path) -> None:
    """Bars of tokens/s, speedup (with the 1x line) and tau per method."""
    names = list(results["methods"])
    entries = [results["methods"][n] for n in names]
    fig = Figure(figsize=(4 + 1.4 * len(names), 3.6), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, key, title in zip(axes, ("tokens_per_s", "speedup", "tau"), ("tokens/s", "speedup over vanilla", "tau")):
        values = [e[key] or 0.0 for e in entries]
        errors = None
        if key == "speedup" and any(e.get("speedup_ci") for e in entries):  # the 95% interval over the prompts
            errors = [[v - e["speedup_ci"][0] if e.get("speedup_ci") else 0.0 for v, e in zip(values, entries)],
                      [e["speedup_ci"][1] - v if e.get("speedup_ci") else 0.0 for v, e in zip(values, entries)]]
        ax.bar(range(len(names)), values, color="tab:blue", yerr=errors, capsize=3 if errors else 0)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        if key == "speedup":
            ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    fig.suptitle(f"{results['config'].get('model', '')}, max_new_tokens {results['config'].get('max_new_tokens')}",
                 fontsize=9)
    fig.savefig(path, dpi=120)


def write_results(results: dict, out_dir: str | Path) -> dict[str, Path]:
    """Write results.json, results.md and results.png into ``out_dir`` (created); returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md", "png": out / "results.png"}
    paths["json"].write_text(json.dumps(results, indent=2) + "\n")
    paths["md"].write_text("# Benchmark\n\n" + markdown_table(results) + "\n" + _paragraph(category_lines(results))
                           + _paragraph(fallback_lines(results)) + _paragraph(drafter_lines(results))
                           + divergence_lines(results) + config_lines(results["config"]))
    plot_results(results, paths["png"])
    return paths
