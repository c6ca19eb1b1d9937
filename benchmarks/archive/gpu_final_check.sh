#!/usr/bin/env bash
# One device call after a round of merges: build the fused op, run every CUDA test, check packed steps on the
# GPU (benchmarks/checks/packed_cuda_check.py), then the compiled, attention-saving checkpointed step variants of
# benchmarks/model/bench_step.py. Logs and JSON land in $OUT. Run from the repository root with .whl carried.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/final_check}; mkdir -p "$OUT"
T0=$(date +%s); el() { echo "[$(($(date +%s) - T0)) s]"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
  && export PYTHONPATH="$HOME/site:$PWD" || exit 1
echo "== build $(el)"; timeout 150 python3 -m lightning_adaptiveload build-ops > "$OUT/build.log" 2>&1; echo "build rc=$? $(el)"
tail -2 "$OUT/build.log"
if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== CUDA tests $(el)"
  timeout 170 python3 -m pytest -m cuda -q -p no:cacheprovider tests/ > "$OUT/pytest_cuda.log" 2>&1; echo "pytest rc=$? $(el)"
  tail -4 "$OUT/pytest_cuda.log"
fi
echo "== packed on CUDA $(el)"
timeout 90 python3 benchmarks/checks/packed_cuda_check.py --out "$OUT" > "$OUT/packed.log" 2>&1; echo "packed rc=$? $(el)"
tail -40 "$OUT/packed.log"
echo "== step variants $(el)"
left=$(( ${TOTAL:-540} - ($(date +%s) - T0) - 15 ))
timeout $left python3 benchmarks/model/bench_step.py --out "$OUT" --time-budget-s $(( left - 20 )) --no-micro \
  --variants ${VARIANTS:-compile+sac,baseline} --shapes ${SHAPES:-images,clip} 2>&1 | grep -v "^USDT" > "$OUT/bench_step.log"
echo "bench rc=$? $(el)"; tail -25 "$OUT/bench_step.log"
