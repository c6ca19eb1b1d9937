#!/usr/bin/env bash
# One GPU (nvidia-h200 or nvidia-h100-x1), issue 19: FSDP2 on a real device (run on an H200,
# 2026-11-23: docs/multi_node.md). 1) the fused norm + modulate op under fully_shard matches the unfused model (loss and gradients,
# wan-1.3b width, 4 blocks, bf16 policy, activation checkpointing); 2) a few training steps of wan-14b at
# 720p (75,600 tokens) with FSDP2 CPU offload if the memory planner says it fits (GPU and host), else the
# wan-14b-wide model with the most blocks that fits; tokens/s and peak memory to benchmarks/results/.
# Usage (device tool): STEPS=4 bash benchmarks/fsdp/gpu_fsdp_h200.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
  && export PYTHONPATH="$HOME/site:$PWD" || export PYTHONPATH="$PWD"
OUT=${OUT:-benchmarks/results}; mkdir -p "$OUT"
STEPS=${STEPS:-4}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
free -g | head -2
python3 -m lightning_adaptiveload build-ops 2>&1 | tail -1
run() { torchrun --standalone --nproc_per_node=1 benchmarks/fsdp/fsdp_gpu.py "$@" 2>&1 | grep -Ev "UserWarning|warnings.warn" | tail -40; }
run parity --out "$OUT"
run train --preset wan-14b --tokens 75600 --steps "$STEPS" --fused --out "$OUT"
ls -la "$OUT"/fsdp_*.json
