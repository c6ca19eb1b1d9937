#!/usr/bin/env bash
# One GPU call (issue 17, run 30): the fastest measured model settings through the real training path, not
# the benchmark harness: `fit` of recipes/wan13b_480p_dual.yaml (its DDP strategy, one GPU) with compile,
# save_matmuls with the checkpointed-block count per batch, bf16 weights (MasterWeightAdamW and its Triton
# kernel), the cross-attention's query split (the default) and attention_backend auto, on 160 synthetic
# wan21_480p samples at max_tokens 32,760; then a resume from its last checkpoint for a few more steps (the
# optimizer's flat state restored on the GPU). The memory model is the one bench_step_mix.py fitted for bf16
# weights on an H100 (run 29), plus DDP's gradient buckets (2 bytes a parameter, allocated before the first
# backward); calibrate --checkpoint-blocks auto measures both on your GPU. Run 30's first try, with a fixed
# 26 blocks, ran out of memory at the second step (70.5 GiB allocated, 7 GiB reserved but free).
# Writes logs and the LoadBalanceMonitor files to $OUT. Needs .whl carried: webdataset, and LightningCLI's
# jsonargparse (../shared/tools/device-wheels.sh jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0).
GPU_JOB=fit_fast; TOTAL=${TOTAL:-560}; BUILD=0
source "$(dirname "$0")/../_gpu_preamble.sh"
export LIGHTNING_ADAPTIVELOAD_FUSED=0  # the compiled blocks leave the norm-modulate sites unfused
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
  && export PYTHONPATH="$PYTHONPATH:$HOME/site" || exit 1
STEPS=${STEPS:-40}; MORE=${MORE:-8}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export MEMORY='{"num_blocks": 30, "base_bytes": 23026000000, "token_all": 1592765.1, "text_all": 202282.7, "token_block": 42739.0, "text_block": 2445.4}'
rm -rf /tmp/wan480 runs/fit_fast
fit() {
  python3 -m lightning_adaptiveload fit --config recipes/wan13b_480p_dual.yaml \
    --trainer.devices 1 --trainer.log_every_n_steps 5 --trainer.limit_val_batches 0 \
    --trainer.default_root_dir runs/fit_fast --trainer.logger.init_args.save_dir runs/fit_fast \
    --model.init_args.compile true --model.init_args.optimizer.weight_dtype bf16 \
    --model.init_args.memory.checkpoint_policy save_matmuls --model.init_args.memory.checkpoint_blocks auto \
    --model.init_args.memory.activation_memory "$MEMORY" \
    --model.init_args.attention_backend auto \
    --data.init_args.batching.max_tokens 32760 --data.init_args.train_shards /tmp/wan480/train --data.init_args.loader.num_workers 4 \
    --data.init_args.synthetic '{"mix":"wan21_480p","num_samples":160,"samples_per_shard":16,"text_dim":4096,"text_len_range":[16,256],"seed":0}' \
    "$@" 2>&1 | grep -v "^\s*$\|^USDT\|^W1\|^W0"
}
echo "== fit, $STEPS steps $(el)"
timeout $(( $(seconds_left) - 150 )) bash -c "$(declare -f fit); fit --trainer.max_steps $STEPS" > "$OUT/fit.log"
echo "fit rc=$? $(el)"; tail -30 "$OUT/fit.log"
for name in load_balance.json load_balance_steps.csv metrics.csv; do
  f=$(find runs/fit_fast -name "$name" | head -1); [ -n "$f" ] && cp "$f" "$OUT/fit_$name"
done
ckpt=$(find runs/fit_fast -name last.ckpt | head -1); echo "checkpoint: $ckpt"
[ -n "$ckpt" ] || exit 0
echo "== resume to $(( STEPS + MORE )) steps $(el)"
timeout $(( $(seconds_left) - 10 )) bash -c "$(declare -f fit); fit --trainer.max_steps $(( STEPS + MORE )) --ckpt_path $ckpt" \
  > "$OUT/resume.log"
echo "resume rc=$? $(el)"; tail -20 "$OUT/resume.log"
f=$(find runs/fit_fast -name metrics.csv | sort | tail -1); [ -n "$f" ] && cp "$f" "$OUT/resume_metrics.csv"
