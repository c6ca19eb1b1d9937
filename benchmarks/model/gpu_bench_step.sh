#!/usr/bin/env bash
# One device call on a single H100: every lever of the training step side by side (benchmarks/model/bench_step.py).
# Usage (device tool, from a copy of the tree; wheels for diffusers in ./.whl or ../.whl):
#   bash benchmarks/model/gpu_bench_step.sh            # writes $OUT/bench_step_*.json and $OUT/bench_step.log
# About 9 minutes: the fused op builds in the background while diffusers' unfused baseline runs. The compiled,
# checkpointed variants need a first step of a minute or more per batch-size class: give them their own call,
# e.g. VARIANTS=bf16w+compile+sac,compile+sac BUDGET=500 bash benchmarks/model/gpu_bench_step.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
WHL=.whl; [ -d "$WHL" ] || WHL=../.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" "$WHL"/*.whl \
  && export PYTHONPATH="$HOME/site:$PWD" || exit 1
OUT=${OUT:-/tmp/bench_step}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'diffusers', diffusers.__version__)"
(t0=$(date +%s); python3 -m lightning_adaptiveload build-ops > "$OUT/build.log" 2>&1; echo "build took $(( $(date +%s) - t0 )) s" >> "$OUT/build.log") &
SKIP="diffusers:tok65k,diffusers:tok131k,baseline:tok131k,bf16w:tok65k,bf16w:tok131k,bf16w+compile+noac:tok131k"
SKIP="$SKIP,diffusers+fused:tok65k,diffusers+fused:tok131k,diffusers+fused+compile:tok65k,diffusers+fused+compile:tok131k"
SKIP="$SKIP,bf16w+compile:tok65k,bf16w+compile:tok131k,flash:images,flash:image,flash:tok65k,flash:tok131k"
timeout ${BENCH_TIMEOUT:-570} python3 benchmarks/model/bench_step.py --out "$OUT" --time-budget-s ${BUDGET:-500} \
  --variants ${VARIANTS:-diffusers,baseline,bf16w+compile+sac,bf16w,bf16w+compile+noac,diffusers+fused,diffusers+fused+compile,bf16w+compile,flash} \
  --skip "$SKIP" 2>&1 | grep -v "^USDT" | tee "$OUT/bench_step.log"
cat "$OUT/build.log" | tail -3
