#!/usr/bin/env bash
# One device call (issue 59, 2026-12-03 third pass, forward): the standalone forward benchmark
# (norm_mod_mapping --fwd: the library's forward kernels at 2-4 stages), twice, from a binary built beforehand
# (NM_BIN, else built here); optionally (LIB=1) the torch library build and the CUDA tests of tests/ops.
# Output under $OUT (a tarball of logs and the tables). The bulk-store variants of that pass (not kept) come
# back with `git apply benchmarks/results/norm_mod_mapping_nvidia-h200_2026-12-03_s34_bulkstore.patch`.
#   OUT=/tmp/out [NM_BIN=.nmbin/nm_mapping] [RUNS=2] [LIB=0] bash benchmarks/kernels/gpu_norm_mod_s34.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/logs"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s]"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  > "$OUT/logs/env.txt" 2>&1
cat "$OUT/logs/env.txt"
bin=${NM_BIN:-}
if [ -z "$bin" ] || [ ! -x "$bin" ]; then
  bash benchmarks/kernels/build_norm_mod_mapping.sh /tmp/nm_mapping > "$OUT/logs/mapping_build.log" 2>&1 || tail -30 "$OUT/logs/mapping_build.log"
  bin=/tmp/nm_mapping
fi
for r in $(seq 1 "${RUNS:-2}"); do
  timeout 200 "$bin" --fwd ${NM_ARGS:-} > "$OUT/nm_mapping_run$r.txt" 2>&1
  echo "mapping run $r rc=$? $(el)"
done
if [ "${LIB:-0}" = 1 ]; then
  LIGHTNING_ADAPTIVELOAD_CACHE=/tmp/la_new timeout 330 python3 -m lightning_adaptiveload build-ops > "$OUT/logs/build_new.log" 2>&1
  echo "build rc=$? $(el)"; grep -B2 -A10 " error" "$OUT/logs/build_new.log" | head -40
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 8"
  LIGHTNING_ADAPTIVELOAD_CACHE=/tmp/la_new timeout 200 python3 -m pytest -m cuda -q -p no:cacheprovider $XD --timeout 150 \
    tests/ops > "$OUT/logs/pytest_cuda_ops.log" 2>&1
  echo "pytest rc=$? $(el)"; grep -E "passed|failed|error" "$OUT/logs/pytest_cuda_ops.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/logs/pytest_cuda_ops.log" | head -20
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
# The short table: every forward line, name, time and % of copy.
grep -h -E " (copy|ln fwd|rms fwd) " "$OUT/nm_mapping_run1.txt" | sed -E 's/; plan.*//' | cut -c1-110
echo "done $(el)"
