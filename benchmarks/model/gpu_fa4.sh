#!/usr/bin/env bash
# One GPU call (issue 17): FlashAttention-4 (flash-attn-4, CuTe DSL) against cuDNN attention on one H100.
# 0. TESTS (test files; TESTS_K: a -k expression): those CUDA tests first, with FA4 importable;
# 1. the attention kernels alone on the mix's shapes (bench_attention.py: cuDNN, FA2, FA4 through PyTorch's
#    registry, FA4 called directly; errors against cuDNN and an fp32 reference); ATTN_ARGS adds arguments
#    (e.g. "--impls cudnn,fa4 --shapes cross_81f,cross_17f --splits 1,4,8", run 28);
# 1b. MODE containing "tune": FA4's tile configurations alone (tune_fa4.py);
# 2. MODE=clip (default): one clip's compiled step, cuDNN and FA4 side by side, profiled by kernel category;
#    MODE=mix: the planned epoch of the wan21_480p mix (bench_step_mix.py) for $VARIANTS.
#
# FA4 and its packages are not on the GPU image and the machine has no network. The wheels (flash-attn-4,
# nvidia-cutlass-dsl with its cu13 libraries, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext), unpacked,
# make a 69 MB xz archive: over one call's 64 MiB, so it travels in two halves (.fa4a, then .fa4b, see
# docs/lab_notebook.md "Run 11") and is unpacked to $FA4_SITE. Made by:
#   pip download --no-deps ... flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
#     nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
#     apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5; unzip each into site/; tar c site | xz -9e | split
GPU_JOB=fa4; TOTAL=${TOTAL:-580}
FA4_SITE=${FA4_SITE:-/tmp/fa4site}
source "$(dirname "$0")/../_gpu_preamble.sh"
if [ ! -d "$FA4_SITE/flash_attn" ]; then
  mkdir -p "$FA4_SITE" /tmp/fa4parts
  [ -f .fa4a/part.aa ] && cp .fa4a/part.aa /tmp/fa4parts/
  [ -f .fa4b/part.ab ] && cp .fa4b/part.ab /tmp/fa4parts/
  cat /tmp/fa4parts/part.aa /tmp/fa4parts/part.ab > /tmp/fa4site.tar.xz || exit 3
  if [ -f .fa4b/SHA256 ]; then
    echo "$(cut -d' ' -f1 .fa4b/SHA256)  /tmp/fa4site.tar.xz" | sha256sum -c || exit 3
  fi
  xz -d < /tmp/fa4site.tar.xz | tar x -C "$FA4_SITE" || exit 3
  echo "FA4 unpacked $(el)"
fi
export PYTHONPATH=$PWD:$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages
if ls .whl/*.whl > /dev/null 2>&1; then  # diffusers for its variants (../shared/tools/device-wheels.sh)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" \
    .whl/*.whl && export PYTHONPATH=$PYTHONPATH:$HOME/site
fi
python3 -c "import flash_attn.cute.interface as i, cutlass, torch; print('flash_attn.cute', i.__file__, 'cutlass', cutlass.__file__)" || exit 4

if [ -n "${TESTS:-}" ]; then  # TESTS="test files", TESTS_K="a -k expression": CUDA tests with FA4 importable
  timeout 200 python3 -m pytest -m cuda -q -p no:cacheprovider -p no:logging --tb=short -rs $TESTS \
    ${TESTS_K:+-k "$TESTS_K"} > "$OUT/pytest_fa4.log" 2>&1
  echo "pytest rc=$? $(el)"; tail -6 "$OUT/pytest_fa4.log"
fi
if [ "${ATTN:-1}" = 1 ]; then  # ATTN=0: skip the kernels-alone benchmark
  timeout $(( ${ATTN_S:-200} )) python3 benchmarks/model/bench_attention.py --out "$OUT" ${ATTN_ARGS:-} 2>&1 \
    | grep -v "^USDT\|^W1\|^W0" > "$OUT/attention.log"
  echo "attention rc=$? $(el)"; tail -22 "$OUT/attention.log"
fi
if [[ "${MODE:-clip}" == *tune* ]]; then  # FA4's tile configurations alone (tune_fa4.py)
  timeout $(( ${TUNE_S:-220} + 20 )) python3 benchmarks/model/tune_fa4.py --out "$OUT" --time-budget-s "${TUNE_S:-220}" 2>&1 \
    | grep -v "^USDT\|^W1\|^W0\|UserWarning\|exe_args" > "$OUT/tune.log"
  echo "tune rc=$? $(el)"; tail -24 "$OUT/tune.log"
fi
left=$(seconds_left)
if [[ "${MODE:-clip}" == *clip* ]]; then
  timeout $(( left - 10 )) python3 benchmarks/model/bench_step.py --out "$OUT" --shapes clip --profile clip --no-micro \
    --reps 3 --variants "${PVARIANTS:-compile+smm26+nofuse,compile+smm26+nofuse+fa4}" \
    --time-budget-s $(( left - 60 )) 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/clip.log"
  echo "clip rc=$? $(el)"; grep -v "^\s*$" "$OUT/clip.log" | tail -40
  left=$(seconds_left)
fi
[[ "${MODE:-clip}" == *mix* ]] || exit 0
timeout $(( left - 5 )) python3 benchmarks/model/bench_step_mix.py --out "$OUT" --max-tokens "${MAX_TOKENS:-32760}" \
  --variants "${VARIANTS:-baseline,compile+smm_auto+nofuse+fa4}" --time-budget-s $(( left - 90 )) \
  ${RECOMPILE_LIMIT:+--recompile-limit "$RECOMPILE_LIMIT"} 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/mix.log"
grep -i -A3 "recompil" "$OUT/mix.log" | grep -v "^\s*File\|^--" | head -40
echo "mix rc=$? $(el)"; tail -16 "$OUT/mix.log"
