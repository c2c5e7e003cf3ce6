"""Hardware-aware tree calibration for Medusa heads: measure what verifying ``n`` tree nodes costs on this machine,
estimate what each tree accepts from the heads' measured accuracies, and keep the tree with the most expected
tokens per second.

For a tree grown greedily to ``n`` nodes (``medusa.trees.default_tree``), the expected tokens per step are
``1 + expected_accept_length`` (the bonus token plus the accepted draft nodes) and one step costs the verification
forward's latency ``t(n)`` plus the drafter's ``propose`` latency ``d(n)`` (the heads run once per used depth, so
deeper trees draft slower) plus an optional fixed overhead. The chosen tree maximises
``E[tokens per step] / (t(n) + d(n) + overhead)``; ``n = 0`` (plain decoding) is measured as the reference.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from decoding import by_machine
from decoding.drafter import DecodeState, Drafter, SamplingParams
from decoding.generate import verify_forward
from decoding.registry import make_drafter, resolve_spec
from decoding.tree import DraftTree, TreeTemplate
from medusa.config import MedusaConfig
from medusa.heads import MedusaHeads
from medusa.trees import default_tree, expected_accept_length
from selfspec.bench.methods import GenSettings, parse_method
from selfspec.bench.replay import replay
from selfspec.bench.runner import Prompt, mean_tau, run_benchmark, speedup_interval, tokens_per_s
from selfspec.runtime.adapters import ADAPTER_DIR
from selfspec.runtime.cache import crop, new_cache
from selfspec.runtime.io import (
    CONFIG_NAME,
    README_NAME,
    atomic_write_text,
    refresh_card_sections,
    stored_float_dtype,
)
from selfspec.runtime.kernels import DRAFT_WEIGHTS

DEFAULT_SIZES = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass(frozen=True)
class Candidate:
    """One tree size: its choices, predicted tokens per step (tau), verification latency and their ratio."""

    size: int
    choices: list[list[int]]
    predicted_tau: float
    latency_s: float  # verification forward
    draft_s: float  # drafter.propose
    tokens_per_s: float


@torch.inference_mode()
def verify_latencies(model: Any, trees: dict[int, DraftTree], *, prefix_length: int = 128, repeats: int = 7,
                     warmup: int = 2, seed: int = 0) -> dict[int, float]:
    """Median seconds of one verification forward per tree: root + nodes over a ``prefix_length`` KV cache, with
    the tree attention mask, depth positions and cache (``selfspec.runtime.cache.new_cache``) that
    ``decoding.generate`` uses. The trees are timed round-robin so that load from other processes spreads over every
    size alike."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    prefix = torch.randint(vocab, (1, prefix_length), generator=gen)
    # the decode loop's buffered cache: transformers' own copies the whole cache on every forward and keeps the
    # skinny backend's one-call layers off (a 1-token verification measured 11.2 ms here where decoding took ~9)
    cache = new_cache(model, capacity=prefix_length + max((len(t) for t in trees.values()), default=0) + 8)
    model(input_ids=prefix[:, :-1], cache=cache, use_cache=True, logits_to_keep=1)
    root = int(prefix[0, -1])
    cached = prefix_length - 1
    times: dict[int, list[float]] = {size: [] for size in trees}
    for round_ in range(warmup + repeats):
        for size, tree in trees.items():
            start = time.perf_counter()
            verify_forward(model, cache, root, tree)
            elapsed = time.perf_counter() - start
            crop(cache, cached)
            if round_ >= warmup:
                times[size].append(elapsed)
    return {size: statistics.median(ts) for size, ts in times.items()}


@torch.inference_mode()
def draft_latencies(model: Any, make: Callable[[list[list[int]]], Drafter], choices: dict[int, list[list[int]]], *,
                    repeats: int = 7, warmup: int = 2, seed: int = 0) -> dict[int, float]:
    """Median seconds of ``make(choices).propose(state)`` per tree (0 for the empty tree), on a state whose hidden
    states are random (timing only)."""
    gen = torch.Generator().manual_seed(seed)
    hidden_size = model.config.get_text_config().hidden_size
    state = DecodeState(model=model, cache=None, sequence=torch.randint(8, (1, 8), generator=gen),
                        sampling=SamplingParams())
    out = {0: 0.0}
    for size, c in choices.items():
        if not c:
            continue
        drafter = make(c)
        state.hidden = {layer: torch.randn(1, 1, hidden_size, generator=gen, dtype=model.dtype)
                        for layer in drafter.hidden_layers}
        times = []
        for round_ in range(warmup + repeats):
            start = time.perf_counter()
            drafter.propose(state)
            if round_ >= warmup:
                times.append(time.perf_counter() - start)
        out[size] = statistics.median(times)
    return out


def linear_fit(latency: dict[int, float]) -> dict[int, float]:
    """``t(n) = a + b * n`` fitted by least squares to measured latencies (at least two sizes)."""
    slope, intercept = statistics.linear_regression(list(latency), list(latency.values()))
    return {n: intercept + slope * n for n in latency}


def candidate_trees(head_accuracy: Sequence[Sequence[float]], sizes: Sequence[int]) -> dict[int, list[list[int]]]:
    """Greedy (Medusa-style) trees for every size the heads' candidates allow; size 0 is the empty tree."""
    capacity, per_depth = 0, 1
    for row in head_accuracy:  # every path of measured ranks is a possible node
        per_depth *= len(row)
        capacity += per_depth
    return {n: (default_tree(head_accuracy, n) if n else []) for n in sorted(set(sizes) | {0}) if n <= capacity}


def check_accuracy(head_accuracy: Sequence[Sequence[float]] | None, where: str) -> list[list[float]]:
    """The accuracies as floats.

    Raises:
        ValueError: none measured, or a head whose ranks sum beyond 1 (cumulative top-k given instead of per rank).
    """
    if not head_accuracy:
        raise ValueError(f"{where} has no measured head_accuracy; train (or evaluate) the heads first")
    rows = [[float(p) for p in row] for row in head_accuracy]
    for k, row in enumerate(rows):
        if sum(row) > 1.0 + 1e-6:
            raise ValueError(f"{where}: head {k}'s accuracies sum to {sum(row):.3f} > 1; head_accuracy must be per "
                             "rank (P(rank r is right)), not cumulative top-k")
    return rows


def calibrate(model: Any, head_accuracy: Sequence[Sequence[float]], sizes: Sequence[int] = DEFAULT_SIZES, *,
              heads_dir: str | Path | None = None, prefix_length: int = 128, repeats: int = 7, warmup: int = 2,
              overhead_s: float = 0.0, fit_linear: bool = False, seed: int = 0) -> tuple[Candidate, list[Candidate]]:
    """``(best, candidates)``: every candidate tree with its predicted tau and measured latencies; the best is the
    tree (possibly the empty one, when ``0`` is among ``sizes``) with the highest ``predicted_tau / (verify + draft + overhead_s)``. The draft latency is
    measured with the Medusa drafter of ``heads_dir``, and counted as 0 without one. ``fit_linear`` replaces the
    verification medians by a least-squares line in the number of tokens (steadier on a busy machine)."""
    choices = candidate_trees(head_accuracy, sizes)
    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    trees = {}
    for n, c in choices.items():
        parents = TreeTemplate(c).parents if c else torch.zeros(0, dtype=torch.long)
        trees[n] = DraftTree(torch.randint(vocab, (n,), generator=gen), parents)
    latency = verify_latencies(model, trees, prefix_length=prefix_length, repeats=repeats, warmup=warmup, seed=seed)
    if fit_linear:
        latency = linear_fit(latency)
    draft = ({n: 0.0 for n in choices} if heads_dir is None else
             draft_latencies(model, lambda c: make_drafter("medusa", model, str(heads_dir), tree=c), choices,
                             repeats=repeats, warmup=warmup, seed=seed))
    candidates = []
    for n, c in choices.items():
        tau = 1.0 + (expected_accept_length(c, head_accuracy) if c else 0.0)
        candidates.append(Candidate(n, c, tau, latency[n], draft[n], tau / (latency[n] + draft[n] + overhead_s)))
    # The empty tree (plain decoding) competes too: heads that do not pay for their tree on this machine get none.
    best = max(candidates, key=lambda c: c.tokens_per_s)
    return best, candidates


def save_tree(model: Any, heads_dir: str | Path, best: Candidate, report: dict, *, keep_default: bool = False) -> Path:
    """Write ``best.choices`` as the heads' tree on this kind of machine and, unless ``keep_default``, as the
    ``tree`` of their config.json (refreshing their README, which describes the tree), and ``report`` to
    calibration.json (``save_setting``)."""
    return save_setting(model, heads_dir, Setting(choices=best.choices), report, keep_default=keep_default)


def report_dict(best: Candidate, candidates: list[Candidate], **extra: Any) -> dict:
    """What calibration.json records: every candidate, the choice and the measuring conditions."""
    rows = [{k: v for k, v in asdict(c).items() if k != "choices"} for c in candidates]
    return {"chosen_size": best.size, "predicted_tau": best.predicted_tau, "candidates": rows,
            "threads": torch.get_num_threads(), **extra}


def measure_tau(model: Any, heads_dir: str | Path, choices: list[list[int]], prompts: Sequence[Prompt],
                settings: GenSettings) -> float | None:
    """Tokens per step of the Medusa drafter with tree ``choices`` on ``prompts`` (one warm-up-free pass)."""
    method = parse_method(f"medusa:{heads_dir}", tree=choices)
    return mean_tau([method.generate(model, p.input_ids, settings) for p in prompts])


# ---------------------------------------------------------------- calibration by replay

@dataclass(frozen=True)
class Setting:
    """One way to draft with a set of heads: a static tree (``choices``) or a dynamic one (``dynamic``:
    ``{"size", "width", "top_k"}``), optionally merged with prompt lookup."""

    choices: list[list[int]] | None = None
    dynamic: dict[str, int] | None = None

    @property
    def label(self) -> str:
        if self.dynamic is not None:
            d = self.dynamic
            return f"dynamic {d['size']} (width {d.get('width', 4)}, top-{d.get('top_k', 4)})"
        return f"static {len(self.choices or [])}"

    def options(self) -> dict[str, Any]:
        if self.dynamic is not None:
            pool = {} if self.choices is None else {"tree": self.choices}
            return {**pool, "dynamic": self.dynamic["size"], "width": self.dynamic.get("width", 4),
                    "top_k": self.dynamic.get("top_k", 4)}
        return {"tree": self.choices or []}


@dataclass(frozen=True)
class Measured:
    """A setting replayed on the calibration references: tau, mean tree size, drafter and verification cost."""

    setting: Setting
    tau: float
    tree_size: float
    draft_s: float  # per step: propose + observe, measured during the replay
    verify_s: float  # per step: verification forward of a tree of ``tree_size`` nodes (interpolated)
    tokens_per_s: float


def settings_for(config: MedusaConfig, sizes: Sequence[int], dynamic_sizes: Sequence[int] = (),
                 widths: Sequence[int] = (4,), top_ks: Sequence[int] = (4,)) -> list[Setting]:
    """Static trees grown from the heads' accuracies for ``sizes`` (0: the empty tree), plus, for sequential heads,
    dynamic trees of ``dynamic_sizes`` for every width and top-k."""
    out = [Setting(choices=c) for c in candidate_trees(check_accuracy(config.head_accuracy, "heads"), sizes).values()]
    if config.sequential:
        out += [Setting(dynamic={"size": n, "width": w, "top_k": k})
                for n in dynamic_sizes for w in widths for k in top_ks if w <= n]
    return out


def _interpolate(latency: dict[int, float], size: float) -> float:
    sizes = sorted(latency)
    if size <= sizes[0]:
        return latency[sizes[0]]
    for lo, hi in zip(sizes, sizes[1:]):
        if size <= hi:
            return latency[lo] + (latency[hi] - latency[lo]) * (size - lo) / (hi - lo)
    lo, hi = sizes[-2], sizes[-1]  # beyond the grid: extend the last segment
    return latency[hi] + (latency[hi] - latency[lo]) * (size - hi) / (hi - lo)


def calibrate_by_replay(model: Any, heads_dir: str | Path, settings: Sequence[Setting], references: Sequence[Any], *,
                        merged_with: str | None = None, prefix_length: int = 128, repeats: int = 7, warmup: int = 2,
                        overhead_s: float = 0.0, seed: int = 0,
                        progress: Callable[[Measured], None] | None = None) -> tuple[Measured, list[Measured]]:
    """``(best, measured)``: every setting replayed on ``references`` (``selfspec.bench.replay``) for its real tau and
    drafting cost, with the verification cost of its tree size measured on this machine; the best has the most
    predicted tokens per second ``tau / (verify + draft + overhead_s)``. ``merged_with`` (a drafter spec such as
    ``lookup`` or ``lookup+datastore:DIR``) measures each setting merged with those drafters into one tree, as it
    will be used (``medusa+lookup``)."""

    name = f"medusa+{merged_with}" if merged_with else "medusa"
    measured = []
    for setting in settings:
        drafter = make_drafter(name, model, str(heads_dir), **setting.options())
        replay(drafter, references[:1], model)  # warm-up
        start = time.perf_counter()
        result = replay(drafter, references, model)
        per_step = (time.perf_counter() - start) / max(result.steps, 1)
        measured.append((setting, result, per_step))
    grid = sorted({0, *range(1, int(max(r.mean_tree for _, r, _ in measured)) + 2)})
    grid = [n for n in grid if n <= 8 or n % 2 == 0 or n == grid[-1]]
    gen = torch.Generator().manual_seed(seed)
    vocab = model.get_output_embeddings().weight.shape[0]
    trees = {n: DraftTree(torch.randint(vocab, (n,), generator=gen),
                          TreeTemplate(default_tree(None, n, num_heads=4)).parents if n else torch.zeros(0).long())
             for n in grid}
    latency = verify_latencies(model, trees, prefix_length=prefix_length, repeats=repeats, warmup=warmup, seed=seed)
    rows = []
    for setting, result, draft_s in measured:
        verify_s = _interpolate(latency, result.mean_tree)
        row = Measured(setting, result.tau, result.mean_tree, draft_s, verify_s,
                       result.tau / (verify_s + draft_s + overhead_s))
        rows.append(row)
        if progress is not None:
            progress(row)
    return max(rows, key=lambda r: r.tokens_per_s), rows


def _card(heads_dir: Path) -> str | None:
    readme = heads_dir / README_NAME
    return readme.read_text() if readme.is_file() else None


def _merged_card(old: str, new: str) -> str:
    """The card a re-save writes: ``old`` (what the directory's owner may have edited: its intro, sections of their
    own) with every section the renderer writes taken from the fresh rendering ``new``."""
    titles = [line[3:].strip() for line in new.splitlines() if line.startswith("## ")]
    return refresh_card_sections(old, new, titles)


def _keep_card(heads_dir: Path, old: str | None) -> None:
    """After a drafter's own ``save_pretrained`` rendered a fresh card: merge the previous one back in."""
    if old is not None:
        atomic_write_text(heads_dir / README_NAME, _merged_card(old, (heads_dir / README_NAME).read_text()))


def save_setting(model: Any, heads_dir: str | Path, setting: Setting, report: dict, *,
                 keep_default: bool = False) -> Path:
    """Make ``setting`` the heads' drafting on this kind of machine (their ``drafting_by_machine`` entry,
    ``decoding.by_machine``) and, unless ``keep_default``, their default drafting too (``tree`` or
    ``dynamic_tree`` in config.json), with ``report`` in calibration.json: the heads are loaded onto ``model``
    (which checks they belong to it) and saved again by their own ``save_pretrained``, which rewrites the directory
    atomically."""
    heads_dir = Path(heads_dir)
    return _save_drafting(model, MedusaHeads.from_pretrained(heads_dir, model), heads_dir, setting, report,
                          keep_default)


def _save_drafting(model: Any, heads: MedusaHeads, heads_dir: Path, setting: Setting, report: dict,
                   keep_default: bool) -> Path:
    """``save_setting`` on heads already loaded from ``heads_dir``."""
    config = heads.config
    machine, where = _this_machine(model, report)
    if setting.dynamic is not None:  # parallel heads pick the dynamic tree's nodes from the static tree
        pool = setting.choices if setting.choices is not None else config.drafting_for(machine)[0]["tree"]
        drafting = {"tree": pool, "dynamic_tree": dict(setting.dynamic)}
    else:
        drafting = {"tree": setting.choices or [], "dynamic_tree": None}
    config.drafting_by_machine = by_machine.with_entry(config.drafting_by_machine, machine, drafting, where)
    if not keep_default:
        config.tree, config.dynamic_tree = drafting["tree"], drafting["dynamic_tree"]
    adapter = heads_dir / ADAPTER_DIR if config.backbone_adapter is not None else None
    old = _card(heads_dir)
    heads.save_pretrained(heads_dir, backbone_adapter=adapter, calibration=report)
    _keep_card(heads_dir, old)  # sections the heads' owner wrote survive
    return heads_dir / CONFIG_NAME


# ---------------------------------------------------------------- calibration by decoding (drafters that run layers)

@dataclass(frozen=True)
class PolicyResult:
    """One draft policy decoded on the calibration prompts, beside plain decoding in the same run."""

    options: dict[str, Any]
    tau: float
    speedup: float  # tokens/s over plain decoding's, both summed over the prompts
    tokens_per_s: float
    draft_ms_per_step: float
    #: a 95% interval of this policy's speed over the chosen one's (a paired bootstrap over the prompts, which ran
    #: every policy side by side; ``selfspec.bench.runner.speedup_interval``): one that holds 1.0 is not told apart
    #: from the chosen policy by this run. None with fewer than two prompts.
    vs_chosen: list[float] | None = None

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.options.items()) or "(saved policy)"


#: grid axes whose values are names, not numbers, and the names each takes
NAMED_AXES = {"draft_weights": DRAFT_WEIGHTS}


def parse_grid(text: str) -> list[dict[str, Any]]:
    """``"max_depth=2,4 threshold=0,0.5"`` -> every combination, as option dicts (numbers parsed; the axes of
    ``NAMED_AXES`` take names: ``draft_weights=float16,q4_1``).

    Raises:
        ValueError: an item that is not ``NAME=V1,V2,...``, a value that is not a number, or a name its axis does not
            take.
    """
    import itertools

    axes: list[tuple[str, list[Any]]] = []
    for item in text.split():
        name, eq, values = item.partition("=")
        if not eq or not name or not values:
            raise ValueError(f"--grid item {item!r}: expected NAME=V1,V2 (for example max_depth=2,4 threshold=0,0.5)")
        parsed = []
        for v in values.split(","):
            if name in NAMED_AXES:
                if v not in NAMED_AXES[name]:
                    raise ValueError(f"--grid item {item!r}: {v!r} is not one of {', '.join(NAMED_AXES[name])}")
                parsed.append(v)
                continue
            try:
                parsed.append(int(v) if v.lstrip("-").isdigit() else float(v))
            except ValueError:
                raise ValueError(f"--grid item {item!r}: {v!r} is not a number") from None
        axes.append((name, parsed))
    if not axes:
        raise ValueError("--grid is empty: give NAME=V1,V2 items (for example max_depth=2,4 threshold=0,0.5)")
    return [dict(zip([n for n, _ in axes], combo)) for combo in itertools.product(*[v for _, v in axes])]


def check_fallback_of(drafter_name: str, fallback_of: str | None) -> None:
    """Refuse a ``fallback_of`` that ``search_policies`` cannot build (see there), before any model is loaded."""
    if fallback_of is None:
        return
    if "+" in fallback_of:
        raise ValueError(f"--fallback-of {fallback_of!r}: a fallback follows single drafters or a chain of them "
                         "joined by '|'; merge others into the tree with --merged-with")
    if drafter_name in [part.name for part in resolve_spec(fallback_of)[0]]:
        raise ValueError(f"--fallback-of {fallback_of!r} names {drafter_name!r}, the drafter being calibrated")


def search_policies(model: Any, drafter_name: str, heads_dir: str | Path, grid: Sequence[dict[str, Any]],
                    prompts: Sequence[Prompt], settings: GenSettings, *, merged_with: str | None = None,
                    fallback_of: str | None = None, keep_saved: bool = False,
                    progress: Callable[[PolicyResult], None] | None = None) -> tuple[PolicyResult, list[PolicyResult]]:
    """Decode ``prompts`` with ``drafter_name`` under every policy of ``grid`` and with plain decoding, per prompt
    in a rotated order (so that a drifting machine slows all alike), after one warm-up each; the best policy has the
    highest summed tokens/s, and every row carries the interval of its speed over the best's (``vs_chosen``), which
    ``progress`` gets once all are decoded. For drafters whose cost replay cannot predict (they run the base's own
    layers).
    ``merged_with``: decode each policy merged with these drafters (``lookup``, ``lookup+datastore:DIR``).
    ``fallback_of``: the drafter drafts only in the steps where these propose nothing (``lookup``, or
    ``lookup|datastore:DIR``: the spec ``FALLBACK_OF|DRAFTER:HEADS``), as ``selfspec generate --draft`` would use it.
    ``keep_saved``: decode the drafter's saved policy too (the first row, options ``{}``), and keep it unless a
    policy is faster beyond this run's interval (``choose_policy``; 95% for the whole grid): a policy the run cannot
    tell apart from the saved one may well be slower where it is used (held out, on the Zen 5 of docs/RESULTS.md,
    two such choices ran 6% and 9% slower than the saved tree).

    Raises:
        ValueError: ``fallback_of`` holds a ``+`` (a fallback binds tighter: merge with ``merged_with``) or names
            the drafter being calibrated.
    """
    check_fallback_of(drafter_name, fallback_of)
    spec = (f"{fallback_of}|" if fallback_of else "") + f"{drafter_name}:{heads_dir}" + (
        f"+{merged_with}" if merged_with else "")
    # with a fallback the calibrated drafter is not the spec's first part: its options are routed by name
    prefix = f"{drafter_name}." if fallback_of else ""
    grid = [{}, *grid] if keep_saved else list(grid)
    methods = [parse_method(spec, **{prefix + k: v for k, v in options.items()}) for options in grid]
    for i, method in enumerate(methods):
        method.name = f"policy-{i}"
    run = run_benchmark(model, prompts, methods, settings, progress=False)
    plain_speed = tokens_per_s(run.generations["vanilla"])
    rows = []
    for i, options in enumerate(grid):
        gens = run.generations[f"policy-{i}"]
        speed = tokens_per_s(gens)
        steps = sum(g.steps or 0 for g in gens)
        row = PolicyResult(dict(options), mean_tau(gens) or 1.0, speed / plain_speed, speed,
                           1e3 * sum(g.phases.get("draft", 0.0) for g in gens) / max(steps, 1))
        rows.append(row)
    best = choose_policy([run.generations[f"policy-{i}"] for i in range(len(rows))], keep_saved)
    chosen = run.generations[f"policy-{best}"]
    rows = [replace(row, vs_chosen=speedup_interval(run.generations[f"policy-{i}"], chosen))
            for i, row in enumerate(rows)]
    if progress is not None:
        for row in rows:
            progress(row)
    return rows[best], rows


def choose_policy(generations: Sequence[Sequence[Any]], keep_saved: bool = False) -> int:
    """The index of the policy to save among ``generations`` (per policy, its per-prompt results, decoded side by
    side): the fastest in summed tokens/s; with ``keep_saved``, the fastest of the policies faster than policy 0 (the
    saved one) beyond a paired-bootstrap interval (``speedup_interval``), else policy 0 (with fewer than two prompts
    there is no interval: the fastest). The intervals are Bonferroni-corrected (each at ``1 - 0.05 / rows``), so a
    grid of policies no better than the saved one replaces it at most one time in 20, however many rows it has."""
    fastest = max(range(len(generations)), key=lambda i: tokens_per_s(generations[i]))
    if not keep_saved or fastest == 0 or len(generations[0]) < 2:
        return fastest
    level = 1.0 - 0.05 / (len(generations) - 1)  # Bonferroni: 95% for the whole grid, not for each row
    beats_saved = [i for i in range(1, len(generations))
                   if (interval := speedup_interval(generations[i], generations[0], level=level)) is not None
                   and interval[0] > 1.0]
    return max(beats_saved, key=lambda i: tokens_per_s(generations[i])) if beats_saved else 0


def save_medusa_policy(model: Any, heads_dir: str | Path, options: dict[str, Any], report: dict, *,
                       keep_default: bool = False) -> Path:
    """``save_setting`` for a policy ``search_policies`` decoded: the Medusa drafter's options (``tree``: a size or
    choices; ``dynamic``: a dynamic tree's size, 0 for a static tree; ``width``, ``top_k``) as the tree and dynamic
    tree the drafter ran with (a missing ``tree`` is this machine's saved one, as the drafter took it)."""
    from medusa.drafter import resolve_tree

    heads_dir = Path(heads_dir)
    heads = MedusaHeads.from_pretrained(heads_dir, model)
    machine, _ = _this_machine(model, report)
    saved = heads.config.drafting_for(machine)[0]
    # the tree the drafter ran with (``resolve_tree``: a saved ``null`` is the default tree size, never "no tree")
    choices = resolve_tree(options["tree"] if options.get("tree") is not None else saved["tree"], heads).choices
    dynamic = options.get("dynamic")
    if dynamic is None and "tree" not in options and saved["dynamic_tree"]:  # the saved dynamic tree, re-shaped
        dynamic = saved["dynamic_tree"]["size"]
        options = {"width": saved["dynamic_tree"].get("width", 4), "top_k": saved["dynamic_tree"].get("top_k", 4),
                   **options}
    setting = (Setting(choices=choices) if not dynamic else
               Setting(choices=choices, dynamic={"size": int(dynamic), "width": int(options.get("width", 4)),
                                                 "top_k": int(options.get("top_k", 4))}))
    return _save_drafting(model, heads, heads_dir, setting, report, keep_default)


def save_exit_policy(model: Any, heads_dir: str | Path, options: dict[str, Any], report: dict, *,
                     keep_default: bool = False) -> Path:
    """Make ``options`` the early-exit classifier's draft policy on this kind of machine (its ``policy_by_machine``
    entry, ``decoding.by_machine``) and, unless ``keep_default``, its default policy too (``policy``), with
    ``report`` in calibration.json, rewriting the directory atomically through the classifier's own
    ``save_pretrained`` (a LayerSkip classifier keeps its backbone adapter and the base it was trained from), in
    the dtype its weights are stored in (a float16 classifier stays float16)."""
    from early_exit.classifier import ExitClassifier

    heads_dir = Path(heads_dir)
    classifier = ExitClassifier.from_pretrained(heads_dir, model)
    config = classifier.config
    machine, where = _this_machine(model, report)
    policy = {**config.policy_for(machine)[0], **options}  # what was measured: the grid over this machine's policy
    config.policy_by_machine = by_machine.with_entry(config.policy_by_machine, machine, policy, where)
    if not keep_default:
        config.policy = dict(policy)
    adapter = heads_dir / ADAPTER_DIR if config.backbone_adapter is not None else None
    old = _card(heads_dir)
    classifier.save_pretrained(heads_dir, model, base_identity=dict(config.base_model), backbone_adapter=adapter,
                               calibration=report, dtype=stored_float_dtype(heads_dir))
    _keep_card(heads_dir, old)  # sections the classifier's owner wrote survive
    return heads_dir / CONFIG_NAME


def _this_machine(model: Any, report: dict) -> tuple[str, str]:
    """``(machine class, name)`` of the machine ``model`` runs on, as a calibration saves them: the class keys the
    entry (``selfspec.runtime.kernels.machine_class``), the name (the GPU's, else the CPU model the report names)
    says which machine measured it."""
    from selfspec.runtime.kernels import machine_class

    device = next(model.parameters()).device
    machine = machine_class(device)
    where = (torch.cuda.get_device_name(device) if device.type == "cuda" else None) or report.get("cpu") or machine
    return machine, where


def save_eagle_policy(model: Any, heads_dir: str | Path, options: dict[str, Any], report: dict, *,
                      keep_default: bool = False) -> Path:
    """Make ``options`` the feature drafter's drafting on this kind of machine (its ``decoding_by_machine`` entry
    for ``machine_class``, with the CPU and date it was calibrated on) and, unless ``keep_default``, its default
    drafting too (``decoding``, what machines of other classes use), with ``report`` in calibration.json; the
    directory is rewritten atomically through the drafter's own ``save_pretrained`` in the dtype its weights are
    stored in (a float16 drafter stays float16, bit for bit), its card's hand-written sections kept.
    ``keep_default``: a drafter shared between machines keeps the default chosen elsewhere."""
    from eagle.model import from_pretrained, render_card, save_pretrained

    heads_dir = Path(heads_dir)
    draft = from_pretrained(heads_dir, model)
    config = draft.config
    machine, where = _this_machine(model, report)
    policy = {**config.policy_for(machine)[0], **options}  # what was measured: the grid over this machine's policy
    config.decoding_by_machine = by_machine.with_entry(config.decoding_by_machine, machine, policy, where)
    if not keep_default:
        config.decoding = dict(policy)
    old = _card(heads_dir)
    card = None if old is None else _merged_card(old, render_card(config))
    save_pretrained(draft, heads_dir, calibration=report, dtype=stored_float_dtype(heads_dir), card=card)
    return heads_dir / CONFIG_NAME
