#!/usr/bin/env bash
# One GPU call (issue 17): wan-1.3b over a planned epoch of the wan21_480p mix (bench_step_mix.py) with the
# checkpointed-block count chosen per batch (a memory model probed on three batches, a budget of CKPT_BUDGET x
# the GPU's memory; default variants compile+smm_auto and the eager baseline, in one process; VARIANTS= picks
# others, e.g. compile+sac_auto, compile+sac15). MODE=busy instead times one image's step: the whole forward
# compiled with each block a nested compile region and CUDA graphs, beside CUDA graphs per block
# (MODE=busy+mix: both). MODE=profile profiles one clip's step per variant (PVARIANTS).
# JSON + logs in $OUT. docs/lab_notebook.md, runs 7 and 8.
GPU_JOB=step_auto; TOTAL=${TOTAL:-560}
source "$(dirname "$0")/../_gpu_preamble.sh"
left=$(seconds_left)
if [[ "${MODE:-mix}" == *busy* ]]; then
  timeout "${BUSY_S:-220}" python3 benchmarks/model/bench_step.py --out "$OUT" --shapes image --no-micro --reps 7 \
    --variants whole+nested+cg,compile+noac+cg --time-budget-s $(( ${BUSY_S:-220} - 40 )) 2>&1 \
    | grep -v "^USDT\|^W1\|^W0" > "$OUT/busy.log"
  echo "busy rc=$? $(el)"; tail -12 "$OUT/busy.log"
  left=$(seconds_left)
fi
if [[ "${MODE:-mix}" == *profile* ]]; then  # one clip, profiled: kernel time by category, per variant
  timeout $(( left - 10 )) python3 benchmarks/model/bench_step.py --out "$OUT" --shapes clip --profile clip --no-micro \
    --reps 3 --variants "${PVARIANTS:-compile+smm26,compile+smm26+nofuse,compile+smm26+cdt}" \
    --time-budget-s $(( left - 60 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/profile.log"
  echo "profile rc=$? $(el)"; grep -v "^\s*$" "$OUT/profile.log" | tail -60
  left=$(seconds_left)
fi
if [[ "${MODE:-mix}" == *autotune* ]]; then  # one clip: inductor's matmul autotuning on the compiled blocks
  timeout $(( left - 10 )) python3 benchmarks/model/bench_step.py --out "$OUT" --shapes clip --no-micro --reps 3 \
    --variants compile+smm26,compile+smm26+autotune --time-budget-s $(( left - 60 )) 2>&1 \
    | grep -v "^USDT\|^W1\|^W0" > "$OUT/autotune.log"
  echo "autotune rc=$? $(el)"; tail -8 "$OUT/autotune.log"
  left=$(seconds_left)
fi
[[ "${MODE:-mix}" == *mix* ]] || exit 0
timeout $(( left - 5 )) python3 benchmarks/model/bench_step_mix.py --out "$OUT" --max-tokens "${MAX_TOKENS:-32760}" \
  ${CKPT_BUDGET:+--ckpt-budget "$CKPT_BUDGET"} --variants "${VARIANTS:-compile+smm_auto,baseline}" \
  --time-budget-s $(( left - 90 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/mix.log"
echo "mix rc=$? $(el)"; tail -6 "$OUT/mix.log"
