"""Self-distillation: the base model writes the responses to a set of prompts, saved as a ShareGPT dataset.

    python scripts/self_distill.py --out runs/distilled --prompts builtin
    python scripts/self_distill.py --out runs/distilled --prompts self --num-prompts 256
    python scripts/self_distill.py --out runs/distilled --prompts data/alpaca.jsonl --max-new-tokens 256
    python scripts/self_distill.py --out runs/mt-tune-answers --prompts mt_bench_1-40.jsonl --batch-size 40

Greedy responses (the default) are exactly what greedy decoding will verify, so heads trained on them are
accepted most often. Generation is batched with left padding (prompts length-sorted within windows of 8 shards;
greedy rows leave the batch as they stop), and resumable: finished prompts are appended to
``shard-NNNNN.jsonl`` files and skipped when the command is run again. ``--arrow`` also saves the finished set
with ``datasets.Dataset.save_to_disk``. Train on the result with ``data.source=<out>``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from selfspec.runtime.models import load_model
from selfspec.training import data as D


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="alias, hub id, local path or tiny:<arch>")
    parser.add_argument("--out", required=True, help="output directory (shards are appended; rerun to resume)")
    parser.add_argument("--prompts", default="builtin",
                        help="builtin | self | tasks:N | a dataset file/dir/hub id | an MT-bench / Spec-Bench "
                             "question file (first turns; e.g. the model's own answers to held-out tuning prompts, for "
                             "data.eval_source)")
    parser.add_argument("--num-prompts", type=int, default=None, help="use at most this many prompts")
    parser.add_argument("--prompt-max-new-tokens", type=int, default=48, help="length of self-generated prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="length limit of a response")
    parser.add_argument("--batch-size", type=int, default=16, help="prompts generated at once")
    parser.add_argument("--shard-size", type=int, default=64, help="responses per shard file")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--device", default="cpu",
                        help="where the model generates: cpu (default) or cuda (a GPU answers thousands of prompts a "
                             "minute at --batch-size 512; scripts/gpu_train_eagle.sh does so)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no new shard after this many minutes (the run so far is kept; rerun to resume)")
    parser.add_argument("--arrow", action="store_true", help="also save_to_disk the whole set under <out>/arrow")
    args = parser.parse_args(argv)
    if args.prompts == "self" and args.num_prompts is None:
        parser.error("--prompts self needs --num-prompts")
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_model(args.model, device=args.device)
    with tqdm(total=args.num_prompts, desc="prompts", unit="prompt", disable=args.prompts != "self") as bar:
        prompts = D.resolve_prompts(args.prompts, model, tokenizer, out, num_prompts=args.num_prompts,
                                    max_new_tokens=args.prompt_max_new_tokens, batch_size=args.batch_size,
                                    seed=args.seed, progress=bar.update)
    started = time.time()
    with tqdm(total=len(prompts), desc="self-distilling", unit="prompt") as bar:
        D.distill(model, tokenizer, prompts, out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                  temperature=args.temperature, shard_size=args.shard_size, seed=args.seed, progress=bar.update,
                  max_minutes=args.max_minutes)
    records = D.load_records(str(out))
    print(f"{len(records)} conversations in {out} ({time.time() - started:.0f}s this run)")
    if args.arrow:
        records.save_to_disk(str(out / "arrow"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
