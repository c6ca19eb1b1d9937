#!/usr/bin/env bash
# One call on a machine of 4 GPUs: three independent jobs side by side, each on its own GPUs, so that one
# call's device time buys three measurements (no job shares a GPU; they share the host's CPUs and disks):
#   GPU 0     benchmarks/model/gpu_packed_step.sh       (issue 36: packed vs bucketed steps, eager and compiled)
#   GPU 1     benchmarks/model/gpu_step_mix_packed.sh   (issue 36: the packed epoch's MFU, fast settings)
#   GPUs 2,3  benchmarks/balance/gpu_closed_loop.sh     (issue 41: the cost refit on 2 GPUs, refit on and off)
# Every job's files come back as one tarball, side_by_side.tgz (the device tool returns 8 files), with a
# summary log. Carry .whl (the closed loop runs LightningCLI). TOTAL: seconds for the whole call (540).
set -uo pipefail
TOTAL=${TOTAL:-540}
OUTALL=${OUT:-/tmp/side_by_side}; mkdir -p "$OUTALL"
WORK=/tmp/side_by_side_run; rm -rf "$WORK"; mkdir -p "$WORK"/{packed_step,step_mix,closed_loop}
T0=$(date +%s)
(CUDA_VISIBLE_DEVICES=0 OUT="$WORK/packed_step" TOTAL=$((TOTAL - 20)) bash benchmarks/model/gpu_packed_step.sh \
  > "$WORK/packed_step/main.log" 2>&1; echo "packed_step rc=$? at $(($(date +%s) - T0)) s") &
(CUDA_VISIBLE_DEVICES=1 OUT="$WORK/step_mix" TOTAL=$((TOTAL - 20)) BUILD=0 \
  VARIANTS=${MIX_VARIANTS:-compile+smm_auto+nofuse+bf16w} bash benchmarks/model/gpu_step_mix_packed.sh \
  > "$WORK/step_mix/main.log" 2>&1; echo "step_mix rc=$? at $(($(date +%s) - T0)) s") &
(CUDA_VISIBLE_DEVICES=2,3 OUT="$WORK/closed_loop" NGPU=2 TOTAL=$((TOTAL - 25)) SAMPLES=${LOOP_SAMPLES:-160} \
  bash benchmarks/balance/gpu_closed_loop.sh > "$WORK/closed_loop/main.log" 2>&1; \
  echo "closed_loop rc=$? at $(($(date +%s) - T0)) s") &
wait
for j in packed_step step_mix closed_loop; do echo "===== $j"; tail -25 "$WORK/$j/main.log"; done > "$OUTALL/side_by_side.log"
tar czf "$OUTALL/side_by_side.tgz" -C /tmp side_by_side_run
cat "$OUTALL/side_by_side.log" | tail -80
