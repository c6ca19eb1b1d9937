#!/usr/bin/env bash
# One GPU call: every CUDA test of the suite (pytest -m cuda), after building the fused op, with diffusers and
# webdataset from carried wheels (.whl, ../shared/tools/device-wheels.sh). Logs land in $OUT.
GPU_JOB=cuda_tests; TOTAL=${TOTAL:-560}
source "$(dirname "$0")/../_gpu_preamble.sh"
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:$HOME/site
fi
left=$(seconds_left)
timeout $(( left - 10 )) python3 -m pytest -m cuda -q -p no:cacheprovider -p no:logging --tb=short -rs tests/ \
  > "$OUT/pytest_cuda.log" 2>&1
echo "pytest rc=$? $(el)"; grep -v "^\s*$" "$OUT/pytest_cuda.log" | tail -40
