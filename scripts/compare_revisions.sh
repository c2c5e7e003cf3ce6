#!/usr/bin/env bash
# Greedy outputs of every drafter family at another git revision and at this checkout, token for token, with the
# number of verification steps (equal steps: the drafts themselves were equal). For behaviour-preserving changes:
#
#   bash scripts/compare_revisions.sh 1b6379b [PROMPTS.jsonl] [N] [NEW_TOKENS]
#
# The other revision runs from a temporary worktree with this checkout's virtualenv (PYTHONPATH first).
set -euo pipefail
rev=${1:?usage: compare_revisions.sh REVISION [PROMPTS.jsonl] [N] [NEW_TOKENS]}
root=$(cd "$(dirname "$0")/.." && pwd)
prompts=${2:-$root/../shared/data/mt_bench.jsonl}
n=${3:-3}
tokens=${4:-64}
py=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/old" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git -C "$root" worktree add -q --detach "$work/old" "$rev"
drafters=("none|" "lookup|" "medusa|heads/smollm2-135m-instruct-medusa" "medusa+lookup|heads/smollm2-135m-instruct-medusa-seq"
          "early-exit|heads/smollm2-135m-instruct-early-exit")
for side in old new; do
  dir=$root; pythonpath=
  if [ $side = old ]; then dir=$work/old; pythonpath=$work/old; fi
  for spec in "${drafters[@]}"; do
    draft=${spec%%|*}; heads=${spec##*|}
    args=(--prompts "$prompts" --limit "$n" --max-new-tokens "$tokens" --json --threads 2 --linear-backend stock
          --draft "$draft")
    [ -n "$heads" ] && args+=(--heads "$heads")
    (cd "$dir" && PYTHONPATH=$pythonpath "$py" -m selfspec.cli generate "${args[@]}" 2>/dev/null) > "$work/$side-$draft.jsonl"
  done
done
"$py" - "$work" "${drafters[@]}" <<'PY'
import json, sys
work, specs = sys.argv[1], [s.split("|")[0] for s in sys.argv[2:]]
read = lambda side, d: [json.loads(line) for line in open(f"{work}/{side}-{d}.jsonl")]
plain, failed = read("old", "none"), 0
for d in specs:
    old, new = read("old", d), read("new", d)
    tokens = sum(o["token_ids"] == n["token_ids"] for o, n in zip(old, new))
    steps = sum(o["stats"]["steps"] == n["stats"]["steps"] for o, n in zip(old, new))
    lossless = sum(n["token_ids"] == p["token_ids"] for n, p in zip(new, plain))
    failed += (tokens, steps, lossless) != (len(old),) * 3
    print(f"{d:14s} tokens equal {tokens}/{len(old)}  steps equal {steps}/{len(old)}  equal to plain decoding "
          f"{lossless}/{len(new)}  tau {[round(n['stats']['tau'], 2) for n in new]}")
sys.exit(1 if failed else 0)
PY
