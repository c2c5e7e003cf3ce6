"""Tokens/s of one EAGLE training step (training-time test unrolled, soft loss, backward) on this machine, per
precision: what ``optim.mixed_precision`` buys before you launch a long run.

    python scripts/eagle_train_speed.py --batch 8 --seq 512 --ttt-steps 3 --precision fp32 bf16
    python scripts/eagle_train_speed.py --ttt-steps 7 --precision bf16 --attention sparse dense

The base's hidden states and teacher are computed once (as with ``cache_hidden_states``) and not timed; random token
ids, the committed drafter's weights (or a fresh one: ``--heads none``). Median of ``--repeats`` steps after one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--heads", default="heads/smollm2-135m-instruct-eagle3", help="a saved drafter, or none")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--attention", nargs="+", default=["sparse"], choices=["sparse", "dense"],
                        help="the unroll's attention: by the chain's structure (the recipe's) or a dense mask")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from eagle.model import EagleConfig, EagleDraftModel, default_aux_layers, from_pretrained
    from selfspec import training as T
    from selfspec.runtime.layers import num_decoder_layers
    from selfspec.runtime.models import load_model

    base, _ = load_model(args.model)
    base.requires_grad_(False).eval()
    if args.heads != "none":
        draft = from_pretrained(args.heads, base, dtype=torch.float32)
    else:
        config = EagleConfig(hidden_size=base.config.hidden_size, vocab_size=base.config.vocab_size,
                             draft_vocab_size=base.config.vocab_size,
                             aux_layers=list(default_aux_layers(num_decoder_layers(base))))
        draft = EagleDraftModel(config, base).float()
    draft.train().requires_grad_(True)
    draft.refresh_shared()
    layers = list(draft.config.aux_layers)
    ids = torch.randint(0, base.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        feats = T.hidden_states(base, ids, mask, layers + [-1])
        teacher = torch.softmax(base.get_output_embeddings()(feats[-1]), -1)[..., draft.draft_vocab]

    def step(precision: str, attention: str) -> float:
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            outputs = draft.unroll([feats[i] for i in layers], ids, mask, args.ttt_steps, sparse=attention == "sparse")
            loss = torch.zeros(())
            for j, out in enumerate(outputs):  # step j at t predicts t + j + 2, the base's prediction at t + j + 1
                log_q = torch.log_softmax(draft.logits(out[:, :args.seq - j - 2]).float(), -1)
                loss = loss - (teacher[:, j + 1:args.seq - 1] * log_q).sum() / log_q.shape[1]
        loss.backward()
        draft.zero_grad(set_to_none=True)
        return time.perf_counter() - started

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{cpu}, {torch.get_num_threads()} threads, batch {args.batch} x {args.seq}, {args.ttt_steps} TTT steps, "
          f"bf16 native: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    for precision in args.precision:
        for attention in args.attention:
            step(precision, attention)
            seconds = statistics.median(step(precision, attention) for _ in range(args.repeats))
            print(f"{precision}, {attention} attention: {seconds:.2f} s a step, "
                  f"{args.batch * args.seq / seconds:,.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
