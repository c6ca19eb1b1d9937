#!/usr/bin/env bash
# One GPU call (issue 17): wan-1.3b's step speed over a planned epoch of the wan21_480p mix
# (benchmarks/bench_step_mix.py): the eager baseline and compile + save_attention with 10 of 30 blocks
# checkpointed at max_tokens 32,760, then (time left) the same with 20 of 30 at 65,520. JSON + logs in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/step_mix}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(($(date +%s) - T0)) s]"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== build $(el)"; timeout 150 python3 -m lightning_adaptiveload build-ops > "$OUT/build.log" 2>&1; echo "build rc=$? $(el)"
left=$(( ${TOTAL:-570} - ($(date +%s) - T0) ))
timeout $(( left - 5 )) python3 benchmarks/bench_step_mix.py --out "$OUT" --max-tokens 32760 \
  --variants baseline,compile+sac10 --time-budget-s $(( left - 200 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/mix_32760.log"
echo "32760 rc=$? $(el)"; tail -4 "$OUT/mix_32760.log"
left=$(( ${TOTAL:-570} - ($(date +%s) - T0) ))
if [ $left -gt 150 ]; then
  timeout $(( left - 5 )) python3 benchmarks/bench_step_mix.py --out "$OUT" --max-tokens 65520 \
    --variants compile+sac20,baseline --time-budget-s $(( left - 60 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/mix_65520.log"
  echo "65520 rc=$? $(el)"; tail -4 "$OUT/mix_65520.log"
fi
