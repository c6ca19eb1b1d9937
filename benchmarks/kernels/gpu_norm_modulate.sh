#!/usr/bin/env bash
# One device call for the fused norm-modulate ops (issue 59): build the CUDA library, run the CUDA tests of
# tests/ops while the references are compiled (batch 1 and 8) and checked against eager, then the limit
# benchmark (kernel time and the Python view beside a device copy, host overhead, the launch sweep).
# Everything lands in $OUT (eight files: logs and JSON); a short table is printed last. From the repository root:
#   OUT=/tmp/out bash benchmarks/kernels/gpu_norm_modulate.sh [--sweep]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
OUT=${OUT:-/tmp/norm_modulate_out}
mkdir -p "$OUT"
export LIGHTNING_ADAPTIVELOAD_CACHE=${LIGHTNING_ADAPTIVELOAD_CACHE:-/tmp/la_cache}
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s]"; }
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  nvcc --version | tail -1
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== build $(el)"
timeout 240 python3 -m lightning_adaptiveload build-ops --verbose > "$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc $(el)"
grep -E "warning|error" "$OUT/build.log" | grep -v "Wc++20\|deprecated" | head -20
if [ $rc -ne 0 ]; then grep -B2 -A12 "error" "$OUT/build.log" | head -80; exit 1; fi
so=$(ls "$LIGHTNING_ADAPTIVELOAD_CACHE"/torch_extensions/*/*.so | head -1)
cuobjdump -res-usage "$so" 2>&1 | grep -A1 "nm_\(fwd\|bwd\)_tma" | grep -E "Function|REG" | paste - - \
  | sed -E 's/.*Function (_Z[^:]*):.*REG:([0-9]+) STACK:([0-9]+) SHARED:([0-9]+) LOCAL:([0-9]+).*/\2 regs \3 stack \5 local \1/' \
  > "$OUT/resource_usage.txt"
wc -l < "$OUT/resource_usage.txt"

echo "== CUDA tests of tests/ops, and the compiled references, side by side $(el)"
LIGHTNING_ADAPTIVELOAD_FUSED=0 timeout 240 python3 benchmarks/kernels/bench_norm_modulate_limit.py --compile-check-only \
  --out "$OUT/compile_check.json" > "$OUT/compile_check.log" 2>&1 &
CPID=$!
XD=""
python3 -c "import xdist" 2>/dev/null && XD="-n 8"
timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider $XD --timeout 200 --durations=12 ${PYTEST_ARGS:-tests/ops} > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? $(el)"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30
grep -A13 "slowest" "$OUT/pytest.log" | cut -c1-150
wait $CPID
echo "compile check rc=$? $(el)"
grep "^compile" "$OUT/compile_check.log" | cut -c1-400

echo "== limit benchmark $(el)"
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/kernels/bench_norm_modulate_limit.py --out "$OUT/bench.json" "$@" > "$OUT/bench.log" 2>&1
echo "bench rc=$? $(el)"
grep -v "^sweep\|^row\|^host" "$OUT/bench.log" | tail -40
