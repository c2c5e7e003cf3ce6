"""Greedy output of every drafter family equals ``model.generate(do_sample=False)`` on a device: the check to run on a
machine the test suite does not (a lent GPU: ``python scripts/check_lossless.py --device cuda``).

Each tiny architecture (random weights, as the tests use) decodes a few prompts of different lengths with every
drafter family, random-weight drafters included (a trained drafter on random weights would accept nothing): the
feature drafter (dynamic and static trees), sequential Medusa heads, an early-exit classifier, prompt lookup, the
feature drafter merged with lookup and as its fallback, and a batch of prompts decoded together. Prints one line
per case and a summary; exits 1 when any output differs (``--json PATH`` also writes the cases).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from decoding import combine, fallback
from decoding.batch import generate_batch
from decoding.generate import generate
from eagle.drafter import EagleDrafter, EaglePolicy
from eagle.model import check_supported as eagle_supported
from early_exit.drafter import DraftPolicy, EarlyExitDrafter
from early_exit.layers import check_supported as early_exit_supported
from lookup.drafter import LookupDrafter
from medusa import MedusaDrafter
from selfspec.testing import (
    ARCHITECTURES,
    RandomDrafter,
    attention_classifier,
    eagle_draft,
    greedy_reference,
    random_prompt,
    sequential_heads,
    tiny_model,
)

PROMPT_LENGTHS = (1, 3, 17)
NEW_TOKENS = 24


def drafters(model) -> dict:
    """Fresh drafters of every family that supports ``model``'s architecture (random, nonzero weights), by name."""
    found = {}
    if supports(eagle_supported, model):
        draft = eagle_draft(model, draft_vocab_size=60).to(model.device)
        draft.refresh_shared()
        found["eagle (dynamic tree)"] = EagleDrafter(model, draft, EaglePolicy(depth=4, nodes=8, top_k=3, width=2))
        found["eagle (static tree)"] = EagleDrafter(model, draft, EaglePolicy(tree=((0,), (1,), (0, 0), (0, 0, 0))))
        found["eagle+lookup"] = combine(EagleDrafter(model, draft, EaglePolicy(depth=3, nodes=4)), LookupDrafter())
        found["lookup|eagle"] = fallback(LookupDrafter(), EagleDrafter(model, draft, EaglePolicy(depth=3, nodes=4)))
    found["medusa (sequential)"] = MedusaDrafter(sequential_heads(model).to(model.device),
                                                 tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    if supports(early_exit_supported, model):
        found["early exit"] = EarlyExitDrafter(model, attention_classifier(model).to(model.device),
                                               DraftPolicy(max_depth=4, top_k=2, width=2, max_nodes=6))
    return found | {"lookup": LookupDrafter()}


def supports(check_supported, model) -> bool:
    try:
        check_supported(model)
    except ValueError:
        return False
    return True


def check(arch: str, device: torch.device) -> list[dict]:
    torch.manual_seed(0)
    model = tiny_model(arch).to(device).eval()
    prompts = [random_prompt(n, seed=n).to(device) for n in PROMPT_LENGTHS]
    references = [greedy_reference(model, ids, NEW_TOKENS) for ids in prompts]
    cases = []
    # Random weights accept little, so verification is also driven by random 6-node trees that hold the true
    # continuation 70% of the time: deep paths accepted, the cache rolled back at every depth.
    oracles = [RandomDrafter(model.config.vocab_size, size=6, seed=i, reference=ref.cpu(), hit_rate=0.7)
               for i, ref in enumerate(references)]
    for name, drafter in [*drafters(model).items(), ("random trees holding the answer", oracles)]:
        started = time.perf_counter()
        equal = tau = 0
        for i, (ids, reference) in enumerate(zip(prompts, references)):
            out = generate(model, drafter[i] if isinstance(drafter, list) else drafter, ids,
                           max_new_tokens=NEW_TOKENS, eos_token_id=None)
            equal += torch.equal(out.sequences, reference)
            tau += out.stats.tau / len(prompts)
        cases.append({"arch": arch, "drafter": name, "equal": equal, "of": len(prompts), "tau": round(tau, 2),
                      "seconds": round(time.perf_counter() - started, 2)})
    name, drafter = next(iter(drafters(model).items()))  # the first family: eagle where supported, else Medusa
    batch = generate_batch(model, drafter, [p[0] for p in prompts], max_new_tokens=NEW_TOKENS)
    rows = [torch.equal(seq.to(device), ref) for seq, ref in zip(batch.sequences, references)]
    cases.append({"arch": arch, "drafter": f"{name.split()[0]}, prompts as one batch", "equal": sum(rows),
                  "of": len(rows)})
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--arch", action="append", choices=ARCHITECTURES,
                        help="tiny architectures to check (repeat; default: all)")
    parser.add_argument("--json", type=Path, help="also write the cases here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch sees no CUDA device (torch.cuda.is_available() is False): "
                     "run on the GPU machine, or pass --device cpu")
    cases = []
    for arch in args.arch or ARCHITECTURES:
        for case in check(arch, device):
            cases.append(case)
            print(f"{case['arch']:>8}  {case['drafter']:<30} {case['equal']}/{case['of']} equal to generate"
                  + (f"  tau {case['tau']:.2f}" if "tau" in case else ""), flush=True)
    failed = [c for c in cases if c["equal"] != c["of"]]
    total = sum(c["of"] for c in cases)
    print(f"{device}: {total - sum(c['of'] - c['equal'] for c in cases)}/{total} outputs equal to generate"
          + (f"; {len(failed)} cases differ" if failed else ""))
    if args.json:
        args.json.write_text(json.dumps({"device": str(device), "cases": cases}, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
