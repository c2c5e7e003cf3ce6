#!/usr/bin/env bash
# One lent GPU call that makes the feature drafter's data and trains on it: SmolLM2 answers a prompt pool on the GPU
# (thousands of prompts a minute, where a 2-core CPU answers one every 1-3 s), then the committed drafter trains on
# those answers plus the corpora given, and the result, its metrics and a CUDA lossless check come back in $OUT.
#
# Prepare on the CPU machine (the device machine reaches nothing outside itself):
#   python scripts/build_broad_prompts.py --wheels /tmp/whl --answers ../shared/data/distill-smollm2-v1 \
#       --out runs/distill-broad/prompts.jsonl
#   python scripts/build_prompt_pool.py --wheels /tmp/whl --exclude ../shared/data/distill-smollm2-v1 \
#       --exclude ../shared/data/mt_bench.jsonl --include ../shared/data/distill-smollm2-v1/prompts.jsonl \
#       --include runs/distill-broad/prompts.jsonl --out runs/gpu/prompt-pool.jsonl      # 15,040 prompts, 4.3 MB
#   cp -r ../shared/data/distill-smollm2-v1 runs/gpu/                                     # 9.5 MB
# then stage the GGUF as scripts/gpu_train_eagle.sh does (/tmp/stage on the device, parts carried in earlier calls),
# or point MODEL at a model the device has, and run, carrying runs/gpu:
#   run(command="OUT=$OUT bash scripts/gpu_distill_train_eagle.sh", carry=["runs/gpu"], timeout_s=600)
#
# Knobs (environment): MODEL (default: the staged GGUF), DEVICE (cuda), DISTILL_MINUTES (3.5: no new shard after
# it), TRAIN_MINUTES (4.5: the recipe checkpoints, evaluates and saves), BATCH (512 prompts at once), DATA (the
# corpora trained on besides the new answers), PYTHON (python3). Every other argument goes to the recipe (key=value overrides).
# On a CPU it runs too, for a dry run of the whole path:
#   PYTHON=.venv/bin/python MODEL=smollm2-135m-instruct DEVICE=cpu DISTILL_MINUTES=0.1 TRAIN_MINUTES=1 BATCH=4 POOL_LIMIT=8 OUT=/tmp/o \
#       bash scripts/gpu_distill_train_eagle.sh optim.max_steps=2 optim.batch_size=2 data.eval_samples=4
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
if [ -z "${MODEL:-}" ]; then
  MODEL=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
  [ -f "$MODEL" ] || cat /tmp/stage/gg.* .gpu/p3/gg.* | xz -d > "$MODEL"
fi
if [ -n "${POOL_LIMIT:-}" ]; then head -n "$POOL_LIMIT" "$POOL" > /tmp/pool.jsonl; POOL=/tmp/pool.jsonl; fi
[ "$DEVICE" = cuda ] && nvidia-smi -L
mkdir -p "$OUT" runs/gpu/answers
start=$(date +%s)
"$PY" scripts/self_distill.py --model "$MODEL" --device "$DEVICE" --prompts "$POOL" --out runs/gpu/answers \
    --batch-size "$BATCH" --shard-size $((BATCH * 2)) --max-new-tokens 256 --max-minutes "$DISTILL_MINUTES" \
    2>&1 | tr '\r' '\n' | grep -v -E "Loading weights|prompt/s\]$" | tail -n 5
echo "distilled in $(( $(date +%s) - start )) s: $(cat runs/gpu/answers/shard-*.jsonl | wc -l) conversations"
"$PY" -m eagle.recipe --config configs/eagle/smollm2-135m.yaml model="$MODEL" output_dir=/tmp/run \
    heads_dir=/tmp/heads num_threads=null init_from=heads/smollm2-135m-instruct-eagle3 draft.draft_vocab_size=12288 \
    "data.source=[$DATA,runs/gpu/answers]" ttt_steps=7 optim.batch_size=32 optim.epochs=3 optim.lr=0.001 \
    optim.warmup_steps=20 optim.max_minutes="$TRAIN_MINUTES" logging.save_every=null logging.log_every=50 \
    data.eval_samples=64 "$@" 2>&1 | tr '\r' '\n' | grep -v -E "Loading weights|it/s\]$" | tail -n 40 || true
cp /tmp/run/metrics.jsonl "$OUT/" || true
split -b 15000000 /tmp/heads/model.safetensors "$OUT/model.part." || true
cp /tmp/heads/config.json /tmp/heads/README.md /tmp/heads/.selfspec-complete "$OUT/" 2>/dev/null || true
echo "done in $(( $(date +%s) - start )) s"
