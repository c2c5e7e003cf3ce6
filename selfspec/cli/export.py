"""``selfspec export``: a trained drafter in the directory format a serving engine loads.

    selfspec export --format speculators --heads heads/smollm2-135m-instruct-eagle3 --out runs/eagle3-speculators

``speculators``: an EAGLE-3 feature drafter as vLLM ``speculators``' ``eagle3`` directory (``eagle.export``), which
``vllm serve BASE --speculative-config '{"model": OUT, "method": "eagle3", "num_speculative_tokens": 4}'`` loads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from selfspec.runtime.io import CONFIG_NAME

FORMATS = ("speculators",)


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a trained drafter in a serving engine's format",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, choices=FORMATS, help="target format")
    p.add_argument("--heads", required=True, help="the trained drafter's directory")
    p.add_argument("--out", required=True, help="directory to write (replaced atomically if it exists)")
    p.add_argument("--model", default=None, help="base model (default: the one the drafter was trained on)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    heads = Path(args.heads)
    config_path = heads / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"--heads {heads}: no {CONFIG_NAME}; pass a directory written by a selfspec recipe")
    config = json.loads(config_path.read_text())
    if config.get("format") != "selfspec-eagle3":
        raise ValueError(f"--heads {heads} is not an EAGLE-3 feature drafter (format {config.get('format')!r}): the "
                         "speculators format takes drafters trained with `selfspec train eagle`")
    from eagle.export import export_speculators
    from eagle.model import from_pretrained
    from selfspec.runtime.models import load_model

    model_name = args.model or "smollm2-135m-instruct"
    model, _ = load_model(model_name)
    draft = from_pretrained(heads, model)
    out = export_speculators(draft, args.out)
    print(f"wrote {out} (speculators eagle3: {draft.config.draft_vocab_size} draft tokens, layers "
          f"{draft.config.aux_layers})")
    return 0
