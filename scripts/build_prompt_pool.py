"""A large prompt pool for self-distillation on a lent GPU: every chit-chat question turn, task templates of many
seeds, and any prompt files given, minus every prompt an earlier corpus already answered. A GPU answers ~10^4
prompts in minutes (``scripts/self_distill.py --device cuda --batch-size 512``), where a 2-core CPU answers one every
1-3 seconds, so the pool is sized for the GPU.

    mkdir -p /tmp/whl && cd /tmp/whl && pip download --no-deps chitchat-dataset==0.9.0 && unzip -q -o '*.whl' && cd -
    python scripts/build_prompt_pool.py --wheels /tmp/whl --exclude ../shared/data/distill-smollm2-v1 \\
        --include ../shared/data/distill-smollm2-v1/prompts.jsonl --out runs/prompt-pool.jsonl

``--include`` files are prompt lists in the ShareGPT layout (``{"id", "conversations": [{"from": "human", ...}]}``,
as ``prompts.jsonl`` of the distilled corpora and ``scripts/build_broad_prompts.py`` write them); their prompts that
``--exclude`` answered are dropped like any other. Every record is ``{"id", "source", "conversations": [human
turn]}``, shuffled with a fixed seed, so a run stopped by its time budget has answered a mix of every source. None
is an MT-bench question (the sources hold none; ``--exclude`` takes the MT-bench file too, to be sure).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from pathlib import Path

from selfspec.runtime.prompts import read_prompts
from selfspec.training.data import prompt_records, prompts_from_source
from selfspec.training.task_prompts import task_prompts


def _prompts_of(path: str) -> list[str]:
    """The user prompts of a corpus directory (its answered shards), a ShareGPT prompt file, or an MT-bench /
    Spec-Bench question file (first turns)."""
    try:
        return [p["prompt"] for p in prompts_from_source(path)]
    except ValueError:  # not a dataset format the training data loader reads: a question file
        return [p["prompt"] for p in read_prompts(path)]


def chitchat_turns(wheels: Path, per_conversation: int, rng: random.Random) -> list[str]:
    """Up to ``per_conversation`` turns of each human chit-chat conversation that ask something (40-400 characters,
    a question mark), as build_prompts.py of distill-smollm2-v1 took one."""
    data = wheels / "chitchat_dataset" / "dataset.json"
    if not data.is_file():
        raise SystemExit(f"{data} not found: download and unzip chitchat-dataset==0.9.0 into --wheels (see the "
                         "docstring)")
    out = []
    for conversation in json.loads(data.read_text()).values():
        turns = [" ".join(m["text"].strip() for m in group) for group in conversation["messages"]]
        turns = [t for t in turns if 40 <= len(t) <= 400 and "?" in t]
        rng.shuffle(turns)
        out += turns[:per_conversation]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheels", required=True, help="folder with chitchat-dataset unzipped in it")
    parser.add_argument("--out", required=True, help="the pool, JSONL")
    parser.add_argument("--include", action="append", default=[], help="a prompt file to add (repeatable)")
    parser.add_argument("--exclude", action="append", default=[],
                        help="a corpus directory or prompt file whose prompts are answered already (repeatable)")
    parser.add_argument("--turns-per-conversation", type=int, default=2)
    parser.add_argument("--task-prompts", type=int, default=4000, help="task-template prompts wanted (new ones)")
    parser.add_argument("--seed", type=int, default=20261207)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    answered = {p for path in args.exclude for p in _prompts_of(path)}
    sources: list[tuple[str, str]] = [("chitchat", t) for t in chitchat_turns(Path(args.wheels),
                                                                                args.turns_per_conversation, rng)]
    tasks: list[str] = []
    for seed in range(1000, 1100):  # templates repeat across seeds: draw until enough are new
        tasks += [p for p in task_prompts(2000, seed=seed) if p not in answered]
        tasks = list(dict.fromkeys(tasks))
        if len(tasks) >= args.task_prompts:
            break
    sources += [("tasks", p) for p in tasks[:args.task_prompts]]
    for path in args.include:
        sources += [(Path(path).parent.name, p) for p in _prompts_of(path)]
    records = prompt_records(sources, skip=answered, id_prefix="pool-")
    rng.shuffle(records)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"{len(records)} prompts in {out}: {dict(Counter(r['source'] for r in records))} "
          f"({len(answered)} answered ones left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
