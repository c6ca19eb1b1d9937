#!/usr/bin/env bash
# Version 4 of the fused LayerNorm-Modulate forward (issue 3) in one device call of at most 300 s: build the
# CUDA extension, run the CUDA tests, compare the forward kernels side by side on the five shapes
# (bench_modulate.py --paths: version 3, version 4, launch variants), then the full benchmark (eager,
# torch.compile, ours; no sweep) with the time left, and an ncu look at the forward if time still remains.
# Every step has its own timeout and the benchmark's is what is left of 285 s. Results and logs land in
# $OUT; a short summary is printed. Run from the repository root:
#   OUT=/tmp/out bash benchmarks/archive/gpu_modulate_v4.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/modulate_out}
mkdir -p "$OUT"
export LIGHTNING_ADAPTIVELOAD_CACHE=${LIGHTNING_ADAPTIVELOAD_CACHE:-/tmp/la_cache}
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s]"; }
left() { echo $((285 - ($(date +%s) - T0))); }

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.txt"

echo "== build $(el)"
timeout 80 python3 -c "from lightning_adaptiveload.ops._build import main; raise SystemExit(main(['--verbose']))" \
  > "$OUT/build.log" 2>&1
rc=$?
echo "build rc=$rc $(el)"
if [ $rc -ne 0 ]; then grep -iE "error" "$OUT/build.log" | head -30; tail -20 "$OUT/build.log"; exit 1; fi

echo "== CUDA tests $(el)"
XD=""
python3 -c "import xdist" 2>/dev/null && XD="-n 4"
timeout 85 python3 -m pytest -q -p no:cacheprovider $XD --timeout 80 tests/ops/test_ops_cuda.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? $(el)"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -20

echo "== forward kernels side by side $(el)"
timeout 45 python3 benchmarks/kernels/bench_modulate.py --paths --out "$OUT/modulate_paths_h100.json" > "$OUT/paths.log" 2>&1
echo "paths rc=$? $(el)"
grep -E "copy bandwidth|path |Error|error" "$OUT/paths.log" | cut -c1-150

echo "== benchmark $(el)"
if [ "$(left)" -ge 30 ]; then
  timeout "$(left)" python3 benchmarks/kernels/bench_modulate.py --no-sweep --out "$OUT/modulate_h100.json" > "$OUT/bench.log" 2>&1
  echo "bench rc=$? $(el)"
  tail -9 "$OUT/bench.log"
else
  echo "skipped: $(left) s left"
fi

echo "== ncu forward, shapes 1 and 3 $(el)"
if [ "$(left)" -ge 25 ]; then
  timeout "$(left)" ncu --clock-control none -k regex:'ln_mod_fwd' --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section LaunchStats \
    python3 benchmarks/kernels/bench_modulate.py --profile-once --shapes 1,3 > "$OUT/ncu.log" 2>&1
  echo "ncu rc=$? $(el)"
  grep -E "ln_mod_|Duration|DRAM Throughput|Achieved Occupancy|Registers Per|Grid Size|Block Size" \
    "$OUT/ncu.log" | sed -E 's/ +/ /g' | cut -c1-120 | head -24
else
  echo "skipped: $(left) s left"
fi
echo "done $(el)"
