#!/usr/bin/env bash
# One GPU call (issue 17, run 27): bf16 weights with the one-kernel master-weight AdamW.
# 1. the CUDA tests of the kernel (tests/ops/test_adamw_kernels.py) and of the master-weight optimizer and bf16
#    training step elsewhere;
# 2. bench_optimizer.py: wan-1.3b's optimizer step, fp32 fused AdamW against the master-weight optimizer's
#    torch and Triton implementations;
# 3. one clip's compiled step (cuDNN attention, 26 blocks save_matmuls), fp32 weights against bf16 weights
#    with the kernel, in one process, profiled.
# Also copies the first half of the FA4 archive (.fa4a, see gpu_fa4.sh) to /tmp/fa4parts when carried.
GPU_JOB=master_adamw; TOTAL=${TOTAL:-570}; BUILD=0
source "$(dirname "$0")/../_gpu_preamble.sh"
export LIGHTNING_ADAPTIVELOAD_FUSED=0  # no variant here uses the fused CUDA op
mkdir -p /tmp/fa4parts; [ -f .fa4a/part.aa ] && cp .fa4a/part.aa /tmp/fa4parts/ && echo "FA4 part a copied"
timeout 200 python3 -m pytest -m cuda -q -p no:cacheprovider -p no:logging --tb=short tests/ops/test_adamw_kernels.py \
  tests/models/test_model.py tests/models/test_acceleration.py -k "adamw or master or bf16 or kernel" > "$OUT/pytest_master_adamw.log" 2>&1
echo "pytest rc=$? $(el)"; tail -8 "$OUT/pytest_master_adamw.log"
timeout 150 python3 benchmarks/model/bench_optimizer.py --out "$OUT" > "$OUT/optimizer.log" 2>&1
echo "optimizer rc=$? $(el)"; tail -6 "$OUT/optimizer.log"
left=$(seconds_left)
timeout $(( left - 10 )) python3 benchmarks/model/bench_step.py --out "$OUT" --shapes clip --profile clip --no-micro \
  --reps 3 --variants "${VARIANTS:-compile+smm26+nofuse,compile+smm26+nofuse+bf16w}" \
  --time-budget-s $(( left - 60 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/clip.log"
echo "clip rc=$? $(el)"; grep "clip  \|MFU" "$OUT/clip.log" | tail -8
