#!/usr/bin/env bash
# One device call (issue 59, third and fourth passes, forward): the standalone forward benchmark
# (norm_mod_mapping --fwd: the library's forward kernels at 2-4 stages, a copy by the SMs beside
# cudaMemcpyAsync) from one or more binaries built beforehand (NM_BINS, space-separated; else one built
# here), RUNS rounds with the binaries interleaved (order reversed every other round); optionally (LIB=1) the
# torch library build, the CUDA tests and the limit benchmark (gpu_norm_mod_s33.sh without its standalone
# run and accuracy check, output under $OUT/lib). A binary without the streaming stores (the switch in
# csrc/ln_modulate_kernels.cuh): NVCC_EXTRA="-DADAPTIVELOAD_NM_CS=0" bash build_norm_mod_mapping.sh BIN.
# The bulk-store variants of the third pass (not kept) come back with
# `git apply benchmarks/results/norm_mod_mapping_nvidia-h200_2026-12-03_s34_bulkstore.patch`.
#   OUT=/tmp/out [NM_BINS=".nmbin/a .nmbin/b"] [NM_ARGS=--fwd (--lib: forward and backward)] [RUNS=2] [LIB=0] bash benchmarks/kernels/gpu_norm_mod_s34.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/logs"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s]"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv \
  > "$OUT/logs/env.txt" 2>&1
cat "$OUT/logs/env.txt"
bins=${NM_BINS:-}
if [ -z "$bins" ]; then
  bash benchmarks/kernels/build_norm_mod_mapping.sh /tmp/nm_mapping > "$OUT/logs/mapping_build.log" 2>&1 || tail -30 "$OUT/logs/mapping_build.log"
  bins=/tmp/nm_mapping
fi
read -r -a order <<< "$bins"
for r in $(seq 1 "${RUNS:-2}"); do
  for b in "${order[@]}"; do
    name=$(basename "$b")
    timeout "${RUN_TIMEOUT:-200}" "$b" ${NM_ARGS:---fwd} > "$OUT/logs/${name}_run$r.txt" 2>&1
    echo "$name run $r rc=$? $(el)"
  done
  order=($(printf '%s\n' "${order[@]}" | tac))
done
# The short table: every forward line, name, time and % of copy, per binary and round.
for f in "$OUT"/logs/*_run*.txt; do
  echo "== $(basename "$f")"
  grep -h -E " (copy|ln fwd|rms fwd|ln bwd|rms bwd) " "$f" | sed -E 's/; plan.*//' | cut -c1-110
done > "$OUT/forward_table.txt"
cat "$OUT/forward_table.txt"
if [ "${LIB:-0}" = 1 ]; then
  OUT=$OUT/lib MAPPING=0 ACC=0 bash benchmarks/kernels/gpu_norm_mod_s33.sh
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "done $(el)"
