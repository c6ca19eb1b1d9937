#!/usr/bin/env bash
# One GPU call (issue 17, runs 25 and 26): compiled blocks against eager mode at one 32,760-token clip.
# 1. diffusers' Wan block (check_diffusers_grads.py), per weight dtype and batch size ($DIFFUSERS_CONFIGS):
#    PyTorch's inductor settings against compile_blocks';
# 2. our block through compile_check (the full-size tests of tests/ops/test_norm_kernels.py: the norm kernels, and
#    inductor's own norms under compile_blocks' settings) and tests/models/test_compile_check.py.
# Needs diffusers from carried wheels (.whl, ../shared/tools/device-wheels.sh).
GPU_JOB=compile_check; TOTAL=${TOTAL:-590}; BUILD=0
source "$(dirname "$0")/../_gpu_preamble.sh"
export LIGHTNING_ADAPTIVELOAD_FUSED=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
  && export PYTHONPATH=$PYTHONPATH:$HOME/site || exit 1
# Run 25 ran the first configuration, run 26 the other three (about 85 s each).
IFS=';' read -ra CONFIGS <<< "${DIFFUSERS_CONFIGS:---weights fp32;--weights bf16;--batch 2;--batch 2 --weights bf16}"
for c in "${CONFIGS[@]}"; do
  # shellcheck disable=SC2086
  timeout 150 python3 benchmarks/checks/check_diffusers_grads.py $c --out "$OUT" 2>&1 | grep -v "^USDT\|^W1\|^W0" >> "$OUT/diffusers.log"
  echo "diffusers [$c] rc=$? $(el)"; grep "worst" "$OUT/diffusers.log" | tail -2
done
left=$(seconds_left)
timeout $(( left - 5 )) python3 -m pytest -q -p no:cacheprovider -p no:logging --tb=short \
  tests/models/test_compile_check.py "tests/ops/test_norm_kernels.py::test_on_the_gpu_a_compiled_wan_block_at_one_clip_matches_eager" \
  > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? $(el)"; grep -v "^\s*$" "$OUT/pytest.log" | tail -8
