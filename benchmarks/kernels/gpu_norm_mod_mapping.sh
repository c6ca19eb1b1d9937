#!/usr/bin/env bash
# Device script: builds norm_mod_mapping (with its variant kernels) and runs it; output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/nvsmi.txt"
time bash benchmarks/kernels/build_norm_mod_mapping.sh /tmp/nm_mapping 2>&1 | grep -v "Wno-" | tail -20
cuobjdump -res-usage /tmp/nm_mapping 2>/dev/null | grep -A1 "nm_fwd_tma_kernel\|nm_bwd_tma_kernel\|var_fwd" > "$OUT/res_usage.txt" || true
/tmp/nm_mapping "$@" 2>&1 | tee "$OUT/nm_mapping.txt"
