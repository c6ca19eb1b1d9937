#!/usr/bin/env bash
# One GPU call (issue 17): wan-1.3b over a planned epoch of the wan21_480p mix (bench_step_mix.py) with the
# checkpointed-block count chosen per batch (compile+sac_auto: a memory model probed on three batches, a
# budget of CKPT_BUDGET x the GPU's memory) beside the fixed 15 of 30 (run 5's best) and the eager baseline,
# in one process. MODE=busy instead times one image's step: the whole forward compiled with each block a
# nested compile region and CUDA graphs, beside CUDA graphs per block (MODE=busy+mix: both). JSON + logs in $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/step_auto}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(($(date +%s) - T0)) s]"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
echo "== build $(el)"; timeout 150 python3 -m lightning_adaptiveload build-ops > "$OUT/build.log" 2>&1; echo "build rc=$? $(el)"
left=$(( ${TOTAL:-560} - ($(date +%s) - T0) ))
if [[ "${MODE:-mix}" == *busy* ]]; then
  timeout "${BUSY_S:-220}" python3 benchmarks/bench_step.py --out "$OUT" --shapes image --no-micro --reps 7 \
    --variants whole+nested+cg,compile+noac+cg --time-budget-s $(( ${BUSY_S:-220} - 40 )) 2>&1 \
    | grep -v "^USDT\|^W1\|^W0" > "$OUT/busy.log"
  echo "busy rc=$? $(el)"; tail -12 "$OUT/busy.log"
  left=$(( ${TOTAL:-560} - ($(date +%s) - T0) ))
fi
[[ "${MODE:-mix}" == *mix* ]] || exit 0
timeout $(( left - 5 )) python3 benchmarks/bench_step_mix.py --out "$OUT" --max-tokens "${MAX_TOKENS:-32760}" \
  --ckpt-budget "${CKPT_BUDGET:-0.88}" --variants "${VARIANTS:-compile+sac_auto,baseline,compile+sac15}" \
  --time-budget-s $(( left - 90 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/mix.log"
echo "mix rc=$? $(el)"; tail -6 "$OUT/mix.log"
