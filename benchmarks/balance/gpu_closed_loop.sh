#!/usr/bin/env bash
# One device call (a machine of 4 GPUs; NGPU=2 for the first two), issue 41's GPU check.
# The packed schedule (SCHEDULE=lockstep for the other) for two epochs of SAMPLES synthetic wan21_480p
# samples, wan-1.3b, the recipes' eager settings, planned from a starting cost model:
#   START=default  CostModel.default() (the recipes' cost_model: null: a fit of one H100), so on H200s the
#                  starting model is another GPU's;
#   START=linear   a deliberately wrong model, linear in tokens ({"kind": "power", "p": 1.0}), which prices
#                  a 32,760-token clip like 21 images of 1,560 tokens.
# MIX (wan21_480p by default; native_480p: every sample its own shape, where packs of equal tokens differ
# most in compute, so a wrong model costs the most there).
# Twice: the cost refit on (the monitor and a ClosedLoop: refitted at the end of epoch 1, epoch 2 planned
# with it) and off (the monitor alone, the control: both epochs with the starting model). Then
# benchmarks/balance/closed_loop_report.py: each epoch's straggler wait, and the refit's error beside the starting model's. Comes back in $OUT:
# closed_loop_<start>_<mix>.{log,json,tgz} (both runs' monitor files and
# configs). Carry .whl (see docs/load_balance_report.md).
#   NGPU=2 SAMPLES=144 MIX=native_480p SCHEDULE=packed START=linear TOTAL=560 bash benchmarks/balance/gpu_closed_loop.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s]"; }
NGPU=${NGPU:-4}; SAMPLES=${SAMPLES:-64}; SCHEDULE=${SCHEDULE:-packed}; TOTAL=${TOTAL:-560}; START=${START:-default}; MIX=${MIX:-wan21_480p}
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
OUT=${OUT:-/tmp/gpu_closed_loop}; mkdir -p "$OUT"
TAG=${START}_${MIX}
exec > >(tee -a "$OUT/closed_loop_${TAG}.log") 2>&1
case "$SCHEDULE" in packed|lockstep) ;; *) echo "SCHEDULE must be packed or lockstep"; exit 2 ;; esac
case "$START" in
  default) start_set=() ;;
  linear) start_set=(--set 'data.init_args.batching.cost_model={"kind": "power", "p": 1.0}') ;;
  *) echo "START must be default or linear, got $START"; exit 2 ;;
esac
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
    || { echo "pip install of .whl failed"; exit 1; }
  export PYTHONPATH="$HOME/site:$PWD"
else
  echo "warning: no .whl/ carried; LightningCLI needs jsonargparse and the data path webdataset"; export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
# The op's library is built once here, not by every rank at import.
timeout 150 python3 -m lightning_adaptiveload build-ops 2>&1 | tail -2
RUN=/tmp/closed_loop_$TAG; rm -rf "$RUN"; mkdir -p "$RUN"
python3 benchmarks/balance/ddp_modes.py --shards-only --mix "$MIX" --samples "$SAMPLES" --devices "$NGPU" --out "$RUN" 2>&1 | tail -2
MON='{"class_path": "lightning_adaptiveload.callbacks.load_balance.LoadBalanceMonitor"}'
LOOP='{"class_path": "lightning_adaptiveload.callbacks.closed_loop.ClosedLoop", "init_args": {"refit": true}}'
for variant in on off; do
  [ "$variant" = on ] && budget=$(( ($(left) - 40) / 2 )) || budget=$(( $(left) - 40 ))
  callbacks="[$MON, $LOOP]"; [ "$variant" = off ] && callbacks="[$MON]"
  echo "== refit $variant: $SCHEDULE on $MIX from $START, 2 epochs, $budget s $(el)"
  python3 benchmarks/balance/ddp_modes.py --modes "$SCHEDULE" --mix "$MIX" --devices "$NGPU" --samples "$SAMPLES" --steps 100000 \
    --out "$RUN/$variant" --time-budget-s "$budget" --set trainer.max_epochs=2 "${start_set[@]}" \
    --set "trainer.callbacks=$callbacks" \
    > "$RUN/fit_$variant.log" 2>&1
  echo "rc=$? $(el)"; grep -E "epoch [0-9]+:|refit|Time limit|max_epochs|Error|error" "$RUN/fit_$variant.log" | tail -12
done
python3 benchmarks/balance/closed_loop_report.py "refit_on=$RUN/on/$SCHEDULE" "refit_off=$RUN/off/$SCHEDULE" \
  --out "$OUT/closed_loop_${TAG}.json"
tar czf "$OUT/closed_loop_${TAG}.tgz" -C /tmp --exclude='*.ckpt' "closed_loop_$TAG"
ls -la "$OUT"; echo "== done $(el)"
