# Sourced by the one-call GPU scripts (benchmarks/*/gpu_*.sh): environment, $OUT, a clock, the device's name and the
# fused op's build. After it: el (seconds since the start), seconds_left (of ${TOTAL:-560}).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/${GPU_JOB:-gpu_job}}; mkdir -p "$OUT"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s]"; }
seconds_left() { echo $(( ${TOTAL:-560} - ($(date +%s) - T0) )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${BUILD:-1}" = 1 ]; then  # BUILD=0: variants without the fused op
  echo "== build $(el)"; timeout 150 python3 -m lightning_adaptiveload build-ops > "$OUT/build.log" 2>&1; echo "build rc=$? $(el)"
fi
