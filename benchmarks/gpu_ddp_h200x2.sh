#!/usr/bin/env bash
# One call on nvidia-h200-x2: the real 2-GPU DDP comparison of equal_tokens, dual and lockstep (wan-1.3b,
# 480p wan21_480p synthetic shards, the same max_tokens in every mode), then the report. Only a few files
# can come back from the device, so the run folder (CSVs, JSON; no checkpoints) travels as one tarball.
# Usage (device tool): STEPS=60 bash benchmarks/gpu_ddp_h200x2.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
  && export PYTHONPATH="$HOME/site:$PWD" || exit 1
OUT=${OUT:-/tmp/gpu_ddp}; mkdir -p "$OUT"
STEPS=${STEPS:-60}
MODES=${MODES:-lockstep,equal_tokens,dual}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -m lightning_adaptiveload build-ops 2>&1 | tail -1
RUN=/tmp/ddp_modes
python3 benchmarks/ddp_modes.py --modes "$MODES" --steps "$STEPS" --devices 2 --out "$RUN" 2>&1 \
  | grep -v "^\s*$" | grep -Ev "UserWarning|return Variable|AccumulateGrad|_pytree" | tail -120
python3 benchmarks/ddp_modes_report.py "$RUN" --results "$OUT" --img "$OUT" 2>&1 | tail -30
tar czf "$OUT/ddp_modes_run.tgz" -C /tmp ddp_modes --exclude='*.ckpt' 2>/dev/null
ls -la "$OUT"
