#!/usr/bin/env bash
# One device call on one H100 (under 4 minutes): `calibrate` wan-1.3b with the designed pack measurements
# (single samples + packs at max_tokens through the packed forward), fit c0 + alpha*S + beta*S^2, report
# every point's relative error; then the schedule table (CPU simulation) planned and replayed with the
# calibrated model. Writes under $OUT:
#   calib_packs_wan13b.yaml          the recipe fragment (max_tokens, max_compute, cost_model with c0)
#   calib_packs_wan13b_results.yaml  every point: shapes, seconds, model prediction, relative error
#   calibrate.log, schedule_table_calibrated.{json,md}
# Usage (device tool, from the repository root with .whl carried):  bash benchmarks/balance/gpu_calibrate_packs.sh
# The memory search is skipped: MAX_TOKENS (default 131040) is the budget calibrated on the H100 on
# 2026-11-23 (benchmarks/results/calib_wan13b_h100_2026-11-23.yaml). A CPU dry run of the script:
#   PRESET=tiny MIX=tiny MAX_TOKENS=900 DEVICE=cpu PRECISION=32-true TEXT_LEN=16 OUT=/tmp/cal \
#     bash benchmarks/balance/gpu_calibrate_packs.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/calibrate_packs}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(($(date +%s) - T0)) s]"; }
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
    && export PYTHONPATH="$HOME/site:$PWD" || exit 1
else
  export PYTHONPATH="$PWD"
fi
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
echo "== calibrate with packs $(el)"
DEVICE_ARGS=(); [ -n "${DEVICE:-}" ] && DEVICE_ARGS=(--device "$DEVICE")
[ -n "${PRECISION:-}" ] && DEVICE_ARGS+=(--precision "$PRECISION")
# 3 single samples (shortest, middle, longest shape) and 7 designed packs; warm-up 1, median of 2: about
# 2.5 minutes on an H100 with activation checkpointing, as the recipe trains.
timeout ${CAL_TIMEOUT:-225} python3 -m lightning_adaptiveload calibrate --recipe recipes/wan13b_480p_dual.yaml \
  --preset "${PRESET:-wan-1.3b}" --mix "${MIX:-wan21_480p}" --max-tokens "${MAX_TOKENS:-131040}" \
  --text-len "${TEXT_LEN:-256}" --num-shapes 3 --warmup 1 --repeats "${REPEATS:-2}" --packs --no-progress \
  "${DEVICE_ARGS[@]}" --out "$OUT/calib_packs_wan13b.yaml" --results "$OUT/calib_packs_wan13b_results.yaml" \
  > "$OUT/calibrate.log" 2>&1
echo "calibrate rc=$? $(el)"
grep -E "^# (device|software|timing|   |cost model)|^#   |wrote|error" "$OUT/calibrate.log" "$OUT/calib_packs_wan13b.yaml" | tail -40
if [ -s "$OUT/calib_packs_wan13b.yaml" ]; then
  echo "== schedule table with the calibrated model (CPU simulation) $(el)"
  timeout 60 python3 benchmarks/balance/schedule_table.py --cost-model "$OUT/calib_packs_wan13b.yaml" \
    --out "$OUT/schedule_table_calibrated.json" > "$OUT/schedule_table_calibrated.md" 2> "$OUT/schedule_table.log"
  echo "table rc=$? $(el)"; cat "$OUT/schedule_table_calibrated.md"
fi
ls -la "$OUT"
