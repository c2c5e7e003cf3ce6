"""``selfspec export``: a trained drafter in the directory format a serving engine loads.

    selfspec export --format speculators --heads heads/smollm2-135m-instruct-eagle3 --out runs/eagle3-speculators

``speculators``: an EAGLE-3 feature drafter as vLLM ``speculators``' ``eagle3`` directory (``eagle.export``), which
``vllm serve BASE --speculative-config '{"model": OUT, "method": "eagle3", "num_speculative_tokens": 4}'`` loads.
``eagle3`` (alias ``sglang``): the same drafter as an EAGLE-3 reference checkpoint (``LlamaForCausalLMEagle3``, what
SpecForge writes), which ``python -m sglang.launch_server --model BASE --speculative-algorithm EAGLE3
--speculative-draft-model-path OUT`` loads. ``--heads`` may itself be a speculators or eagle3 directory (conversion).
``vllm-medusa``: parallel Medusa heads as the directory vLLM's Medusa drafter loads (``medusa.export``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from selfspec.runtime.io import CONFIG_NAME

FORMATS = ("speculators", "eagle3", "sglang", "vllm-medusa")  # sglang: the eagle3 format


def register(subparsers) -> None:
    p = subparsers.add_parser("export", help="write a trained drafter in a serving engine's format",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, choices=FORMATS, help="target format")
    p.add_argument("--heads", required=True, help="the trained drafter's directory")
    p.add_argument("--out", required=True, help="directory to write (replaced atomically if it exists)")
    p.add_argument("--model", default=None, help="base model the drafter runs on (default: the embedded "
                   "smollm2-135m-instruct)")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="dtype of the weights written (default: bfloat16 for eagle3, what SGLang serves with; as "
                        "trained for speculators, which vLLM casts on load)")
    p.add_argument("--verifier", default=None,
                   help="speculators: the target model's hub id or path recorded for vLLM (default: the hub id of a "
                        "model alias, e.g. HuggingFaceTB/SmolLM2-135M-Instruct, else the base model's own name)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    heads = Path(args.heads)
    config_path = heads / CONFIG_NAME
    if not config_path.is_file():
        raise FileNotFoundError(f"--heads {heads}: no {CONFIG_NAME}; pass a directory written by a selfspec recipe")
    from eagle.export import config_format

    config = json.loads(config_path.read_text())
    fmt = "eagle3" if args.format == "sglang" else args.format
    is_eagle = config.get("format") == "selfspec-eagle3" or config_format(config) != "selfspec"
    if fmt in ("speculators", "eagle3") and not is_eagle:
        raise ValueError(f"--heads {heads} is not an EAGLE-3 feature drafter: the {fmt} format takes drafters "
                         "trained with `selfspec train eagle` (Medusa heads export with --format vllm-medusa)")
    if args.format == "vllm-medusa" and ("num_heads" not in config or is_eagle):
        raise ValueError(f"--heads {heads} does not hold Medusa heads: --format vllm-medusa takes heads trained with "
                         "`selfspec train medusa` (a feature drafter exports with --format speculators)")
    from selfspec.runtime.models import load_model

    model, _ = load_model(args.model or "smollm2-135m-instruct")
    if is_eagle:
        from eagle.export import export_eagle3, export_speculators, load_drafter
        from selfspec.runtime.models import ALIASES

        alias = ALIASES.get(args.model or "smollm2-135m-instruct")
        import torch

        draft = load_drafter(heads, model)
        dtype = getattr(torch, args.dtype) if args.dtype else None
        if fmt == "eagle3":
            out = export_eagle3(draft, args.out, **({"dtype": dtype} if dtype else {}))
            print(f"wrote {out} (EAGLE-3 / SGLang {draft.config.draft_vocab_size} draft tokens, aux layer ids "
                  f"{[i - 1 for i in draft.config.aux_layers]} in SGLang's convention)")
            return 0
        out = export_speculators(draft, args.out, args.verifier or (alias.hub_id if alias else None), dtype)
        print(f"wrote {out} (speculators eagle3: {draft.config.draft_vocab_size} draft tokens, layers "
              f"{draft.config.aux_layers})")
        return 0
    from medusa.export import check_exportable, export_vllm_medusa
    from medusa.heads import MedusaHeads

    medusa_heads = MedusaHeads.from_pretrained(heads, model)
    check_exportable(medusa_heads)
    out = export_vllm_medusa(medusa_heads, args.out)
    print(f"wrote {out} (vLLM Medusa: {medusa_heads.config.num_heads} heads)")
    return 0
