#!/usr/bin/env bash
# One GPU call (issue 17): wan-1.3b's step speed over a planned epoch of the wan21_480p mix
# (benchmarks/model/bench_step_mix.py): the eager baseline and compile + save_attention with 10 of 30 blocks
# checkpointed at max_tokens 32,760, then (time left) the same with 20 of 30 at 65,520. JSON + logs in $OUT.
GPU_JOB=step_mix; TOTAL=${TOTAL:-570}
source "$(dirname "$0")/../_gpu_preamble.sh"
left=$(seconds_left)
timeout $(( left - 5 )) python3 benchmarks/model/bench_step_mix.py --out "$OUT" --max-tokens 32760 \
  --variants baseline,compile+sac10 --time-budget-s $(( left - 200 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/mix_32760.log"
echo "32760 rc=$? $(el)"; tail -4 "$OUT/mix_32760.log"
left=$(seconds_left)
if [ $left -gt 150 ]; then
  timeout $(( left - 5 )) python3 benchmarks/model/bench_step_mix.py --out "$OUT" --max-tokens 65520 \
    --variants compile+sac20,baseline --time-budget-s $(( left - 60 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/mix_65520.log"
  echo "65520 rc=$? $(el)"; tail -4 "$OUT/mix_65520.log"
fi
