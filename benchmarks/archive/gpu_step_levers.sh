#!/usr/bin/env bash
# One GPU call (issue 17): the step levers side by side in one run on wan-1.3b: eager baseline, compile with
# attention saved in the checkpoint (all blocks, 20 and 10 of 30 checkpointed), CUDA graphs per block for the
# host-bound single image, and diffusers' Wan 1.3B (eager, and with our fused op + compile) on the same clip.
# At one clip (32,760 tokens) and at the calibrated max_tokens (131,040: four clips). Results JSON in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/step_levers}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(($(date +%s) - T0)) s]"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
  && export PYTHONPATH="$HOME/site:$PWD" || exit 1
echo "== build $(el)"; timeout 150 python3 -m lightning_adaptiveload build-ops > "$OUT/build.log" 2>&1; echo "build rc=$? $(el)"
V=compile+sac,baseline,diffusers,diffusers+fused+compile,compile+sac20,compile+sac10,compile+noac+cg
SKIP=compile+sac:image,baseline:image,compile+sac20:tok131k,compile+sac20:image,compile+sac10:tok131k
SKIP=$SKIP,compile+sac10:image,diffusers:tok131k,diffusers:image,diffusers+fused+compile:tok131k
SKIP=$SKIP,diffusers+fused+compile:image,compile+noac+cg:clip,compile+noac+cg:tok131k
left=$(( ${TOTAL:-560} - ($(date +%s) - T0) - 10 ))
timeout $left python3 benchmarks/model/bench_step.py --out "$OUT" --time-budget-s $(( left - 30 )) --no-micro \
  --variants $V --shapes clip,tok131k,image --skip $SKIP 2>&1 | grep -v "^USDT" > "$OUT/bench_step.log"
echo "bench rc=$? $(el)"; tail -32 "$OUT/bench_step.log"
