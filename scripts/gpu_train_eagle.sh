#!/usr/bin/env bash
# Train the EAGLE-3 drafter for SmolLM2 on a lent GPU (one H200), from wheels, data and the GGUF staged in /tmp by
# earlier calls (see docs/RESULTS.md, "GPU training"); copies the drafter to $OUT in <16 MB parts.
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD
cat /tmp/stage/gg.* .gpu/p3/gg.* | xz -d > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p runs && tar -C runs -xJf /tmp/stage/distill.tar.xz
nvidia-smi -L
python3 -m eagle.recipe --config configs/eagle/smollm2-135m.yaml model=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf \
    output_dir=/tmp/run heads_dir=/tmp/heads num_threads=null ttt_steps=7 optim.batch_size=32 optim.epochs=2 \
    optim.lr=0.0015 optim.max_minutes=5.5 logging.save_every=null logging.log_every=20 data.eval_samples=64 "$@" \
    2>&1 | tr '\r' '\n' | grep -v -E "Loading weights|it/s\]$" | tail -n 60 || true
cp /tmp/run/metrics.jsonl "$OUT/" || true
split -b 15000000 /tmp/heads/model.safetensors "$OUT/model.part." || true
cp /tmp/heads/config.json /tmp/heads/README.md /tmp/heads/.selfspec-complete "$OUT/" || true
python3 - <<'PY'
import torch
from selfspec.runtime.tiny import tiny_model
from selfspec.testing import eagle_draft, greedy_reference, random_prompt
from eagle.drafter import EagleDrafter, EaglePolicy
from decoding.generate import generate
ok = 0
for arch in ("llama", "qwen3"):
    m = tiny_model(arch).cuda()
    d = eagle_draft(m, draft_vocab_size=60).cuda(); d.refresh_shared()
    for pol in (EaglePolicy(), EaglePolicy(tree=((0,), (1,), (0, 0), (0, 0, 0)))):
        for n in (3, 17):
            ids = random_prompt(n, seed=n).cuda()
            ok += torch.equal(generate(m, EagleDrafter(m, d, pol), ids, max_new_tokens=30).sequences,
                              greedy_reference(m, ids, 30))
print(f"CUDA eagle lossless: {ok}/8 equal to generate")
PY
