#!/usr/bin/env bash
# One GPU call (issue 17): is one image's step still host-bound? bench_step.py on the single-image shape,
# side by side: regional compile with CUDA graphs per block (run 4: 68% GPU-busy), the whole forward as one
# compiled graph with CUDA graphs (forward and backward each one replay), and the whole forward compiled
# without CUDA graphs. JSON + log in $OUT.
GPU_JOB=step_busy; TOTAL=${TOTAL:-560}
source "$(dirname "$0")/../_gpu_preamble.sh"
left=$(seconds_left)
timeout $(( left - 5 )) python3 benchmarks/model/bench_step.py --out "$OUT" --shapes image --no-micro --reps 7 \
  --variants whole+cg,compile+noac+cg,whole --time-budget-s $(( left - 60 )) 2>&1 \
  | grep -v "^USDT\|^W1\|^W0" > "$OUT/busy.log"
echo "rc=$? $(el)"; tail -12 "$OUT/busy.log"
