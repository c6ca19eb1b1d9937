#!/usr/bin/env bash
# One device call on a machine of 2 or 4 GPUs (nvidia-h100-x4 / nvidia-h200-x4): the monitor against raw
# probes (benchmarks/balance/monitor_truth.py) at 2 ranks (GPUs 0,1) and, where the machine has them, at 4 ranks.
# wan-1.3b, the recipes' eager settings, each rank its own known clip. Results: $OUT/monitor_truth.tgz
# (JSON per world size, the monitors' CSVs) and the printed tables.
# Usage (device tool): bash benchmarks/balance/gpu_monitor_truth.sh   [STRATEGY=ddp|fsdp2 STEPS=6 WARMUP=2 LIGHTNING=...
#   RAW=... FOUR=1 TESTS="cuda-marked test files to run after, in the same call"]
GPU_JOB=monitor_truth
source "$(dirname "$0")/../_gpu_preamble.sh"
STRATEGY=${STRATEGY:-ddp}  # ddp or fsdp2 (ModelParallelStrategy; raw solo = the whole model alone, fsdp2)
if [ "$STRATEGY" = fsdp2 ]; then LIGHTNING=${LIGHTNING:-50:none,1:none}; RAW=${RAW:-solo,fsdp2}
else LIGHTNING=${LIGHTNING:-50:none,50:python,1:none}; RAW=${RAW:-solo,ddp,ddp_pyhook}; fi
STEPS=${STEPS:-6}; WARMUP=${WARMUP:-2}
NGPU=$(nvidia-smi -L | wc -l)
RUN=/tmp/monitor_truth; mkdir -p "$RUN"
filter() { grep -Ev "UserWarning|warnings.warn|^W1|_pytree|FutureWarning|LeafSpec|^\s*$" ; }
echo "== 2 ranks $(el)"
CUDA_VISIBLE_DEVICES=0,1 timeout $(( $(seconds_left) - 30 )) torchrun --standalone --nproc_per_node 2 \
  benchmarks/balance/monitor_truth.py --batches "${BATCHES2:-1x21,1x13}" --steps "$STEPS" --warmup "$WARMUP" \
  --lightning "$LIGHTNING" --raw "$RAW" --strategy "$STRATEGY" --out "$RUN" 2>&1 | filter | tail -40
if [ "${FOUR:-1}" = 1 ] && [ "$NGPU" -ge 4 ] && [ "$(seconds_left)" -gt 200 ]; then
  echo "== 4 ranks $(el)"
  CUDA_VISIBLE_DEVICES=0,1,2,3 timeout $(( $(seconds_left) - 20 )) torchrun --standalone --nproc_per_node 4 \
    benchmarks/balance/monitor_truth.py --batches "${BATCHES4:-1x21,1x17,1x17,1x13}" --steps "$STEPS" --warmup "$WARMUP" \
    --lightning "${LIGHTNING4:-$LIGHTNING}" --raw "${RAW4:-$RAW}" --strategy "$STRATEGY" --out "$RUN" 2>&1 | filter | tail -40
fi
if [ -n "${TESTS:-}" ] && [ "$(seconds_left)" -gt 60 ]; then  # e.g. TESTS="tests/monitor/test_monitor_gpu.py"
  echo "== pytest -m cuda $TESTS $(el)"
  timeout $(( $(seconds_left) - 15 )) python3 -m pytest -m cuda -q -p no:cacheprovider -p no:logging --tb=short -rs \
    $TESTS > "$RUN/pytest_cuda.log" 2>&1
  echo "pytest rc=$? $(el)"; grep -v "^\s*$" "$RUN/pytest_cuda.log" | tail -30
fi
echo "== done $(el)"
tar czf "$OUT/monitor_truth.tgz" -C /tmp monitor_truth
ls -la "$OUT"
