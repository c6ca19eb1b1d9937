#!/usr/bin/env bash
# One device call (issue 59, 2026-12-03 second pass): the standalone variant benchmark (norm_mod_mapping),
# the torch library built from these sources ("new") and, where .lead/old_csrc holds the sources before
# (OLD=1), from those ("old"); the CUDA tests of tests/ops on the new build; the accuracy check; the limit
# benchmark on each build (old first, then new, same process order, same machine). Output under $OUT.
# The old build runs beside the new one; BENCH_OLD_ARGS (default BENCH_ARGS) are the old build's benchmark arguments.
#   OUT=/tmp/out [OLD=1] [MAPPING=1] [TESTS=1] [ACC=1] [BUILDS="old new old new"] [BENCH_ARGS=--no-eager]
#     [BENCH_OLD_ARGS=--host-only] [FINAL_ARGS=--no-eager] bash benchmarks/kernels/gpu_norm_mod_s33.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/logs"
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s]"; }
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1
} > "$OUT/logs/env.txt" 2>&1
cat "$OUT/logs/env.txt"
if [ "${MAPPING:-1}" = 1 ]; then
  echo "== standalone $(el)"
  bash benchmarks/kernels/build_norm_mod_mapping.sh /tmp/nm_mapping > "$OUT/logs/mapping_build.log" 2>&1 || { tail -30 "$OUT/logs/mapping_build.log"; }
  /tmp/nm_mapping > "$OUT/nm_mapping.txt" 2>&1
  echo "mapping rc=$? $(el)"
fi
echo "== builds $(el)"
if [ "${OLD:-0}" = 1 ]; then  # the old build beside the new one
  LIGHTNING_ADAPTIVELOAD_CSRC=$PWD/.lead/old_csrc LIGHTNING_ADAPTIVELOAD_CACHE=/tmp/la_old timeout 300 \
    python3 -m lightning_adaptiveload build-ops > "$OUT/logs/build_old.log" 2>&1 &
  old_pid=$!
fi
LIGHTNING_ADAPTIVELOAD_CACHE=/tmp/la_new timeout 300 python3 -m lightning_adaptiveload build-ops > "$OUT/logs/build_new.log" 2>&1
echo "build new rc=$? $(el)"; grep -B2 -A10 " error" "$OUT/logs/build_new.log" | head -40
if [ "${OLD:-0}" = 1 ]; then
  wait "$old_pid"
  echo "build old rc=$? $(el)"
fi
so=$(ls /tmp/la_new/torch_extensions/*/*.so | head -1)
cuobjdump -res-usage "$so" 2>&1 | grep -A1 "nm_\(fwd\|bwd\)_tma\|persistent" | grep -E "Function|REG" | paste - - \
  | sed -E 's/.*Function (_Z[^:]*):.*REG:([0-9]+) STACK:([0-9]+) SHARED:([0-9]+) LOCAL:([0-9]+).*/\2 regs \3 stack \5 local \1/' \
  > "$OUT/logs/resource_usage_new.txt"
if [ "${TESTS:-1}" = 1 ]; then
  echo "== tests $(el)"
  XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 8"
  LIGHTNING_ADAPTIVELOAD_CACHE=/tmp/la_new timeout 280 python3 -m pytest -m cuda -q -p no:cacheprovider $XD --timeout 200 \
    ${PYTEST_ARGS:-tests/ops} > "$OUT/logs/pytest_cuda_ops.log" 2>&1
  echo "pytest rc=$? $(el)"; grep -E "passed|failed|error" "$OUT/logs/pytest_cuda_ops.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/logs/pytest_cuda_ops.log" | head -20
fi
for v in $([ "${ACC:-1}" = 1 ] && echo ${BUILDS:-new}); do
  echo "== accuracy $v $(el)"
  if [ $v = old ]; then export LIGHTNING_ADAPTIVELOAD_CSRC=$PWD/.lead/old_csrc; else unset LIGHTNING_ADAPTIVELOAD_CSRC; fi
  LIGHTNING_ADAPTIVELOAD_CACHE=/tmp/la_$v timeout 120 python3 benchmarks/kernels/check_norm_modulate_accuracy.py \
    --out "$OUT/logs/accuracy_$v.json" > "$OUT/logs/accuracy_$v.log" 2>&1
  echo "acc rc=$? $(el)"
done
i=0
for v in ${BUILDS:-new}; do  # a build named twice or more ("old new old new") is timed in turns
  i=$((i + 1))
  echo "== bench $v ($i) $(el)"
  if [ $v = old ]; then export LIGHTNING_ADAPTIVELOAD_CSRC=$PWD/.lead/old_csrc; else unset LIGHTNING_ADAPTIVELOAD_CSRC; fi
  args=${BENCH_ARGS:---no-eager}
  [ $v = old ] && args=${BENCH_OLD_ARGS:-$args}
  LIGHTNING_ADAPTIVELOAD_CACHE=/tmp/la_$v timeout 200 python3 benchmarks/kernels/bench_norm_modulate_limit.py $args \
    --out "$OUT/logs/bench_${v}_$i.json" > "$OUT/logs/bench_${v}_$i.log" 2>&1
  echo "bench $v rc=$? $(el)"
  grep -E "^\| (ln|rms) \| 1 x (32760|75600) x (1536|5120)|^host us" "$OUT/logs/bench_${v}_$i.log" | cut -c1-400
done
if [ -n "${FINAL_ARGS:-}" ]; then  # one more run of the new build, say the whole table after host-only turns
  echo "== bench new, final $(el)"
  unset LIGHTNING_ADAPTIVELOAD_CSRC
  LIGHTNING_ADAPTIVELOAD_CACHE=/tmp/la_new timeout 200 python3 benchmarks/kernels/bench_norm_modulate_limit.py $FINAL_ARGS \
    --out "$OUT/logs/bench_new_final.json" > "$OUT/logs/bench_new_final.log" 2>&1
  echo "bench final rc=$? $(el)"
  grep -E "^\| (ln|rms) \| |^host us" "$OUT/logs/bench_new_final.log" | cut -c1-400
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
echo "done $(el)"
