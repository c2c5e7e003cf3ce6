"""How well a feature drafter predicts the model's own answers to a prompt set: the base answers each prompt greedily
(what greedy speculative decoding verifies), then the drafter runs teacher-forced over the answer, unrolled as in
training, and every answer position is scored.

    python scripts/draft_accuracy.py --heads heads/smollm2-135m-instruct-eagle3 \\
        --prompts mt_bench_41-80.jsonl --prompts heldout_distill_prompts.jsonl --limit 12

Printed per prompt set: top-1 accuracy per draft depth (depth 1 is the first draft token: features of position t
and the token t+1 predict t+2; depth j reads its own outputs for the j-1 steps before), the depth-1 top-k accuracy
(what a tree with k children at the root can accept at best), the share of answer tokens inside the draft
vocabulary (a bound on any depth), and the expected accepted length of a chain under teacher forcing. Set against
the acceptance the benchmark measures in the decode loop, this separates "the drafter predicts badly on these
prompts" (low here too) from "the decode loop loses what the drafter knows" (high here, low there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from eagle.model import from_pretrained
from selfspec.runtime.kernels import set_linear_backend
from selfspec.runtime.models import load_model
from selfspec.runtime.prompts import encode_prompt, read_prompts

TOP_K = (1, 2, 4, 8)
#: bins of the base's own probability of the token a first draft must guess (``score``'s ``by_confidence``)
CONFIDENCE_BINS = (0.0, 0.5, 0.8, 0.95, 1.0)


def greedy_answers(model, tokenizer, prompts: list[dict], max_new_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """``(prompt + the model's greedy answer [1, s], prompt length)`` per prompt."""
    answers = []
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt["prompt"])
        full = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                              do_sample=False)
        answers.append((full, ids.shape[1]))
    return answers


@torch.inference_mode()
def score(model, draft, answers: list[tuple[torch.Tensor, int]], *, depths: int, full_vocab: bool = False) -> dict:
    """Accuracy figures of ``draft`` over ``answers`` (``(prompt + answer [1, s], prompt length)``, see
    ``greedy_answers``), as the module doc says. ``full_vocab``: rank the base's whole vocabulary with the shared LM
    head (what the same trained layer would draft without a reduced vocabulary)."""
    if full_vocab:
        vocab = torch.arange(model.get_output_embeddings().weight.shape[0])
        head = lambda out: model.get_output_embeddings()(draft.norm(out))  # noqa: E731
    else:
        vocab, head = draft.draft_vocab, draft.logits
    hits = torch.zeros(depths)
    topk_hits = torch.zeros(len(TOP_K))
    targets = torch.zeros(depths)
    in_vocab = answered = 0
    bins = torch.tensor(CONFIDENCE_BINS)
    bin_hits = torch.zeros(len(bins) - 1)
    bin_count = torch.zeros(len(bins) - 1)
    chain = []  # per answer: mean accepted drafts of a teacher-forced chain from each answer position
    for full, start in answers:
        answer = full[0, start:]
        if answer.numel() < depths + 1:
            continue
        in_vocab += int(torch.isin(answer, vocab).sum())
        answered += answer.numel()
        base_out = model(full, output_hidden_states=True)
        hidden = base_out.hidden_states
        outputs = draft.unroll([hidden[i] for i in draft.config.aux_layers], full, torch.ones_like(full), depths)
        correct = []
        for j, out in enumerate(outputs):
            # step j at position t predicts s_{t+j+2}; the decode loop drafts from t = start - 1 (the prompt's last
            # position, with the first answer token) on
            logits = head(out[0, start - 1:full.shape[1] - j - 2])
            target = full[0, start + j + 1:]
            ok = vocab[logits.argmax(-1)] == target
            hits[j] += ok.sum()
            targets[j] += ok.numel()
            correct.append(ok)
            if j == 0:
                # how sure the base itself was of that token (position t + 1 predicts s_{t+2}): a first draft
                # must guess what the base decides with all its layers, hardest where the base barely decides
                probs = torch.softmax(base_out.logits[0, start:full.shape[1] - 1].float(), dim=-1)
                sure = probs.gather(-1, target[:, None])[:, 0]
                which = (torch.bucketize(sure, bins[1:-1], right=True)).clamp_max(len(bins) - 2)
                bin_count += torch.bincount(which, minlength=len(bins) - 1).float()
                bin_hits += torch.bincount(which, weights=ok.float(), minlength=len(bins) - 1)
                ranked = vocab[logits.topk(min(max(TOP_K), len(vocab)), dim=-1).indices]
                for i, k in enumerate(TOP_K):
                    topk_hits[i] += (ranked[:, :k] == target[:, None]).any(-1).sum()
        # a chain from position t: depth j + 1 is accepted while every earlier depth was (all start at start - 1)
        n = len(correct[-1])
        alive = torch.ones(n, dtype=torch.bool)
        accepted = torch.zeros(n)
        for ok in correct:
            alive &= ok[:n]
            accepted += alive
        chain.append(float(accepted.mean()))
    return {"answers": len(chain), "answer_tokens": answered,
            "top1_per_depth": (hits / targets.clamp_min(1)).tolist(),
            "depth1_topk": {k: float(topk_hits[i] / targets[0].clamp_min(1)) for i, k in enumerate(TOP_K)},
            "in_draft_vocab": in_vocab / max(answered, 1),
            # per bin of the base's probability of the first draft's target: share of positions, top-1 accuracy
            "by_confidence": [{"base_prob": [CONFIDENCE_BINS[i], CONFIDENCE_BINS[i + 1]],
                               "share": float(bin_count[i] / bin_count.sum().clamp_min(1)),
                               "top1": float(bin_hits[i] / bin_count[i].clamp_min(1))} for i in range(len(bins) - 1)],
            "chain_accepted": sum(chain) / max(len(chain), 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", required=True, help="an eagle drafter directory")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", action="append", required=True,
                        help="Spec-Bench / MT-bench JSONL (repeat for several sets)")
    parser.add_argument("--limit", type=int, default=12, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--depths", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--full-vocab", action="store_true",
                        help="also score ranking the whole vocabulary with the shared LM head")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--linear-backend", default="auto", choices=("auto", "stock", "skinny"),
                        help="kernels the answers are generated on (auto: what selfspec bench decodes on, and ~6x "
                        "faster than stock on a CPU); scoring runs on stock")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model)
    model.eval()
    draft = from_pretrained(args.heads, model).eval()
    if args.full_vocab and draft.lm_head is not None:
        parser.error("--full-vocab needs a drafter that shares the base's LM head (share_lm_head)")
    results = {}
    for path in args.prompts:
        set_linear_backend(model, args.linear_backend)
        answers = greedy_answers(model, tokenizer, read_prompts(path, args.limit), args.max_new_tokens)
        set_linear_backend(model, "stock")
        for full in (False, True) if args.full_vocab else (False,):
            results[f"{path} (full vocabulary)" if full else path] = score(model, draft, answers, depths=args.depths,
                                                                            full_vocab=full)
    depth_cols = " | ".join(f"top-1 d{j + 1}" for j in range(args.depths))
    print(f"| prompts | {depth_cols} | d1 top-2 | d1 top-4 | in draft vocab | chain accepted |")
    print("|---|" + "---:|" * (args.depths + 4))
    for path, r in results.items():
        cells = " | ".join(f"{a:.3f}" for a in r["top1_per_depth"])
        print(f"| {Path(path).name} ({r['answers']}, {r['answer_tokens']} tok) | {cells} | "
              f"{r['depth1_topk'][2]:.3f} | {r['depth1_topk'][4]:.3f} | {r['in_draft_vocab']:.3f} | "
              f"{r['chain_accepted']:.2f} |")
    print("\nfirst-draft top-1 by how likely the base itself found that token (share of positions: top-1)")
    print("| prompts | " + " | ".join(f"base p {a:g}-{b:g}" for a, b in zip(CONFIDENCE_BINS, CONFIDENCE_BINS[1:])) + " |")
    print("|---|" + "---:|" * (len(CONFIDENCE_BINS) - 1))
    for path, r in results.items():
        cells = " | ".join(f"{b['share']:.2f}: {b['top1']:.2f}" for b in r["by_confidence"])
        print(f"| {Path(path).name} | {cells} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"heads": args.heads, "max_new_tokens": args.max_new_tokens,
                                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
