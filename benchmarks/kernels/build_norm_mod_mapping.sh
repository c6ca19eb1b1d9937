#!/usr/bin/env bash
# Builds benchmarks/kernels/norm_mod_mapping.cu (bf16 only, no torch) with its variant kernels, the
# translation units in parallel. Usage: bash benchmarks/kernels/build_norm_mod_mapping.sh OUT_BINARY
set -euo pipefail
out=${1:-/tmp/nm_mapping}
cd "$(dirname "$0")/../.."
obj=$(mktemp -d)
flags=(-O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Icsrc -Ibenchmarks/kernels ${NVCC_EXTRA:-})
pids=()
for f in csrc/ln_modulate.cu csrc/ln_modulate_bf16.cu csrc/norm_mod_tma_bf16_ln.cu csrc/norm_mod_tma_bf16_rms.cu \
         benchmarks/kernels/norm_mod_mapping.cu; do
  nvcc "${flags[@]}" -c "$f" -o "$obj/$(basename "$f" .cu).o" & pids+=($!)
done
for k in 1 2 3 4 5; do
  nvcc "${flags[@]}" -DNMV_PART=$k -c benchmarks/kernels/norm_mod_variants.cu -o "$obj/nmv$k.o" & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
nvcc -arch=sm_90 -o "$out" "$obj"/*.o
echo "built $out"
