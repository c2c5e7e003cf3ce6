"""``selfspec demo``: answer a few sample prompts with and without Medusa heads (merged into one tree with prompt
lookup, unless ``--no-lookup``, and with a ``--datastore`` of the model's own answers when given); print each
method's tokens/s and tau per prompt and over all, and whether the answers are identical (greedy decoding is
lossless, so they must be).

Where the committed feature drafter for the model is in the checkout (``heads/smollm2-135m-instruct-eagle3`` for the
embedded default; ``--feature-drafter DIR`` names another, ``--no-feature-drafter`` skips it), the same prompts are
also answered with it as prompt lookup's fallback (``lookup|eagle``, with the datastore merged in when given): heads
trained for a few minutes beside a drafter trained for hours, on the same machine and prompts."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

import decoding
import medusa
from decoding import combine, fallback, make_drafter
from lookup import LookupDrafter
from selfspec.cli.bench import add_backend_argument
from selfspec.runtime.adapters import adapter_spec
from selfspec.runtime.cache import generate_kwargs
from selfspec.runtime.identity import BaseModelWeightsWarning
from selfspec.runtime.kernels import set_draft_weights, set_linear_backend
from selfspec.runtime.models import load_model
from selfspec.runtime.prompts import encode_prompt

#: Where the committed heads for the embedded default model live, relative to the repository root.
#: The sequential (Hydra-style) heads: the best committed drafter (docs/RESULTS.md).
DEFAULT_HEADS = Path("heads") / "smollm2-135m-instruct-medusa-seq"
#: The committed feature drafter (EAGLE-3 class) for the embedded default, shown beside the heads when present.
DEFAULT_FEATURE_DRAFTER = Path("heads") / "smollm2-135m-instruct-eagle3"
DEFAULT_MODEL = "smollm2-135m-instruct"
#: What the demo answers: an explanation, a piece of code, a rewrite of a given text (requests chat users make; none
#: is a benchmark question or in the self-distilled corpus). One answer does not show an average: the demo reports all.
SAMPLE_PROMPTS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that checks whether two words are anagrams of each other, with a short docstring.",
    "Rewrite this note so that it sounds friendly: The meeting is moved to Friday at 3 pm. Bring the budget "
    "report. Do not be late.",
)
#: The demo's drafted answers, column by column: the Medusa heads, then the feature drafter.
COLUMNS = "AB"
#: New tokens of the untimed warm-up run of each method (first calls pay for lazy init and allocator growth).
WARMUP_TOKENS = 8


def default_heads_dir(relative: Path = DEFAULT_HEADS) -> Path:
    """``relative`` (default ``DEFAULT_HEADS``) in the working directory, else in the repository of this package."""
    if relative.is_dir():
        return relative
    return Path(__file__).resolve().parents[2] / relative


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="answer a prompt with and without Medusa heads, compare speed and text",
                              description=__doc__)
    p.add_argument("--heads", help=f"Medusa heads directory (default: the committed {DEFAULT_HEADS})")
    p.add_argument("--model", default=None,
                   help=f"alias, hub id or path of the base model (default {DEFAULT_MODEL}, or the adapted model of "
                        "Medusa-2 heads); tiny:ARCH for a test model")
    p.add_argument("--prompt", action="append", default=None,
                   help="a user turn to answer (chat template applied); repeatable (default: three sample prompts)")
    p.add_argument("--datastore", default=None,
                   help="also draft from this datastore (`selfspec datastore`), merged into the same tree")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", help="draft tree: a size (8, 16, 32...), a JSON list of choices, or a JSON file "
                                  "(default: the tree saved with the heads)")
    p.add_argument("--dynamic", type=int, help="keep only the N most confident nodes of the tree at every step")
    p.add_argument("--no-lookup", dest="lookup", action="store_false",
                   help="draft with the heads alone (default: heads and prompt lookup merged into one tree)")
    p.add_argument("--feature-drafter", default=None, metavar="DIR",
                   help="also answer with this feature drafter (EAGLE-3 class) as prompt lookup's fallback (default: "
                        f"the committed {DEFAULT_FEATURE_DRAFTER} when it is there and fits the model)")
    p.add_argument("--no-feature-drafter", dest="feature_drafter", action="store_const", const="",
                   help="answer with the Medusa heads only")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    add_backend_argument(p)
    p.set_defaults(func=run)


def _baseline(model, input_ids: torch.Tensor, max_new_tokens: int, eos_token_id) -> tuple[torch.Tensor, float]:
    """HF greedy ``generate``: the reference text and the speed to beat, on the same kernels and layers as the
    heads (``selfspec.runtime.cache.generate_kwargs``). Returns ``(sequences, seconds)``."""
    cache = generate_kwargs(model, input_ids.shape[1] + max_new_tokens + 8)
    start = time.perf_counter()
    sequences = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                               max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                               pad_token_id=eos_token_id if eos_token_id is not None else 0,
                               temperature=None, top_p=None, top_k=None, **cache)
    return sequences, time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    """Run the demo; the exit status is 1 when a drafted answer differs from HF greedy ``generate``'s.

    Raises:
        FileNotFoundError: no heads directory (the message says how to train one), or no ``--feature-drafter DIR``.
        ValueError: heads or a ``--feature-drafter`` for another base model or unreadable, a bad tree, a bad
            ``--max-new-tokens``.
    """

    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")
    torch.set_num_threads(args.threads)
    heads_dir = Path(args.heads) if args.heads else default_heads_dir()
    if not heads_dir.is_dir():
        raise FileNotFoundError(
            f"no Medusa heads at {heads_dir}; train them first (python train/medusa.py --config "
            "configs/medusa/smollm2-135m.yaml) or pass --heads DIR")
    if args.model is None:  # Medusa-2 heads decode their adapted model (base + merged LoRA): their directory loads it
        args.model = str(heads_dir) if adapter_spec(heads_dir) else DEFAULT_MODEL
    model, tokenizer = load_model(args.model)
    model.eval()
    backend = set_linear_backend(model, args.linear_backend)  # both runs below use it
    set_draft_weights(args.draft_weights)
    heads_drafter = medusa.load(model, heads_dir, tree=args.tree, dynamic=args.dynamic)  # fails fast on wrong heads
    store = make_drafter("datastore", model, args.datastore) if args.datastore else None  # stateless: shared
    others = ([LookupDrafter()] if args.lookup else []) + ([store] if store is not None else [])
    drafter = combine(heads_drafter, *others) if others else heads_drafter
    label = "with Medusa heads" + (" + lookup" if args.lookup else "") + (" + datastore" if args.datastore else "")
    feature, feature_dir = _feature_drafter(model, args, store)
    prompts = args.prompt or list(SAMPLE_PROMPTS)
    eos = tokenizer.eos_token_id
    print(f"model {args.model}, heads {heads_dir} ({heads_drafter.heads.config.num_heads} heads, "
          f"tree of {len(heads_drafter.template)} nodes{f', {args.dynamic} kept per step' if args.dynamic else ''}"
          f"{', merged with prompt lookup' if args.lookup else ''}"
          f"{f', datastore {args.datastore}' if args.datastore else ''}), {args.threads} threads, "
          f"linear backend {backend}")
    if feature is not None:
        print(f"feature drafter {feature_dir}" + (" as prompt lookup's fallback" if args.lookup else "")
              + (", datastore merged in" if args.datastore else ""))
    print()

    rows, differ = [], []
    with torch.inference_mode():
        warm = encode_prompt(tokenizer, prompts[0])
        _baseline(model, warm, WARMUP_TOKENS, eos)
        decoding.generate(model, drafter, warm, max_new_tokens=WARMUP_TOKENS, eos_token_id=eos)
        if feature is not None:
            decoding.generate(model, feature, warm, max_new_tokens=WARMUP_TOKENS, eos_token_id=eos)
        for i, prompt in enumerate(prompts):
            input_ids = encode_prompt(tokenizer, prompt)
            reference, seconds = _baseline(model, input_ids, args.max_new_tokens, eos)
            out = decoding.generate(model, drafter, input_ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos)
            outs = [out] + ([decoding.generate(model, feature, input_ids, max_new_tokens=args.max_new_tokens,
                                               eos_token_id=eos)] if feature is not None else [])
            length = input_ids.shape[1]
            rows.append((reference.shape[1] - length, seconds, [o.stats for o in outs]))
            print(f"[{i + 1}] {prompt}\n{tokenizer.decode(out.sequences[0, length:], skip_special_tokens=True).strip()}\n")
            wrong = [COLUMNS[j] for j, o in enumerate(outs) if o.sequences.tolist() != reference.tolist()]
            if wrong:
                differ.append((i, wrong, tokenizer.decode(reference[0, length:], skip_special_tokens=True).strip()))

    labels = [label] + ([(f"with the feature drafter{' (lookup|eagle)' if args.lookup else ''}"
                          f"{' + datastore' if args.datastore else ''}")] if feature is not None else [])
    print("tokens/s without drafts (HF greedy generate) and " + "; ".join(
        f"{name} ({column})" for column, name in zip(COLUMNS, labels)) + ":")
    columns = "".join(f" {column:>8} {f'tau {column}':>6} {f'speedup {column}':>10}"
                      for column in COLUMNS[:len(labels)])
    print(f"{'prompt':<7} {'tokens':>6} {'without':>8}" + columns)
    for i, (tokens, seconds, stats) in enumerate(rows):
        base = tokens / seconds if seconds > 0 else 0.0
        cells = "".join(f" {st.tokens_per_s:>8.1f} {st.tau:>6.2f} "
                        f"{st.tokens_per_s / base if base else float('nan'):>9.2f}x" for st in stats)
        print(f"{f'[{i + 1}]':<7} {tokens:>6} {base:>8.1f}" + cells)
    base_tokens, base_seconds = sum(r[0] for r in rows), sum(r[1] for r in rows)
    for j, name in enumerate(labels):
        new_tokens = sum(r[2][j].new_tokens for r in rows)
        new_seconds = sum(r[2][j].time_total for r in rows)
        speedup = ((new_tokens / new_seconds) / (base_tokens / base_seconds) if new_seconds and base_seconds
                   else float("nan"))
        print(f"all, {name}: speedup {speedup:.2f}x over HF greedy generate")
    print(f"answers identical: {len(rows) - len(differ)}/{len(rows)}")
    for i, wrong, text in differ:
        print(f"\n[{i + 1}] differs with {' and '.join(wrong)}; without drafts: {text}")
    return 1 if differ else 0


def _feature_drafter(model, args: argparse.Namespace, store=None) -> tuple[object | None, Path | None]:
    """``(drafter, directory)``: the feature drafter to show beside the heads (as lookup's fallback unless
    ``--no-lookup``, with the datastore drafter ``store`` merged in), or ``(None, None)`` where none is asked for
    (``--no-feature-drafter``) or the committed default does not fit (missing, unreadable, or made for another model
    or other weights: a note says why).

    Raises:
        FileNotFoundError, ValueError: an explicit ``--feature-drafter DIR`` that does not load on this model (the
            message names the option).
    """
    import eagle

    explicit = args.feature_drafter
    if explicit == "":
        return None, None
    directory = Path(explicit) if explicit else default_heads_dir(DEFAULT_FEATURE_DRAFTER)
    if not explicit and not directory.is_dir():
        return None, None
    try:
        with warnings.catch_warnings():
            if not explicit:
                # the same architecture and shapes with other weights (a fine-tune, Medusa-2's adapted model) only
                # warns: a drafter asked for by name still runs then, the committed default is left out
                warnings.simplefilter("error", BaseModelWeightsWarning)
            drafter = eagle.load(model, directory)
    except (BaseModelWeightsWarning, FileNotFoundError, ValueError) as error:
        if explicit:
            kind = FileNotFoundError if isinstance(error, FileNotFoundError) else ValueError
            raise kind(f"--feature-drafter {directory}: {error}") from error
        print(f"note: the committed feature drafter {directory} is not shown ({str(error).splitlines()[0]}); "
              "--no-feature-drafter silences this", file=sys.stderr)
        return None, None
    drafter = fallback(LookupDrafter(), drafter) if args.lookup else drafter
    return (combine(drafter, store) if store is not None else drafter), directory
