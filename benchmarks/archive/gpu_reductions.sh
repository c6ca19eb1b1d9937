#!/usr/bin/env bash
# One GPU call (issue 17, run 22): are inductor's own norm backwards right once its mix-order reductions are off
# (compile_blocks' default, acceleration.SAFE_REDUCTIONS), and what do the norm-kernel settings and the
# reductions cost on one clip's compiled step?
# 1. the CUDA tests of the Triton norm kernels, the full-size compiled-block check included;
# 2. check_block_grads.py (a wan-1.3b block at one 32,760-token clip against eager mode) for inductor's norms
#    (none) and RMSNorm + RoPE only (rope), compiled with compile_blocks' settings; writes /tmp/rope_ok when
#    every gradient of the rope setting is within 3e-2 (the test's bound), for the next call to read;
# 3. one clip's compiled step (cuDNN attention, 26 blocks save_matmuls): RMSNorm + RoPE only, all sites (the
#    default), all sites with mix-order reductions on (PyTorch's default), none.
# Also copies the first half of the FA4 archive (.fa4a, see gpu_fa4.sh) to /tmp/fa4parts when carried.
GPU_JOB=reductions; TOTAL=${TOTAL:-570}; BUILD=0
source "$(dirname "$0")/../_gpu_preamble.sh"
export LIGHTNING_ADAPTIVELOAD_FUSED=0  # no variant here uses the fused CUDA op
mkdir -p /tmp/fa4parts; [ -f .fa4a/part.aa ] && cp .fa4a/part.aa /tmp/fa4parts/ && echo "FA4 part a copied"
rm -f /tmp/rope_ok
timeout 240 python3 -m pytest -m cuda -q -p no:cacheprovider -p no:logging --tb=short tests/ops/test_norm_kernels.py \
  > "$OUT/pytest_norm_kernels.log" 2>&1
echo "pytest rc=$? $(el)"; tail -15 "$OUT/pytest_norm_kernels.log"
timeout 200 python3 benchmarks/checks/check_block_grads.py --settings "${SETTINGS:-none,rope}" --out "$OUT" 2>&1 \
  | grep -v "^USDT\|^W1\|^W0" > "$OUT/grads.log"
echo "grads rc=$? $(el)"; tail -4 "$OUT/grads.log"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for f in pathlib.Path(sys.argv[1]).glob("check_block_grads_*.json"):
    rope = json.loads(f.read_text())["settings"].get("rope")
    if rope:
        worst = max(rope["rel_diff"].values())
        print(f"rope setting, worst relative difference {worst:.2e}")
        if worst <= 3e-2:
            pathlib.Path("/tmp/rope_ok").touch()
PY
left=$(seconds_left)
timeout $(( left - 10 )) python3 benchmarks/model/bench_step.py --out "$OUT" --shapes clip --profile clip --no-micro \
  --reps 3 --variants "${VARIANTS:-compile+smm26+nofuse+ropenormk,compile+smm26+nofuse,compile+smm26+nofuse+mor,compile+smm26+nofuse+nonormk}" \
  --time-budget-s $(( left - 60 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/clip.log"
echo "clip rc=$? $(el)"; grep "clip  \|MFU" "$OUT/clip.log" | tail -8
