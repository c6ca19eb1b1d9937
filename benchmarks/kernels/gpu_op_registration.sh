#!/usr/bin/env bash
# The fused op's registration on a GPU in one device call: build the shipped library (TORCH_LIBRARY), run
# the CUDA tests of the op and of the fusion pass, load the cached build with no toolchain (CUDA_HOME
# pointing nowhere), and build the benchmark-only kernel variants (benchmarks/kernels/modulate_variants.py) beside
# the tests. Logs land in $OUT. Run from the repository root:  OUT=/tmp/out bash benchmarks/kernels/gpu_op_registration.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/op_registration_out}
mkdir -p "$OUT"
export LIGHTNING_ADAPTIVELOAD_CACHE=${LIGHTNING_ADAPTIVELOAD_CACHE:-/tmp/la_cache}
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s]"; }
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

echo "== build $(el)"
timeout 150 python3 -m lightning_adaptiveload build-ops > "$OUT/build.log" 2>&1
rc=$?
tail -3 "$OUT/build.log"
echo "build rc=$rc $(el)"
if [ $rc -ne 0 ]; then grep -iE "error" "$OUT/build.log" | head -30; exit 1; fi

# The benchmark build compiles on the free cores while the tests run.
(cd benchmarks/kernels && timeout 200 python3 -c "
from modulate_variants import load_variants
import torch
ext = load_variants()
x = torch.randn(1, 64, 1536, device='cuda', dtype=torch.bfloat16)
t = torch.randn(1, 1536, device='cuda')
y3, _, _ = ext.forward(x, t, t, None, None, 64, 1e-6, 0, 0, 3)
y0, _, _ = ext.forward(x, t, t, None, None, 64, 1e-6, 0, 0, 0)
print('variants: path 3 vs default max diff', (y3.float() - y0.float()).abs().max().item(), 'plan', ext.backward_plan(x, t, False, 64, 0, 0))
") > "$OUT/variants.log" 2>&1 &
VPID=$!

echo "== CUDA tests $(el)"
XD=""
python3 -c "import xdist" 2>/dev/null && XD="-n 4"
timeout 200 python3 -m pytest -m cuda -q -p no:cacheprovider $XD tests/ops/test_ops_cuda.py tests/fusion/test_fusion_cuda.py \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? $(el)"
grep -E "passed|failed|error" "$OUT/pytest.log" | tail -3
grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -30

echo "== cached build without a toolchain $(el)"
CUDA_HOME=/nonexistent timeout 60 python3 -c "
from torch.utils import cpp_extension
from lightning_adaptiveload.ops import fused_op_status
print('CUDA_HOME', cpp_extension.CUDA_HOME, 'status', fused_op_status())
" 2>&1 | tail -3

wait $VPID
echo "variants rc=$? $(el)"
tail -3 "$OUT/variants.log"
