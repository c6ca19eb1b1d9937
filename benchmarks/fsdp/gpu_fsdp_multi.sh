#!/usr/bin/env bash
# Several GPUs of one host (nvidia-h200-x2 / -x4 / -x8), issue 19. NOT RUN YET (written without a device).
# 1) parity of the fused op under fully_shard sharded over all GPUs; 2) wan-14b at 720p, FSDP2 over all
# GPUs, a few steps: tokens/s and peak memory; 3) the real Lightning path: the wan14b_720p recipe
# (ModelParallelStrategy, LoadBalanceMonitor timing by fsdp2_post_backward) for a few steps on synthetic
# 720p data, its load-balance files kept.
# Usage (device tool): STEPS=4 FIT_STEPS=20 bash benchmarks/fsdp/gpu_fsdp_multi.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
  && export PYTHONPATH="$HOME/site:$PWD" || export PYTHONPATH="$PWD"
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
STEPS=${STEPS:-4}
FIT_STEPS=${FIT_STEPS:-20}
NGPU=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m lightning_adaptiveload build-ops 2>&1 | tail -1
run() { torchrun --standalone --nproc_per_node="$NGPU" benchmarks/fsdp/fsdp_gpu.py "$@" 2>&1 | grep -Ev "UserWarning|warnings.warn" | tail -40; }
run parity --out "$OUT"
run train --preset wan-14b --tokens 75600 --steps "$STEPS" --fused --out "$OUT"
RUN=/tmp/fsdp_fit
python3 -m lightning_adaptiveload fit --config wan14b_720p --trainer.devices="$NGPU" --trainer.max_steps="$FIT_STEPS" \
  --trainer.default_root_dir="$RUN" --trainer.logger.init_args.save_dir="$RUN" \
  --data.init_args.synthetic.num_samples=$((64 * NGPU)) --data.init_args.train_shards="$RUN/data/train" 2>&1 \
  | grep -Ev "UserWarning|warnings.warn" | tail -60
find "$RUN" -name 'load_balance*' -exec cp {} "$OUT"/ \; 2>/dev/null
ls -la "$OUT"
