#!/usr/bin/env bash
# One GPU call (issue 36, item 2): wan-1.3b's step speed over the packed epoch of the wan21_480p mix at
# max_tokens 32,760 (benchmarks/model/bench_step_mix.py --schedule packed: the 16 most frequent packs of rank 0
# timed, the rest priced by the pack model fitted to them), eager baseline and compiled with bf16 weights,
# then, with the time left, the bucketed (lockstep) epoch of the same mix with the same variants, in the
# same call. Ready, not yet run. JSON + logs in $OUT.
GPU_JOB=step_mix_packed; TOTAL=${TOTAL:-570}
source "$(dirname "$0")/../_gpu_preamble.sh"
VARIANTS=${VARIANTS:-baseline,compile+smm26+nofuse+bf16w}
left=$(seconds_left)
timeout $(( left - 5 )) python3 benchmarks/model/bench_step_mix.py --schedule packed --out "$OUT" --max-tokens 32760 \
  --variants "$VARIANTS" --time-budget-s $(( left - 250 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/mix_packed.log"
echo "packed rc=$? $(el)"; tail -4 "$OUT/mix_packed.log"
left=$(seconds_left)
if [ $left -gt 150 ]; then
  timeout $(( left - 5 )) python3 benchmarks/model/bench_step_mix.py --out "$OUT" --max-tokens 32760 \
    --variants "$VARIANTS" --time-budget-s $(( left - 60 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/mix_lockstep.log"
  echo "lockstep rc=$? $(el)"; tail -4 "$OUT/mix_lockstep.log"
fi
