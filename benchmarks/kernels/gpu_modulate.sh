#!/usr/bin/env bash
# One call on the GPU machine for the fused LayerNorm-Modulate op (issue 3): build the CUDA extension, run
# the CUDA tests, benchmark against eager and torch.compile, profile the kernels once. Everything lands in
# $OUT (JSON, logs); a short table is printed last. Run from the repository root:
#   OUT=/tmp/out bash benchmarks/kernels/gpu_modulate.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/modulate_out}
mkdir -p "$OUT"
export LIGHTNING_ADAPTIVELOAD_CACHE=${LIGHTNING_ADAPTIVELOAD_CACHE:-/tmp/la_cache}

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"

echo "== build"
t0=$(date +%s)
timeout 200 python3 -m lightning_adaptiveload build-ops --verbose > "$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc in $(( $(date +%s) - t0 )) s"
if [ $rc -ne 0 ]; then grep -iE "error|warning" "$OUT/build.log" | head -40; tail -30 "$OUT/build.log"; exit 1; fi
so=$(ls "$LIGHTNING_ADAPTIVELOAD_CACHE"/torch_extensions/*/*.so | head -1)
cuobjdump -res-usage "$so" > "$OUT/resource_usage.txt" 2>&1; grep -c "REG:" "$OUT/resource_usage.txt"

echo "== CUDA tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider --timeout 90 tests/ops/test_ops_cuda.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20

echo "== benchmark"
timeout 240 python3 benchmarks/kernels/bench_modulate.py --out "$OUT/modulate_h100.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"

echo "== ncu (one forward and backward per shape, shapes 0,1)"
timeout 60 ncu --clock-control none -k regex:'ln_mod_(fwd|bwd|colsum)' --launch-count 6 \
  --section SpeedOfLight --section Occupancy --section LaunchStats \
  python3 benchmarks/kernels/bench_modulate.py --profile-once --shapes 0,1 > "$OUT/ncu.log" 2>&1
echo "ncu rc=$?"
grep -E "ln_mod_|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size" \
  "$OUT/ncu.log" | sed -E 's/ +/ /g' | cut -c1-150 | head -60

echo "== results"
grep -E "sweep" "$OUT/bench.log" | cut -c1-160
tail -12 "$OUT/bench.log"
