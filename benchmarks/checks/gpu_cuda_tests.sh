#!/usr/bin/env bash
# One device call, one GPU: the CUDA-marked tests, and the recompile log of the packed compile tests.
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s); el() { echo "[$(($(date +%s) - T0)) s]"; }
OUT=${OUT:-/tmp/gpu_tests}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl
export PYTHONPATH="$HOME/site:$PWD"
python3 -c "import torch, pytest; print(torch.__version__, pytest.__version__, torch.cuda.get_device_name())"
python3 -c "import hypothesis" 2>/dev/null || echo "no hypothesis here"
timeout 150 python3 -m lightning_adaptiveload build-ops 2>&1 | tail -1; el
echo "== packing compile, recompiles logged"
TORCH_LOGS=recompiles timeout 200 python3 -m pytest tests/models/test_packing_compile.py -q -p no:cacheprovider -rA > "$OUT/packing_compile.log" 2>&1
echo "rc=$?"; grep -E "passed|failed|Error|assert" "$OUT/packing_compile.log" | tail -8; el
grep -c "Recompiling function" "$OUT/packing_compile.log"
grep -h -A6 "Recompiling function" "$OUT/packing_compile.log" | grep -E -- '^[[:space:]]+- ' | sed 's/^[[:space:]]*- //' | sort | uniq -c | sort -rn | head -12
echo "== every cuda-marked test"
timeout $(( 560 - ($(date +%s) - T0) )) python3 -m pytest tests -m cuda -q -p no:cacheprovider --continue-on-collection-errors -rfE > "$OUT/cuda_tests.log" 2>&1
echo "rc=$?"; tail -30 "$OUT/cuda_tests.log"; el
