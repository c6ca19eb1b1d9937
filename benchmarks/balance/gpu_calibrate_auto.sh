#!/usr/bin/env bash
# One GPU call: `calibrate --checkpoint-blocks auto` on wan-1.3b (compiled, save_matmuls) at max_tokens 32,760
# of the wan21_480p mix: the memory search is skipped, the activation-memory model is fitted on the device and
# written into the fragment with the timings. Checks the calibrate path end to end on CUDA (run 7's bench
# fitted the same model through bench_step_mix.py). Fragment, results and log in $OUT.
GPU_JOB=calibrate_auto; TOTAL=${TOTAL:-560}
source "$(dirname "$0")/../_gpu_preamble.sh"
timeout $(( $(seconds_left) - 10 )) python3 -m lightning_adaptiveload calibrate --preset wan-1.3b \
  --mix wan21_480p --max-tokens 32760 --num-shapes 3 --warmup 1 --repeats 2 --no-packs --compile \
  --activation-checkpointing --checkpoint-policy save_matmuls --checkpoint-blocks auto --no-progress \
  --out "$OUT/calib_auto.yaml" --results "$OUT/calib_auto_results.yaml" > "$OUT/calibrate.log" 2>&1
echo "calibrate rc=$? $(el)"; grep -v "^USDT\|^W1\|^W0" "$OUT/calibrate.log" | tail -5; cat "$OUT/calib_auto.yaml"
