#!/usr/bin/env bash
# One GPU call (issue 17): is one image's step still host-bound? bench_step.py on the single-image shape,
# side by side: regional compile with CUDA graphs per block (run 4: 68% GPU-busy), the whole forward as one
# compiled graph with CUDA graphs (forward and backward each one replay), and the whole forward compiled
# without CUDA graphs. JSON + log in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/step_busy}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(($(date +%s) - T0)) s]"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== build $(el)"; timeout 150 python3 -m lightning_adaptiveload build-ops > "$OUT/build.log" 2>&1; echo "build rc=$? $(el)"
left=$(( ${TOTAL:-560} - ($(date +%s) - T0) ))
timeout $(( left - 5 )) python3 benchmarks/bench_step.py --out "$OUT" --shapes image --no-micro --reps 7 \
  --variants whole+cg,compile+noac+cg,whole --time-budget-s $(( left - 60 )) 2>&1 \
  | grep -v "^USDT\|^W1\|^W0" > "$OUT/busy.log"
echo "rc=$? $(el)"; tail -12 "$OUT/busy.log"
