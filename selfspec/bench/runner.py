"""The benchmark core: run methods side by side on the same prompts (warmed up, order rotated per prompt), then
summarise speed and the lossless check against ``vanilla``.

Everything is injectable: pass any model, a list of ``[1, seq]`` prompt tensors and ``Method`` objects to
``run_benchmark``; ``load_prompts`` is only the command line's way of getting them (``tiny:ARCH`` test models take
synthetic prompts of random ids when no prompts file is given).
"""

from __future__ import annotations

import datetime
import os
import platform
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import transformers
from tqdm.auto import tqdm

from selfspec.bench.cost import cpu_model
from selfspec.bench.methods import (
    BackendMethod,
    DrafterMethod,
    Generation,
    GenSettings,
    Method,
    drafter_settings,
    parse_method,
)
from selfspec.runtime.prompts import choose_prompts, encode_prompt, read_prompts

REFERENCE = "vanilla"
#: a divergence where vanilla's top-2 logits are closer than this is fp32 rounding, not a bug
NEAR_TIE = 1e-4


@dataclass
class Prompt:
    id: Any
    input_ids: torch.Tensor  # [1, seq]
    category: str | None = None  # the file's ``category`` (MT-bench / Spec-Bench), for per-category figures


def synthetic_prompts(vocab_size: int, count: int, *, seed: int = 0, min_len: int = 4,
                      max_len: int = 16) -> list[Prompt]:
    """``count`` prompts of random token ids (ids 0 and 1 are left out: pad / bos in the tiny configs)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=gen).tolist()
    return [Prompt(f"synthetic-{i}", torch.randint(2, vocab_size, (1, n), generator=gen))
            for i, n in enumerate(lengths)]


def load_prompts(tokenizer: Any, path: str | None, limit: int | None, *, vocab_size: int, seed: int = 0,
                 synthetic: bool = False, spread: bool = False) -> list[Prompt]:
    """Prompts from a Spec-Bench JSONL file (first turn, chat template; ``spread``: ``limit`` of them evenly spaced
    over the file, see ``read_prompts``); without a file, for a model without a tokenizer or with ``synthetic`` (tiny
    test models: ``is_test_model``), ``limit or 4`` prompts of random ids.

    Raises:
        ValueError: no prompts file for a real model.
    """
    if not path:
        if synthetic or tokenizer is None:
            return synthetic_prompts(vocab_size, limit or 4, seed=seed)
        raise ValueError("--prompts FILE.jsonl is required for a model with a tokenizer")
    every = read_prompts(path)  # once: the choice below and the category check both read it
    chosen = choose_prompts(every, limit, spread=spread)
    if limit is not None and not spread:
        missing = category_gap(every, chosen)
        if missing:
            warnings.warn(f"the first {len(chosen)} prompts of {path} cover {len(missing[0])} of its "
                          f"{len(missing[0]) + len(missing[1])} categories ({', '.join(missing[0])}; not "
                          f"{', '.join(missing[1])}): figures on them are not the file's; add --spread to take "
                          "prompts from every part of the file", stacklevel=2)
    return [Prompt(p["id"], encode_prompt(tokenizer, p["prompt"]), p.get("category")) for p in chosen]


def category_gap(every: Sequence[dict], chosen: Sequence[dict]) -> tuple[list[str], list[str]] | None:
    """``(covered, left out)`` categories where ``chosen`` misses some of ``every`` prompt's (both from
    ``read_prompts``), else None (also for prompts without categories)."""
    every = list(dict.fromkeys(p["category"] for p in every if p.get("category")))
    covered = list(dict.fromkeys(p["category"] for p in chosen if p.get("category")))
    left = [c for c in every if c not in covered]
    return (covered, left) if covered and left else None


def eos_of(model: Any, tokenizer: Any) -> int | list[int] | None:
    """The tokenizer's EOS if it has one, else the model's generation config's."""
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        return tokenizer.eos_token_id
    return getattr(model.generation_config, "eos_token_id", None)


@dataclass
class BenchRun:
    """Raw results: ``generations[method][i]`` is the output for ``prompts[i]``."""

    prompts: list[Prompt]
    settings: GenSettings
    generations: dict[str, list[Generation]] = field(default_factory=dict)
    #: per method, the settings each drafter inside it ran with (``methods.drafter_settings``): a spec such as
    #: ``eagle:DIR`` resolves to the policy saved for this kind of machine, which results must record
    drafters: dict[str, list[dict]] = field(default_factory=dict)


def run_benchmark(model: Any, prompts: Sequence[Prompt], methods: Sequence[Method | str], settings: GenSettings, *,
                  warmup_tokens: int = 16, reference: BenchRun | None = None, progress: bool = True) -> BenchRun:
    """Generate every prompt with every method. Each method first runs one untimed warm-up generation (the first
    prompt, ``warmup_tokens`` new tokens); then, per prompt, the methods run in an order rotated by one each prompt,
    so slow drifts of a shared machine fall on every method alike.

    ``vanilla`` is added when missing (it is the lossless reference), unless ``reference`` supplies its outputs
    from an earlier run on the same prompts and settings.
    """
    methods = [parse_method(m) if isinstance(m, str) else m for m in methods]
    if reference is not None and reference.settings != settings:
        raise ValueError("reference run was made with other generation settings")
    if reference is not None and [p.id for p in reference.prompts] != [p.id for p in prompts]:
        raise ValueError("reference run was made on other prompts")
    run = BenchRun(list(prompts), settings)
    if reference is not None:
        run.generations[REFERENCE] = reference.generations[REFERENCE]
        methods = [m for m in methods if m.name != REFERENCE]
    elif REFERENCE not in [m.name for m in methods]:
        methods = [parse_method(REFERENCE), *methods]
    names = [m.name for m in methods]
    if len(set(names)) != len(names):
        raise ValueError(f"methods listed twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    warm = replace(settings, max_new_tokens=min(warmup_tokens, settings.max_new_tokens))
    for method in methods:
        method.generate(model, run.prompts[0].input_ids, warm)
        run.generations[method.name] = [None] * len(run.prompts)  # type: ignore[list-item]
        inner, scopes = method, []
        while isinstance(inner, BackendMethod):  # METHOD@BACKEND, METHOD@WEIGHTS
            scopes.append(inner.suffix)
            inner = inner.inner
        if isinstance(inner, DrafterMethod):
            run.drafters[method.name] = [{**d, "scope": "@" + "@".join(scopes)} if scopes else d
                                         for d in drafter_settings(inner.drafter(model))]
    bar = tqdm(total=len(run.prompts) * len(methods), desc="bench", disable=not progress)
    for i, prompt in enumerate(run.prompts):
        shift = i % len(methods)
        for method in methods[shift:] + methods[:shift]:
            bar.set_postfix_str(method.name)
            run.generations[method.name][i] = method.generate(model, prompt.input_ids, settings)
            bar.update()
    bar.close()
    return run


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length mismatch counts), or None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def top2_gaps(model: Any, input_ids: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """``[len(tokens)]``: at each generated position, the base model's top-1 minus top-2 logit, recomputed with one
    forward over the prompt plus ``tokens``."""
    input_ids = input_ids.to(model.device)
    sequence = torch.cat([input_ids, input_ids.new_tensor([list(tokens)])], dim=1)
    logits = model(sequence).logits[0, input_ids.shape[1] - 1: -1].float()  # [len(tokens), vocab]
    top = logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def lossless_check(model: Any, run: BenchRun, method: str, *, near_tie: float = NEAR_TIE,
                   gaps: dict[int, torch.Tensor] | None = None) -> dict:
    """Compare ``method``'s outputs with vanilla's token for token. Each divergence records the prompt, the first
    differing position, both tokens there, vanilla's top-2 logit gap there and whether that is a near-tie (fp32
    rounding) or a bug. ``gaps`` caches the recomputed gaps per prompt index across methods."""
    gaps = {} if gaps is None else gaps
    identical, divergences = 0, []
    for i, (ours, ref) in enumerate(zip(run.generations[method], run.generations[REFERENCE])):
        pos = first_difference(ours.tokens, ref.tokens)
        if pos is None:
            identical += 1
            continue
        gap = None
        if pos < len(ref.tokens):  # past vanilla's end (it stopped, this method did not) is a bug, no gap to show
            if i not in gaps:
                gaps[i] = top2_gaps(model, run.prompts[i].input_ids, ref.tokens)
            gap = float(gaps[i][pos])
        divergences.append({
            "prompt": run.prompts[i].id, "position": pos,
            "vanilla_token": ref.tokens[pos] if pos < len(ref.tokens) else None,
            "method_token": ours.tokens[pos] if pos < len(ours.tokens) else None,
            "gap": gap, "near_tie": gap is not None and gap < near_tie,
        })
    return {"identical": identical, "total": len(run.prompts), "divergences": divergences,
            "bugs": sum(not d["near_tie"] for d in divergences)}


def summarize(model: Any, run: BenchRun, *, near_tie: float = NEAR_TIE) -> dict:
    """The ``methods`` part of results.json: per method tokens/s (total new tokens / total seconds), tau, speedup
    over vanilla, time per phase and the lossless check (only for greedy decoding, where outputs must be equal)."""
    ref_speed = tokens_per_s(run.generations[REFERENCE])
    gaps: dict[int, torch.Tensor] = {}
    out = {}
    for name, gens in run.generations.items():
        speed = tokens_per_s(gens)
        seconds = sum(g.seconds for g in gens)
        phases: dict[str, float] = {}
        for g in gens:
            for phase, t in g.phases.items():
                phases[phase] = phases.get(phase, 0.0) + t
        if phases:
            phases["other"] = max(seconds - sum(phases.values()), 0.0)
        entry = {
            "tokens_per_s": speed, "tau": mean_tau(gens), "speedup": speed / ref_speed if ref_speed else None,
            # 95% paired bootstrap over the prompts (None for vanilla itself)
            "speedup_ci": (speedup_interval(gens, run.generations[REFERENCE])
                           if ref_speed and name != REFERENCE else None),
            "new_tokens": sum(len(g.tokens) for g in gens), "seconds": seconds,
            "steps": sum(g.steps for g in gens) if all(g.steps for g in gens) else None,
            "time_per_phase": phases,
            # Draft quality and draft cost: how often the first draft token was right, and draft seconds per
            # proposed token (a plain step costs 1 / tokens_per_s of vanilla).
            "first_token_acceptance": _ratio(gens, "first_accepted", lambda g: g.steps),
            "draft_ms_per_token": _ratio(gens, "drafted", lambda g: g.phases.get("draft"), invert=True, scale=1e3),
            # a fallback (``a|b``): steps whose tree came from each of its drafters (the rest had no tree)
            "fallback_steps": _sum_counts([g.fallback for g in gens]),
        }
        if run.settings.greedy:
            entry.update(lossless_check(model, run, name, near_tie=near_tie, gaps=gaps))
        else:
            entry.update({"identical": None, "total": len(gens), "divergences": [], "bugs": None})
        if name in run.drafters:
            entry["drafters"] = run.drafters[name]
        entry["per_prompt"] = [{"prompt": p.id, "category": p.category, "new_tokens": len(g.tokens),
                                "seconds": g.seconds, "tau": g.tau} for p, g in zip(run.prompts, gens)]
        entry["per_category"] = per_category(run, name)
        out[name] = entry
    return out


def per_category(run: BenchRun, method: str) -> dict[str, dict] | None:
    """Per prompt category (in the order categories first appear): prompts, tokens/s, speedup over vanilla on the
    same prompts, and tau; None when the prompts carry no categories (Spec-Bench reports speedups this way: a
    method's gain differs a lot between, say, coding and writing)."""
    if not any(p.category for p in run.prompts):
        return None
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(run.prompts):
        groups.setdefault(p.category or "uncategorized", []).append(i)
    out = {}
    for category, indices in groups.items():
        gens = [run.generations[method][i] for i in indices]
        ref = tokens_per_s([run.generations[REFERENCE][i] for i in indices]) if REFERENCE in run.generations else 0.0
        speed = tokens_per_s(gens)
        out[category] = {"prompts": len(indices), "tokens_per_s": speed, "speedup": speed / ref if ref else None,
                         "tau": mean_tau(gens)}
    return out


def _ratio(gens: Sequence[Generation], field_name: str, other, *, invert: bool = False,
           scale: float = 1.0) -> float | None:
    """sum(field) / sum(other(g)) over the generations (``invert``: the other way round), or None when a
    generation lacks either or the denominator is 0."""
    pairs = [(getattr(g, field_name), other(g)) for g in gens]
    if not pairs or any(a is None or b is None for a, b in pairs):
        return None
    num, den = sum(a for a, _ in pairs), sum(b for _, b in pairs)
    if invert:
        num, den = den, num
    return scale * num / den if den else None


def _sum_counts(counts: Sequence[dict[str, int] | None]) -> dict[str, int] | None:
    """Per-name sums of per-prompt counts, or None when no prompt has any."""
    total: dict[str, int] = {}
    for c in counts:
        for name, n in (c or {}).items():
            total[name] = total.get(name, 0) + n
    return total or None


def tokens_per_s(gens: Sequence[Generation]) -> float:
    seconds = sum(g.seconds for g in gens)
    return sum(len(g.tokens) for g in gens) / seconds if seconds > 0 else 0.0


def speedup_interval(gens: Sequence[Generation | dict], reference: Sequence[Generation | dict], *,
                     level: float = 0.95, resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """A ``level`` confidence interval of the speedup over ``reference`` (tokens/s over tokens/s, each total new
    tokens over total seconds, as the reported speedup), by a paired bootstrap over the prompts: the same resampled
    prompts for both, since each prompt ran every method side by side. It covers what varies from prompt to prompt
    and within the run (a VM's drift over its minutes); a whole rerun, on another day of the same VM, can move
    further. None for fewer than two prompts. Seeded: the same results give the same interval. Each item is a
    ``Generation`` or a results.json ``per_prompt`` entry (``new_tokens``, ``seconds``), so a saved run's interval
    can be computed again from its file."""
    if len(gens) < 2 or len(gens) != len(reference):
        return None

    def counts(g) -> tuple[float, float]:
        return (float(g["new_tokens"]), g["seconds"]) if isinstance(g, dict) else (float(len(g.tokens)), g.seconds)

    pairs = torch.tensor([[*counts(g), *counts(r)] for g, r in zip(gens, reference)], dtype=torch.float64)
    tokens, seconds = pairs[:, 0::2], pairs[:, 1::2]
    picks = torch.randint(len(gens), (resamples, len(gens)), generator=torch.Generator().manual_seed(seed))
    speed = tokens[picks].sum(1) / seconds[picks].sum(1)  # [resamples, 2]: the method's and the reference's
    ratios = (speed[:, 0] / speed[:, 1]).sort().values
    tail = (1.0 - level) / 2
    low, high = ratios[int(tail * (resamples - 1))], ratios[int((1.0 - tail) * (resamples - 1))]
    return [float(low), float(high)]


def mean_tau(gens: Sequence[Generation]) -> float | None:
    """Tokens per base step over all prompts: the step-weighted mean of each prompt's tau."""
    if not gens or any(g.tau is None or not g.steps for g in gens):
        return None
    return sum(g.tau * g.steps for g in gens) / sum(g.steps for g in gens)


def environment() -> dict:
    """Where and when a benchmark ran, for results.json."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.machine(), "processor": cpu_model(), "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__}
