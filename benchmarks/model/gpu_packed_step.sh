#!/usr/bin/env bash
# One GPU call (issue 36, items 1-3): the CUDA tests of the packed path, then
# benchmarks/model/bench_packed_step.py: a pack of one 32,760-token clip against its bucketed batch, and a
# mixed pack (a 17,160-token clip and ten 1,560-token images) against the same samples as bucketed steps,
# eager and compiled (regional, dynamic), wan-1.3b, bf16 autocast, every block checkpointed. The mixed pack
# runs its self-attention three ways: the runs op (default), the variable-length kernel, per sample (eager).
# JSON + logs in $OUT.
GPU_JOB=packed_step; TOTAL=${TOTAL:-570}; BUILD=${BUILD:-0}
source "$(dirname "$0")/../_gpu_preamble.sh"
echo "== cuda tests $(el)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m cuda tests/models/test_pack_attention.py tests/models/test_packing_compile.py \
  > "$OUT/pytest_cuda_packed.log" 2>&1; echo "pytest rc=$? $(el)"; tail -3 "$OUT/pytest_cuda_packed.log"
left=$(seconds_left)
echo "== bench_packed_step ($left s left) $(el)"
timeout $(( left - 10 )) python3 benchmarks/model/bench_packed_step.py --cases ${CASES:-clip,mix} --modes ${MODES:-eager,compiled} \
  --no-old --reps ${REPS:-3} --out "$OUT" 2>&1 | grep -v "^USDT\|^W1\|^W0" > "$OUT/bench_packed_step.log"
echo "bench rc=$? $(el)"; tail -30 "$OUT/bench_packed_step.log"
