"""Measured draft cost of a Kangaroo exit on random Llama models of other shapes, on this machine: the per-token draft
time of an early-exit drafter (E base layers + a one-block attention adapter with MLP + an 8,192-row head) over a
plain decoding step, at a 256-token context. Random weights: the cost of a forward does not depend on their values.

    python scripts/exit_cost_shapes.py --exit-layer 2          # SmolLM2-135M's shape, a shallow 8-layer one, SmolLM2-1.7B's

What it answers: on which model shapes a shallow exit is cheap enough to pay (the acceptance it then needs is
``early_exit.estimates.required_acceptance``; scripts/exit_sweep_report.py prints both for measured drafts).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

SHAPES = {"smollm2-135m (30 x 576)": (576, 1536, 30, 9, 3), "8 x 576": (576, 1536, 8, 9, 3),
          "smollm2-1.7b (24 x 2048)": (2048, 8192, 24, 32, 32)}


def measure(shape, exit_layer: int, context: int, new_tokens: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from decoding import generate
    from early_exit import DraftPolicy, EarlyExitDrafter, new_classifier
    from selfspec.runtime.kernels import set_linear_backend

    hidden, inter, layers, heads, kv = shape
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=49152, max_position_embeddings=4096, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
    model.eval()
    backend = set_linear_backend(model, "auto")
    classifier = new_classifier(model, exit_layer, adapter_layers=1, adapter="attention", adapter_mlp_size=inter,
                                own_norm=True, draft_vocab=torch.arange(8192))
    ids = torch.randint(0, 49152, (1, context), generator=torch.Generator().manual_seed(0))
    runs = {}
    for name, drafter in (("plain", None),
                          ("draft", EarlyExitDrafter(model, classifier, DraftPolicy.chain(1)))):
        generate(model, drafter, ids[:, :32], max_new_tokens=4)  # warm-up
        start = time.perf_counter()
        out = generate(model, drafter, ids, max_new_tokens=new_tokens, eos_token_id=-1)
        runs[name] = (out.stats, time.perf_counter() - start)
    plain = runs["plain"][0]
    step_ms = 1e3 * plain.time_verify / plain.steps
    draft = runs["draft"][0]
    draft_ms = 1e3 * draft.time_draft / max(sum(draft.tree_sizes), 1)
    return {"backend": backend, "plain_step_ms": step_ms, "draft_ms": draft_ms, "share": draft_ms / step_ms}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exit-layer", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), help=f"any of: {', '.join(SHAPES)}")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from selfspec.bench.cost import cpu_model

    print(f"{cpu_model()}, {args.threads} threads, context {args.context}, exit layer {args.exit_layer}\n")
    print("| shape | kernels | plain step ms | draft ms / token | draft / plain step |\n|---|---|---:|---:|---:|")
    for name in args.shapes:
        r = measure(SHAPES[name], args.exit_layer, args.context, args.new_tokens)
        print(f"| {name} | {r['backend']} | {r['plain_step_ms']:.1f} | {r['draft_ms']:.2f} | {r['share']:.3f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
