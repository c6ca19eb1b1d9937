#!/usr/bin/env bash
# One call on a single-GPU machine (H100): build the fused op, run every CUDA test, time one fused Wan 1.3B
# block, trace wan-1.3b per bucket of the wan21_480p mix, and train wan-1.3b at 480p through the real data
# path (synthetic shards -> planner -> DataModule -> VideoDiTModule + LoadBalanceMonitor) for a few steps.
# Usage (device tool): bash benchmarks/archive/gpu_session_h100.sh [PART ...]   (writes under $OUT)
# PARTs: tests fusion trace calibrate train (default: all; a device call lasts 10 minutes at most, so split
# them over two calls: "tests fusion" then "trace calibrate train").
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
  && export PYTHONPATH="$HOME/site:$PWD" || exit 1
OUT=${OUT:-/tmp/gpu_session}; mkdir -p "$OUT"
STEPS=${STEPS:-25}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__)"

PARTS=" ${*:-tests fusion trace calibrate train} "
want() { [[ "$PARTS" == *" $1 "* ]]; }

echo "== build-ops"; t0=$(date +%s)
python3 -m lightning_adaptiveload build-ops 2>&1 | tail -3
echo "build took $(( $(date +%s) - t0 )) s"

if want tests; then
echo "== CUDA tests"
timeout 300 python3 -m pytest -m cuda -q -rfE -p no:cacheprovider tests/ > "$OUT/gpu_tests.log" 2>&1
grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -15
fi

if want fusion; then
echo "== fused Wan 1.3B block"
timeout 150 python3 benchmarks/kernels/bench_fusion_block.py --out "$OUT" 2>&1 | tail -12
fi

if want trace; then
echo "== per-bucket trace, wan-1.3b"
timeout 200 python3 benchmarks/balance/gpu_trace_wan13b.py --out "$OUT/trace_wan13b_h100.jsonl" --time-budget-s 160 2>&1 | tail -25
fi

if want calibrate; then
# Per-sample fit as before, to stay in this call's time; the pack measurements: gpu_calibrate_packs.sh.
echo "== calibrate wan-1.3b on the wan21_480p mix"
timeout 240 python3 -m lightning_adaptiveload calibrate --recipe recipes/wan13b_480p_dual.yaml --mix wan21_480p \
  --num-shapes 3 --warmup 1 --repeats 1 --max-batch 8 --no-packs --no-progress --out "$OUT/calib_wan13b_h100.yaml" 2>&1 | grep -v "^\s*$" | tail -12
fi

if want train; then
echo "== wan-1.3b 480p training through the data path"
rm -rf /tmp/wan480 runs/h100_train
timeout 200 python3 -m lightning_adaptiveload fit --config recipes/wan13b_480p_dual.yaml \
  --trainer.devices 1 --trainer.max_steps "$STEPS" --trainer.log_every_n_steps 5 \
  --trainer.default_root_dir runs/h100_train --trainer.logger.init_args.save_dir runs/h100_train \
  --trainer.limit_val_batches 0 \
  --data.init_args.train_shards /tmp/wan480/train --data.init_args.num_workers 4 \
  --data.init_args.synthetic '{"mix":"wan21_480p","num_samples":160,"samples_per_shard":16,"text_dim":4096,"text_len_range":[16,256],"seed":0}' 2>&1 \
  | grep -v "^\s*$" | tail -40
f=$(find runs/h100_train -name load_balance.json | head -1); [ -n "$f" ] && cp "$f" "$OUT/train_h100_load_balance.json"
f=$(find runs/h100_train -name load_balance_steps.csv | head -1); [ -n "$f" ] && cp "$f" "$OUT/train_h100_steps.csv"
fi
ls -la "$OUT"
