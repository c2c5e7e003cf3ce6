"""``selfspec calibrate --heads DIR``: choose how Medusa heads draft on this machine (static tree size, or a dynamic
tree's size, width and top-k), save it into the heads' config.json, and report predicted against measured figures.

Two ways to predict what a setting accepts:

- ``--mode replay`` (default): replay each setting on the greedy continuations of calibration prompts
  (``selfspec.bench.replay``): the real tau and drafting cost, no verification forward needed. The prompts default to
  the built-in ones (``selfspec.training.data.BUILTIN_PROMPTS``), so a benchmark's prompts stay unseen.
- ``--mode accuracy``: from the heads' held-out accuracies (Medusa's tree construction), assuming independence.

Either way the verification cost of every tree size is measured on this machine, and the chosen setting has the
most predicted tokens per second. A prediction can miss what decoding then runs at (on a 2-core Zen 5 the replay
chose a dynamic tree that decoded 9% slower than the saved static one): the third way measures instead,

- ``--mode decode``: decode the prompts with every setting of ``--grid`` (``tree=3``: a static tree of 3 nodes grown
  from the heads' accuracies; ``dynamic=4``: a dynamic tree of 4 nodes, ``0`` static; ``width``, ``top_k``) beside
  plain decoding in the same run, as early-exit classifiers and feature drafters are calibrated (below).

An early-exit classifier (``--heads`` of kind ``early-exit``, e.g. a Kangaroo exit) drafts with the base model's own
shallow layers, whose cost replay cannot predict: its draft policy (chain length, confidence threshold, top-k) is
chosen by decoding the calibration prompts with every policy of ``--grid`` beside plain decoding in the same run, and
saved as the classifier's policy. The policy saved before is decoded too, and stays unless a policy of the grid is
faster than it beyond the run's interval (95% for the whole grid, Bonferroni-corrected; ``--prefer-fastest``: the
fastest anyway): eight prompts rarely tell
close policies apart, and on the Zen 5 of docs/RESULTS.md both choices within the noise ran slower held out. A feature drafter (EAGLE, ``eagle/``) is calibrated the same way (its tree's
depth, node budget, children per node and width): its draft cost depends on the tree and on this machine's kernels as
much as its acceptance does. Whatever the drafter, the choice is saved for this kind of machine (``x86_64-avx2``,
``x86_64-avx512``, ``cuda``...; ``decoding.by_machine``) and, unless ``--keep-default``, as the default that machines
of other kinds use. Either can be calibrated as it
will be used: merged with other drafters into one tree (``--merged-with lookup``) or as a fallback asked only where
others propose nothing (``--fallback-of lookup``, for ``--draft 'lookup|eagle'``). A feature drafter's grid may
include ``draft_weights=float16,q4_1``: the format its own layers read is then chosen per machine too. Calibrate on
prompts a benchmark will not report on (MT-bench 1-40).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from decoding import by_machine
from medusa.config import MedusaConfig
from selfspec.bench.calibration import (
    DEFAULT_SIZES,
    calibrate,
    calibrate_by_replay,
    check_accuracy,
    check_fallback_of,
    measure_tau,
    parse_grid,
    report_dict,
    save_eagle_policy,
    save_exit_policy,
    save_medusa_policy,
    save_setting,
    save_tree,
    search_policies,
    settings_for,
)
from selfspec.bench.cost import cpu_model
from selfspec.bench.methods import GenSettings
from selfspec.bench.replay import make_references
from selfspec.bench.runner import Prompt, eos_of, load_prompts
from selfspec.cli.bench import add_common_arguments, apply_backend
from selfspec.runtime.identity import check_base_model
from selfspec.runtime.kernels import machine_class
from selfspec.runtime.models import is_test_model, load_model
from selfspec.runtime.prompts import encode_prompt
from selfspec.training.data import BUILTIN_PROMPTS

#: early-exit policies tried by default: chain length x path-confidence threshold
EXIT_GRID = "max_depth=2,3,4,6 threshold=0,0.2,0.4"
#: feature-drafter (EAGLE) policies tried by default: tree depth x node budget x children per expanded node. The
#: choices recorded in docs/RESULTS.md span depth 2 (2-core Xeon, one-call stack and exact grids: 4 nodes, top-4) to
#: depth 5 (AVX2 EPYC: 4 nodes, top-2); depth 6 never beat 4 or 5 at the same node budget.
EAGLE_GRID = "depth=2,3,4,5 nodes=4,6,8 top_k=2,4"
#: Medusa drafting decoded by default (``--mode decode``): static trees grown from the heads' accuracies, of these
#: sizes; sequential heads also dynamic trees of these sizes over each (0: static), 2 paths expanded per depth
MEDUSA_GRID = "tree=1,2,3,4,6"
MEDUSA_SEQUENTIAL_GRID = "tree=2,3,4,6 dynamic=0,4,6 width=2 top_k=4"


def _load_exit_classifier(heads: str, model) -> tuple[dict, str]:
    from early_exit.classifier import ExitClassifier

    saved = by_machine.saved_for(ExitClassifier.from_pretrained(heads, model).config.policy_for, model.device)
    return saved.options, saved.source


def _load_eagle(heads: str, model) -> tuple[dict, str]:
    from eagle.drafter import saved_policy
    from eagle.model import from_pretrained

    return saved_policy(from_pretrained(heads, model).config, model.device)


class PolicySearch(NamedTuple):
    """How ``calibrate`` searches one drafter kind's policies by decoding: the default grid, what the drafter is
    called in messages, a loader that refuses heads made for another model (before any decoding) and returns the
    policy they would draft with here and where it comes from, and the saver of the chosen policy."""

    grid: str
    what: str
    load: Callable[[str, Any], tuple[dict, str]]
    save: Callable[..., Path]


def _load_medusa(heads: str, model) -> tuple[dict, str]:
    from medusa import MedusaHeads

    saved = by_machine.saved_for(MedusaHeads.from_pretrained(heads, model).config.drafting_for, model.device)
    return saved.options, saved.source


#: the drafter kinds whose policy is chosen by decoding beside plain decoding (Medusa heads with ``--mode decode``)
DECODE_SEARCH = {
    "early-exit": PolicySearch(EXIT_GRID, "early-exit classifier", _load_exit_classifier, save_exit_policy),
    "eagle": PolicySearch(EAGLE_GRID, "feature drafter", _load_eagle, save_eagle_policy),
    "medusa": PolicySearch(MEDUSA_GRID, "Medusa drafter", _load_medusa, save_medusa_policy),
}


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="choose the Medusa drafting (tree) for this machine",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", required=True, help="Medusa heads or early-exit classifier directory")
    add_common_arguments(p)
    p.set_defaults(limit=None)
    p.add_argument("--mode", choices=("replay", "accuracy", "decode"), default="replay",
                   help="Medusa heads: predict each setting's speed by replay on real continuations (default) or "
                        "from head accuracies, or measure it: decode the prompts with every setting of --grid "
                        "beside plain decoding (slower, and what a benchmark sees)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="replay and accuracy modes: static tree sizes (draft nodes; --mode decode takes --grid)")
    p.add_argument("--dynamic-sizes", default="4,6,8,10,12,16,20",
                   help="replay, sequential heads: dynamic tree sizes to try ('' for none)")
    p.add_argument("--widths", default="2,4", help="replay: dynamic trees' paths expanded per depth")
    p.add_argument("--top-ks", default="2,4", help="replay: dynamic trees' children per expanded node")
    p.add_argument("--merged-with", metavar="DRAFTERS", default=None,
                   help="calibrate the drafting as it will be used, merged into one tree with these drafters: "
                        "lookup, or lookup+datastore:DIR")
    p.add_argument("--with-lookup", dest="merged_with", action="store_const", const="lookup",
                   help="the same as --merged-with lookup")
    p.add_argument("--fallback-of", metavar="DRAFTERS", default=None,
                   help="drafters calibrated by decoding (feature drafters, early-exit classifiers, Medusa heads "
                        "with --mode decode): calibrate them as a fallback, drafting only in the steps where DRAFTERS "
                        "propose nothing (lookup, or lookup|datastore:DIR), as --draft 'DRAFTERS|eagle' uses them")
    p.add_argument("--prefix-length", type=int, default=128, help="KV-cache length during the latency runs")
    p.add_argument("--repeats", type=int, default=7, help="timed forwards per size (median taken)")
    p.add_argument("--overhead-ms", type=float, default=1.0, help="fixed per-step cost added to every setting")
    p.add_argument("--fit-linear", action="store_true",
                   help="accuracy mode: choose on a straight-line fit of t(n) (for a busy machine)")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="new tokens per calibration prompt (default 256, the benchmark's): calibrate at the length "
                        "you decode; on a 2-core Zen 3 two feature-drafter trees ranked at 128 tokens ranked the "
                        "other way at 256, where the deeper tree's tau grows more (docs/RESULTS.md)")
    p.add_argument("--no-measure", action="store_true", help="accuracy mode: skip the greedy run that measures tau")
    p.add_argument("--dry-run", action="store_true", help="print the choice, write nothing")
    p.add_argument("--keep-default", action="store_true",
                   help="save the chosen policy for this kind of machine only (its per-machine entry: "
                        "x86_64-avx2, x86_64-avx512, x86_64-avx512-amx, cuda, ...), keeping the default that other "
                        "machines use; for heads shared between machines. Without it the choice becomes the "
                        "default too")
    p.add_argument("--prefer-fastest", action="store_true",
                   help="decoded policies: save the fastest of the grid even where this run cannot tell it apart "
                        "from the saved policy (by default the saved policy is decoded too and stays unless a policy "
                        "is faster beyond the run's interval, 95%% for the whole grid)")
    p.add_argument("--grid", default=None,
                   help="early-exit classifiers, feature drafters and Medusa heads with --mode decode: draft "
                        f"policies to decode, NAME=V1,V2 items (default {EXIT_GRID!r} for an exit classifier, "
                        f"{EAGLE_GRID!r} for a feature drafter, {MEDUSA_GRID!r} for Medusa heads, "
                        f"{MEDUSA_SEQUENTIAL_GRID!r} for sequential ones)")
    p.set_defaults(func=run)


def _calibration_prompts(args, model, tokenizer) -> list[Prompt]:
    if args.prompts or is_test_model(args.model):
        return load_prompts(tokenizer, args.prompts, args.limit or 6, vocab_size=model.config.vocab_size,
                            seed=args.seed, synthetic=True, spread=args.spread)
    chosen = BUILTIN_PROMPTS[-(args.limit or 6):]
    return [Prompt(f"builtin-{i}", encode_prompt(tokenizer, text)) for i, text in enumerate(chosen)]


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    kind = heads_kind(args.heads)
    if kind == "layer-skip":
        raise ValueError(f"{args.heads} holds a layer-skip set, which `selfspec calibrate` does not tune: its layers and "
                         "policy are searched together by scripts/search_layer_skip.py")
    if kind in DECODE_SEARCH:
        grid = parse_grid(args.grid or DECODE_SEARCH[kind].grid)  # a malformed grid fails before the model loads
        check_fallback_of(kind, args.fallback_of)
        return _run_policy_search(args, grid, kind)
    if args.mode == "decode":
        config = MedusaConfig.load(args.heads)
        grid = parse_grid(args.grid or (MEDUSA_SEQUENTIAL_GRID if config.sequential else MEDUSA_GRID))
        if any("draft_weights" in options for options in grid):
            raise ValueError("--grid: draft_weights is not saved with Medusa heads (pass it as an option where they "
                             "are used, e.g. medusa:DIR[draft_weights=q4_1]); drop it from the grid")
        check_fallback_of("medusa", args.fallback_of)
        return _run_policy_search(args, grid, "medusa")
    if args.fallback_of:
        raise ValueError("--fallback-of calibrates drafters searched by decoding (feature drafters, early-exit "
                         "classifiers, Medusa heads with --mode decode); replay merges with --merged-with only")
    config = MedusaConfig.load(args.heads)
    model, tokenizer = load_model(args.model)
    if config.base_model:  # before any continuation is generated: heads for another model are refused at once
        check_base_model(config.base_model, model, what=f"Medusa heads {args.heads}", on_weights="warn")
    backend = apply_backend(model, args)
    if args.mode == "replay":
        return _run_replay(args, config, model, tokenizer, backend)
    accuracy = check_accuracy(config.head_accuracy, f"{args.heads}/config.json")
    best, candidates = calibrate(model, accuracy, _ints(args.sizes), heads_dir=args.heads,
                                 prefix_length=args.prefix_length, repeats=args.repeats,
                                 overhead_s=args.overhead_ms / 1000, fit_linear=args.fit_linear, seed=args.seed)
    if best.size == 0:
        print("no tree beats plain decoding on this machine with these heads: saving the empty tree")
    print("nodes | predicted tau | verify ms | draft ms | predicted tokens/s")
    for c in candidates:
        mark = "  <- chosen" if c is best else ""
        print(f"{c.size:5d} | {c.predicted_tau:13.3f} | {c.latency_s * 1000:9.2f} | {c.draft_s * 1000:8.2f} | "
              f"{c.tokens_per_s:8.1f}{mark}")
    measured = None
    if not args.no_measure:
        prompts = _calibration_prompts(args, model, tokenizer)
        settings = GenSettings(args.max_new_tokens, eos_of(model, tokenizer))
        measured = measure_tau(model, args.heads, best.choices, prompts, settings)
        error = (measured - best.predicted_tau) / best.predicted_tau if measured else float("nan")
        print(f"tree of {best.size} nodes: predicted tau {best.predicted_tau:.3f}, measured {measured:.3f} "
              f"({error:+.1%}) on {len(prompts)} prompts x {args.max_new_tokens} tokens")
    if not args.dry_run:
        report = report_dict(best, candidates, mode="accuracy", measured_tau=measured, model=args.model,
                             prefix_length=args.prefix_length, repeats=args.repeats, overhead_ms=args.overhead_ms,
                             fit_linear=args.fit_linear, linear_backend=backend,
                             prompts=args.prompts or "builtin", limit=args.limit, max_new_tokens=args.max_new_tokens,
                             cpu=cpu_model(), machine_class=machine_class(model.device))
        path = save_tree(model, args.heads, best, report, keep_default=args.keep_default)
        print(f"saved the {best.size}-node tree into {path} (details in calibration.json)")
    return 0


def _run_replay(args, config, model, tokenizer, backend: str) -> int:
    prompts = _calibration_prompts(args, model, tokenizer)
    print(f"calibration: greedy continuations of {len(prompts)} prompts x {args.max_new_tokens} tokens", flush=True)
    references = make_references(model, [p.input_ids for p in prompts], args.max_new_tokens,
                                 eos_token_id=eos_of(model, tokenizer))
    settings = settings_for(config, _ints(args.sizes), _ints(args.dynamic_sizes), _ints(args.widths),
                            _ints(args.top_ks))
    print("setting | tau | mean nodes | verify ms | draft ms | predicted tokens/s")
    best, rows = calibrate_by_replay(model, args.heads, settings, references, merged_with=args.merged_with,
                                     prefix_length=args.prefix_length, repeats=args.repeats,
                                     overhead_s=args.overhead_ms / 1000, seed=args.seed)
    for r in rows:
        mark = "  <- chosen" if r is best else ""
        print(f"{r.setting.label:32s} | {r.tau:5.2f} | {r.tree_size:6.1f} | {r.verify_s * 1e3:8.2f} | "
              f"{r.draft_s * 1e3:7.2f} | {r.tokens_per_s:7.2f}{mark}")
    if not args.dry_run:
        report = {"mode": "replay", "chosen": best.setting.label, "merged_with": args.merged_with,
                  "candidates": [{"setting": r.setting.label, "tree": r.setting.choices, "dynamic": r.setting.dynamic,
                                  "tau": r.tau, "tree_size": r.tree_size, "verify_s": r.verify_s,
                                  "draft_s": r.draft_s, "predicted_tokens_per_s": r.tokens_per_s} for r in rows],
                  "model": args.model, "linear_backend": backend, "threads": torch.get_num_threads(),
                  "prompts": args.prompts or "builtin", "spread": args.spread, "limit": len(prompts),
                  "max_new_tokens": args.max_new_tokens, "overhead_ms": args.overhead_ms, "repeats": args.repeats,
                  "cpu": cpu_model(), "machine_class": machine_class(model.device)}
        path = save_setting(model, args.heads, best.setting, report, keep_default=args.keep_default)
        print(f"saved '{best.setting.label}' into {path} (details in calibration.json)")
    return 0


def heads_kind(heads: str) -> str | None:
    """The ``kind`` recorded in ``heads/config.json`` (None when absent or unreadable: Medusa's loader says why)."""
    try:
        config = json.loads((Path(heads) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if str(config.get("format", "")).startswith("selfspec-eagle"):
        return "eagle"
    return config.get("kind")


def _run_policy_search(args, grid: list[dict], kind: str) -> int:
    search = DECODE_SEARCH[kind]
    model, tokenizer = load_model(args.model)
    saved, source = search.load(args.heads, model)  # refuses heads trained for another model before any decoding
    backend = apply_backend(model, args)
    prompts = _calibration_prompts(args, model, tokenizer)
    settings = GenSettings(args.max_new_tokens, eos_of(model, tokenizer))
    used = "".join([f", as the fallback of {args.fallback_of}" * bool(args.fallback_of),
                    f", merged with {args.merged_with}" * bool(args.merged_with)])
    print(f"calibration: {len(grid)} {search.what} policies{used}"
          f"{'' if args.prefer_fastest else ' and the saved one'} beside plain decoding, {len(prompts)} prompts"
          f" x {args.max_new_tokens} tokens", flush=True)
    if kind == "medusa":
        print(f"the heads' saved drafting here: {json.dumps(saved)} ({source}); a policy with tree=N drafts a static "
              "tree unless it sets dynamic, one without tree drafts over the saved tree, and a dynamic tree without "
              "width or top_k expands 4 x 4", flush=True)
    else:
        print(f"each policy applies over the {search.what}'s saved one, {json.dumps(saved)} ({source}), whose fields "
              "the grid does not set", flush=True)
    print("policy | tau | speedup | draft ms/step | speed over the chosen policy's (95% interval)")

    def show(r) -> None:
        versus = "-" if r.vs_chosen is None else f"{r.vs_chosen[0]:.2f}-{r.vs_chosen[1]:.2f}"
        print(f"{r.label:28s} | {r.tau:5.2f} | {r.speedup:5.2f}x | {r.draft_ms_per_step:6.2f} | {versus}", flush=True)

    best, rows = search_policies(model, kind, args.heads, grid, prompts, settings, merged_with=args.merged_with,
                                 fallback_of=args.fallback_of, keep_saved=not args.prefer_fastest, progress=show)
    print(f"chosen: {best.label} (tau {best.tau:.2f}, {best.speedup:.2f}x plain decoding)")
    if not best.options and len(rows) > 1:
        print("the saved policy stays: no policy of the grid was faster than it beyond this run's interval, 95% for "
              "the whole grid (--prefer-fastest takes the fastest anyway)", flush=True)
    ties = [r for r in rows if r is not best and r.vs_chosen is not None and r.vs_chosen[1] >= 1.0]
    if ties:
        print(f"{len(ties)} other {'policy is' if len(ties) == 1 else 'policies are'} not told apart from it by this "
              "run (interval over the chosen holds 1.0): more or longer prompts (--limit, --max-new-tokens) would "
              "decide between them", flush=True)
    if not args.dry_run:
        report = {"mode": "decode", "chosen": best.options, "saved_policy": saved, "saved_source": source,
                  "kept_saved": not best.options, "merged_with": args.merged_with,
                  "fallback_of": args.fallback_of,
                  "candidates": [{"policy": r.options, "tau": r.tau, "speedup": r.speedup,
                                  "tokens_per_s": r.tokens_per_s, "draft_ms_per_step": r.draft_ms_per_step,
                                  "vs_chosen_95": r.vs_chosen}
                                 for r in rows],
                  "model": args.model, "linear_backend": backend, "threads": torch.get_num_threads(),
                  "cpu": cpu_model(), "machine_class": machine_class(model.device),
                  "prompts": args.prompts or "builtin", "spread": args.spread, "limit": len(prompts),
                  "max_new_tokens": args.max_new_tokens}
        path = search.save(model, args.heads, best.options, report, keep_default=args.keep_default)
        what = f"policy {best.label}" if best.options else "the saved policy"
        where = "for this kind of machine" + ("" if args.keep_default else " and as the default")
        print(f"saved {what} {where} into {path} (details in calibration.json)")
    return 0
