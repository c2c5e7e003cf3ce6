"""Pick the layers a layer-skip self-draft skips (Draft & Verify / SWIFT), on calibration prompts, and save them.

    python scripts/search_layer_skip.py --model smollm2-135m-instruct --output heads/smollm2-135m-instruct-layer-skip

The search is greedy over teacher-forced top-1 agreement with the full model on its own greedy continuations
(see ``early_exit.estimates``), scored by the expected chain speedup; the chosen set is then measured for real
(tau and tokens/s with ``decoding.generate`` against plain decoding) and both are written to ``config.json``.
Calibration prompts default to ``selfspec.training.data.BUILTIN_PROMPTS``, kept apart from the MT-bench benchmark prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from decoding.generate import generate
from early_exit import DraftPolicy, LayerSkipConfig, LayerSkipDrafter
from early_exit.estimates import calibration_set
from early_exit.layer_skip import search_skip_layers
from selfspec.runtime.identity import base_model_identity
from selfspec.runtime.layers import num_decoder_layers
from selfspec.runtime.models import load_model
from selfspec.runtime.prompts import encode_prompt, read_prompts
from selfspec.training.data import BUILTIN_PROMPTS


def encoded_prompts(tokenizer, path: str | None, limit: int) -> list[torch.Tensor]:
    texts = [p["prompt"] for p in read_prompts(path, limit)] if path else BUILTIN_PROMPTS[:limit]
    return [encode_prompt(tokenizer, text) for text in texts]


def measure(model, drafter, prompts: list[torch.Tensor], new_tokens: int) -> dict:
    """tau of ``drafter`` and tokens/s of it and of plain decoding, interleaved per prompt (fair on a busy CPU)."""
    steps = tokens = 0
    seconds = {"draft": 0.0, "plain": 0.0}
    for ids in prompts:
        for name, d in (("plain", None), ("draft", drafter)):
            start = time.perf_counter()
            out = generate(model, d, ids, max_new_tokens=new_tokens)
            seconds[name] += time.perf_counter() - start
            if d is not None:
                steps, tokens = steps + out.stats.steps, tokens + out.stats.new_tokens
    return {"tau": tokens / max(steps, 1), "tokens_per_s": tokens / seconds["draft"],
            "plain_tokens_per_s": tokens / seconds["plain"], "speedup": seconds["plain"] / seconds["draft"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="base model (or tiny:<arch> for tests)")
    parser.add_argument("--output", required=True, help="directory to write config.json + README.md into")
    parser.add_argument("--prompts", help="Spec-Bench style JSONL of calibration prompts (default: built-in prompts)")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64, help="greedy continuation length per prompt")
    parser.add_argument("--max-depth", type=int, default=6, help="longest chain the search considers")
    parser.add_argument("--max-skip", type=int, default=None, help="most layers to skip (default: no limit)")
    parser.add_argument("--measure-tokens", type=int, default=64, help="tokens per prompt for the final measurement")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    model.eval()
    prompts = encoded_prompts(tokenizer, args.prompts, args.num_prompts)
    calibration = calibration_set(model, prompts, new_tokens=args.new_tokens)
    skip, metrics = search_skip_layers(model, calibration, max_depth=args.max_depth, max_skip=args.max_skip,
                                       log=lambda r: print(json.dumps(r), flush=True))
    if not skip:
        print("no skip set beats the full model drafting itself on these prompts (expected speedup <= 1): "
              "saving the empty set; layer skipping does not pay for this model", flush=True)
    drafter = LayerSkipDrafter(model, skip, DraftPolicy.chain(metrics["max_depth"]))
    metrics.update(measure(model, drafter, prompts, args.measure_tokens))
    metrics["calibration"] = {"prompts": args.prompts or "selfspec.training.data.BUILTIN_PROMPTS",
                              "num_prompts": len(prompts), "new_tokens": args.new_tokens}
    config = LayerSkipConfig(skip, base_model_identity(model), metrics=metrics,
                             policy={"max_depth": metrics["max_depth"]})
    command = "python scripts/search_layer_skip.py " + " ".join(argv if argv is not None else sys.argv[1:])
    readme = (f"# Layer-skip draft for {args.model}\n\nSkipped layers ({len(skip)} of {num_decoder_layers(model)}): "
              f"{skip}; chain length {metrics['max_depth']}.\n\nMade by `{command}`.\n\n"
              f"Measured on the calibration prompts: tau {metrics['tau']:.2f}, {metrics['tokens_per_s']:.1f} tokens/s "
              f"vs {metrics['plain_tokens_per_s']:.1f} plain.\n\nUse: `selfspec generate --draft layer-skip --heads DIR`.\n")
    config.save(args.output, readme=readme)
    print(json.dumps({k: v for k, v in metrics.items() if k != "rounds"}, indent=2))
    print(f"saved {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
