#!/usr/bin/env bash
# The 2-GPU mode comparison, now benchmarks/balance/gpu_ddp_modes_x4.sh with NGPU=2 (all four modes, eager or fast
# settings, the report beside the simulator's prediction). Kept so that older notes still run.
# Usage (device tool, kind nvidia-h200-x2 or any machine of 2+ GPUs): SETTINGS=eager bash benchmarks/archive/gpu_ddp_h200x2.sh
NGPU=${NGPU:-2} exec bash "$(dirname "$0")/../balance/gpu_ddp_modes_x4.sh"
