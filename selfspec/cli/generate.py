"""``selfspec generate``: answer prompts with any registered drafter, streaming text or printing JSON lines."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from decoding import available_drafters, generate, make_drafter
from decoding.registry import resolve_spec
from selfspec.cli.bench import add_backend_argument
from selfspec.cli.checks import positive_int, probability, temperature
from selfspec.runtime.adapters import adapter_spec
from selfspec.runtime.kernels import set_draft_weights, set_linear_backend
from selfspec.runtime.models import DEFAULT_MODEL, load_model
from selfspec.runtime.prompts import encode_prompt, read_prompts


def parse_options(pairs: list[str]) -> dict:
    """``["tree_size=16", "threshold=0.5"]`` -> ``{"tree_size": 16, "threshold": 0.5}`` (values parsed as YAML)."""
    import yaml

    options = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"--draft-option expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        try:
            options[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as error:
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ValueError(f"--draft-option {key.strip()}: cannot read {value!r} ({problem}); values are YAML, "
                             "e.g. tree=[[0],[0,0],[1]] or threshold=0.5") from None
    return options


def _drafter_name(text: str) -> str:
    try:
        names = [part.name for part in resolve_spec(text)[0]]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    unknown = [name for name in names if name not in available_drafters()]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown drafter {unknown[0]!r}; choose from "
                                         f"{', '.join(available_drafters())} (or join several with '+' or '|')")
    return text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding",
                       description="Generate with the base model verifying drafts from its own heads or layers.")
    p.add_argument("--model", default=None, help="model alias, hub id or local path (default: the embedded model)")
    p.add_argument("--draft", default="none", type=_drafter_name,
                   help=f"drafter: one of {', '.join(available_drafters())}, or several joined by '+' into one tree "
                        "(medusa+lookup); a part may name its own directory and options "
                        "(lookup[nodes=8]+datastore:DIR); 'a|b' asks b only where a proposes nothing "
                        "(lookup|eagle:HEADS+datastore:DIR); default none")
    p.add_argument("--heads", default=None, help="directory of trained heads / classifier / layer-skip config")
    p.add_argument("--draft-option", action="append", default=[], metavar="KEY=VALUE",
                   help="extra drafter option, repeatable (e.g. tree_size=16)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="one prompt (user turn; the chat template is applied)")
    src.add_argument("--prompts", default=None, help="JSONL file in Spec-Bench format (first turn of 'turns')")
    p.add_argument("--limit", type=positive_int, default=None, help="use only the first N prompts of --prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--temperature", type=temperature, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=probability, default=None)
    p.add_argument("--top-k", type=positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--acceptance", default="auto", choices=["auto", "greedy", "speculative", "typical"],
                   help="typical is Medusa's typical acceptance: faster at high temperature, NOT lossless")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming text")
    p.add_argument("--batch-size", type=positive_int, default=1,
                   help="decode this many prompts together (each row accepts its own tokens; outputs as at batch 1); "
                        "answers print when their batch ends")
    add_backend_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prompt is not None:
        prompts = [{"id": 0, "category": None, "prompt": args.prompt}]
    elif args.prompts is not None:
        prompts = read_prompts(args.prompts, args.limit)
    else:
        raise ValueError("give --prompt TEXT or --prompts FILE.jsonl")
    if args.heads is not None and args.draft == "none":
        raise ValueError(f"--heads {args.heads} is given but no drafter: add --draft medusa (or early-exit, layer-skip; "
                         "medusa+lookup to merge with prompt lookup)")
    options = parse_options(args.draft_option)  # a malformed option fails here, before the model loads
    model_name = args.model or DEFAULT_MODEL
    if args.model is None and args.heads and adapter_spec(args.heads):
        model_name = args.heads  # heads trained with a LoRA backbone (Medusa-2, LayerSkip) decode the adapted model
    model, tokenizer = load_model(model_name)
    set_linear_backend(model, args.linear_backend)
    set_draft_weights(args.draft_weights)
    drafter = make_drafter(args.draft, model, args.heads, **options)
    if args.batch_size > 1:
        return _run_batches(args, model, tokenizer, drafter, prompts)
    for item in prompts:
        input_ids = encode_prompt(tokenizer, item["prompt"], chat=not args.no_chat)
        streamer = None if args.json else TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        out = generate(model, drafter, input_ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, acceptance=args.acceptance,
                       eos_token_id=tokenizer.eos_token_id, streamer=streamer)
        new = out.sequences[0, input_ids.shape[1]:].tolist()
        if args.json:
            record = {"id": item["id"], "prompt": item["prompt"], "token_ids": new,
                      "text": tokenizer.decode(new, skip_special_tokens=True), "stats": out.stats.to_dict()}
            print(json.dumps(record), flush=True)
        else:
            s = out.stats
            print(f"\n[{s.new_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, tau {s.tau:.2f}, {s.steps} steps]",
                  file=sys.stderr, flush=True)
    return 0


def _run_batches(args, model, tokenizer, drafter, prompts: list[dict]) -> int:
    from decoding.batch import generate_batch

    if args.acceptance == "typical":
        raise ValueError("--acceptance typical is not available with --batch-size > 1 (batches accept losslessly)")
    for start in range(0, len(prompts), args.batch_size):
        items = prompts[start:start + args.batch_size]
        encoded = [encode_prompt(tokenizer, item["prompt"], chat=not args.no_chat) for item in items]
        out = generate_batch(model, drafter, encoded, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0)
        for item, ids, sequence, s in zip(items, encoded, out.sequences, out.stats):
            new = sequence[0, ids.shape[1]:].tolist()
            text = tokenizer.decode(new, skip_special_tokens=True)
            if args.json:
                print(json.dumps({"id": item["id"], "prompt": item["prompt"], "token_ids": new, "text": text,
                                  "stats": s.to_dict(), "batch_size": len(items)}), flush=True)
            else:
                print(text, flush=True)
                print(f"[{s.new_tokens} tokens, tau {s.tau:.2f}, {s.steps} steps; batch of {len(items)}: "
                      f"{sum(x.new_tokens for x in out.stats) / s.time_total:.1f} tokens/s together]",
                      file=sys.stderr, flush=True)
    return 0
