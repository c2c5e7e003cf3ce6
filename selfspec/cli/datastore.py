"""``selfspec datastore --data DATASET --out DIR``: index conversations (best: ones the model wrote itself, as
``scripts/self_distill.py`` makes them) for the ``datastore`` drafter (``lookup.datastore``)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from tqdm.auto import tqdm

from lookup.datastore import Datastore
from selfspec.runtime.models import DEFAULT_MODEL, load_model
from selfspec.training.data import FORMATS, detect_format, load_records, tokenize_records


def register(subparsers) -> None:
    p = subparsers.add_parser("datastore", help="index conversations for the datastore drafter",
                              description=__doc__)
    p.add_argument("--data", required=True, nargs="+",
                   help="conversations: ShareGPT/Alpaca JSON/JSONL files or directories (e.g. self-distilled ones); "
                        "several are indexed together")
    p.add_argument("--out", required=True, help="directory to write (replaced atomically if it exists)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"whose tokenizer and chat template (default {DEFAULT_MODEL})")
    p.add_argument("--format", default="auto", choices=("auto", *sorted(FORMATS)), help="dataset format (default auto)")
    p.add_argument("--context", type=int, default=16, help="longest match the index can find, in tokens (default 16)")
    p.add_argument("--limit", type=int, help="index only the first N conversations")
    p.add_argument("--turns", choices=("all", "assistant"), default="all",
                   help="index whole conversations (default), or only the assistant turns: 25%% smaller, drafting as "
                        "well when the answers are the model's own (docs/RESULTS.md)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Raises: FileNotFoundError / ValueError: a missing or unreadable dataset, a bad ``--context`` or ``--limit``."""
    if args.context < 1:
        raise ValueError("--context must be at least 1")
    if args.limit is not None and args.limit < 1:
        raise ValueError("--limit must be at least 1")
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    data = " ".join(args.data)
    records = load_records(args.data if len(args.data) > 1 else args.data[0])
    fmt = detect_format(records.column_names) if args.format == "auto" else args.format
    total = min(len(records), args.limit or len(records))
    examples = tokenize_records(tqdm(records, desc="tokenizing", unit="conv", total=total), tokenizer, fmt=fmt,
                                max_length=1 << 30, num_samples=args.limit)
    meta = {"vocab_size": model.config.vocab_size, "tokenizer": getattr(tokenizer, "name_or_path", None) or args.model,
            "model": args.model, "source": data}
    documents = (e["input_ids"] for e in examples) if args.turns == "all" else (
        turn for e in examples for turn in assistant_turns(e))
    meta["turns"] = args.turns
    datastore = Datastore.build(documents, context=args.context, meta=meta)
    what = "conversations" if args.turns == "all" else "assistant turns"
    card = (f"# Datastore for {args.model}\n\n{datastore.meta['num_documents']:,} {what} of `{data}`, "
            f"{datastore.meta['num_tokens']:,} tokens (chat template applied), indexed for matches of up to "
            f"{args.context} tokens.\n\nUse: `selfspec generate --draft lookup+datastore:THIS_DIR`, or "
            "the benchmark method `lookup+datastore:THIS_DIR`.\n\nMade with: `selfspec datastore --data "
            f"{data} --out {args.out} --model {args.model} --context {args.context}"
            f"{f' --limit {args.limit}' if args.limit else ''}{' --turns assistant' if args.turns != 'all' else ''}`\n")
    datastore.save(args.out, card=card)
    size = sum(p.stat().st_size for p in Path(args.out).iterdir()) / 2**20
    print(f"wrote {args.out}: {datastore.meta['num_documents']:,} {what}, {datastore.meta['num_tokens']:,} "
          f"tokens, {size:.1f} MB, in {time.perf_counter() - start:.0f} s")
    return 0


def assistant_turns(example: dict) -> list[list[int]]:
    """The token runs of ``example`` (``tokenize_records``' ``input_ids`` / ``loss_mask``) that are assistant turns."""
    turns, current = [], []
    for token, is_assistant in zip(example["input_ids"], example["loss_mask"]):
        if is_assistant:
            current.append(token)
        elif current:
            turns.append(current)
            current = []
    if current:
        turns.append(current)
    return turns
