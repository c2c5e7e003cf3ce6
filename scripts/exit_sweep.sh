#!/usr/bin/env bash
# The table that decides the exit layer E (issue #19): train the Kangaroo classifier
# (configs/early_exit/smollm2-135m-kangaroo.yaml) at each E, sharing one pass of the base over the data, then
# benchmark them side by side against plain greedy `generate`, hf-pld and HF's own early exit.
#
#   bash scripts/exit_sweep.sh                       # E in 2 3 4 6 8 12, 5 minutes of training each
#   LAYERS="2 4" MINUTES=10 bash scripts/exit_sweep.sh optim.lr=0.001   # extra args: recipe overrides
#
# Environment: LAYERS, MINUTES (training budget per layer: the recipe then saves its classifier; a killed run
# resumes from its last checkpoint when the script is rerun), OUT (runs/sweep), PROMPTS (held-out prompts: MT-bench
# 41-80, see docs/RESULTS.md), LIMIT, NEW_TOKENS, HF_EXIT (exit layer of the hf-early-exit baseline), PYTHON,
# SELFSPEC (the CLI).
set -euo pipefail
LAYERS=${LAYERS:-"2 3 4 6 8 12"}
MINUTES=${MINUTES:-5}
OUT=${OUT:-runs/sweep}
PROMPTS=${PROMPTS:-runs/mt_test.jsonl}
LIMIT=${LIMIT:-8}
NEW_TOKENS=${NEW_TOKENS:-128}
HF_EXIT=${HF_EXIT:-24}
PYTHON=${PYTHON:-python}
SELFSPEC=${SELFSPEC:-selfspec}
CONFIG=configs/early_exit/smollm2-135m-kangaroo.yaml

methods="vanilla,hf-pld,hf-early-exit:${HF_EXIT}"
for E in $LAYERS; do
  run="$OUT/e$E"
  if [ ! -f "$run/heads/config.json" ]; then
    resume=()
    if compgen -G "$run/checkpoints/*" > /dev/null; then resume=(--resume); fi
    "$PYTHON" train/early_exit.py --config "$CONFIG" "${resume[@]}" classifier.exit_layer="$E" \
      "hidden_cache_layers=[${LAYERS// /,}]" \
      output_dir="$run" optim.max_minutes="$MINUTES" "$@"
  fi
  methods="$methods,early-exit:$run/heads"
done
"$SELFSPEC" bench --prompts "$PROMPTS" --limit "$LIMIT" --max-new-tokens "$NEW_TOKENS" \
  --methods "$methods" --out "$OUT/bench"
