"""How much of a corpus a feature drafter's draft vocabulary can say at all: the share of trained (assistant) tokens
whose id is in the vocabulary, for the saved drafter and for candidate vocabularies built from training data the
way the recipes build them (``frequent_tokens``: the N most frequent; ``extended_vocab``: the saved ids plus the
most frequent ones they lack, what ``init_from`` with a larger ``draft.draft_vocab_size`` trains).

    python scripts/draft_vocab_coverage.py --heads heads/smollm2-135m-instruct-eagle3 \\
        --train runs/distill-broad/shard-0000[0-6].jsonl --held runs/distill-broad/shard-0000[78].jsonl \\
        --held runs/mt-tune-answers --sizes 8192,12288,16384

A target outside the draft vocabulary can never be drafted, so the share is a ceiling on every depth's acceptance;
pick the vocabulary on held-out data of the kind you will decode (never on your test prompts). Tokenized as the
recipes tokenize (chat template, ``data.max_length``), so the counts are the recipe's.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import torch

from eagle.recipe import extended_vocab
from selfspec.runtime.models import load_model
from selfspec.training.data import frequent_tokens, load_records, tokenize_records


def _sources(patterns: list[str]) -> list[str]:
    out = []
    for pattern in patterns:
        found = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not found:
            raise SystemExit(f"error: {pattern!r} matches no file; give ShareGPT files or directories")
        out += found
    return out


def _examples(patterns: list[str], tokenizer, max_length: int) -> list[dict]:
    return tokenize_records(load_records(_sources(patterns)), tokenizer, max_length=max_length)


def coverage(vocab: torch.Tensor, examples: list[dict]) -> float:
    """Share of the trained tokens of ``examples`` whose id is in ``vocab``."""
    inside = torch.zeros(int(max(vocab.max(), max(max(e["input_ids"]) for e in examples))) + 1, dtype=torch.bool)
    inside[vocab] = True
    hit = total = 0
    for e in examples:
        ids = torch.tensor([t for t, m in zip(e["input_ids"], e["loss_mask"]) if m], dtype=torch.long)
        hit += int(inside[ids].sum())
        total += len(ids)
    return hit / max(1, total)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", help="a saved eagle drafter: its vocabulary, and the one extended from it")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--train", action="append", required=True, help="data the candidates are counted on")
    parser.add_argument("--held", action="append", required=True, help="data the coverage is measured on (each)")
    parser.add_argument("--sizes", default="8192,12288,16384", help="candidate vocabulary sizes")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    model, tokenizer = load_model(args.model)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    train = _examples(args.train, tokenizer, args.max_length)
    held = {h: _examples([h], tokenizer, args.max_length) for h in args.held}
    candidates: dict[str, torch.Tensor] = {}
    if args.heads:
        from eagle.model import from_pretrained

        saved = from_pretrained(args.heads, model).draft_vocab.cpu()
        candidates[f"saved ({len(saved)})"] = saved
        for n in sizes:
            if n > len(saved):
                candidates[f"saved + most frequent it lacks ({n})"] = extended_vocab(saved, train, n, vocab_size)
    for n in sizes:
        candidates[f"most frequent ({n})"] = frequent_tokens(train, n, vocab_size)
    table = {name: {h: coverage(v, ex) for h, ex in held.items()} for name, v in candidates.items()}
    width = max(len(name) for name in table)
    print(f"{'vocabulary':<{width}}  " + "  ".join(Path(h).name[:24].rjust(24) for h in held))
    for name, row in table.items():
        print(f"{name:<{width}}  " + "  ".join(f"{row[h]:24.4f}" for h in held))
    result = {"train": args.train, "train_tokens": sum(sum(e["loss_mask"]) for e in train), "coverage": table}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
