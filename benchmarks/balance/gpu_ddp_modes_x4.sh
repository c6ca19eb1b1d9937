#!/usr/bin/env bash
# One device call (at most TOTAL = 560 s of its 600) on a machine of 4 GPUs (NGPU=2: the first 2 of them):
# the real DDP comparison of the schedules with benchmarks/balance/ddp_modes.py (equal_tokens, dual, lockstep,
# packed; wan-1.3b, 480p, the same max_tokens 32,760 in every mode), then benchmarks/balance/ddp_modes_report.py
# (measured beside the simulator's prediction for the same settings), then the run folder as one tarball.
#
#   SETTINGS  fast (the recipes as shipped: compile, bf16 weights with MasterWeightAdamW, save_matmuls with
#             checkpoint_blocks auto, attention auto, expandable segments) or eager (compile off, fp32
#             weights, every block checkpointed)
#   NGPU      4 (default) or 2
#   MODES     comma-separated, default all four; split them over calls for more steps per mode
#   STEPS     optimizer steps per mode; default: as many as fit in what is left after the build and the data,
#             estimated at 3.2 s a step eager and 2.1 s fast (a 32,760-token step, all-reduce and optimizer
#             included) plus, per mode, 45 s of start-up (105 s fast: the first compile) and 20 s for the end
#             of fit; at least 10. trainer.max_time ends each mode in its share of the call in any case
#             epoch: one whole epoch per mode (ddp_modes.py --epochs 1), so that every mode trains on the same
#             samples (4 GPUs, 512 samples: about 100 steps); one mode per call fast
#   SAMPLES   synthetic samples (768, ~4 GB); keep it the same for every call of one table
#   SET       extra CLI overrides, space-separated KEY=VALUE (e.g. model.init_args.memory.memory_budget_gib=64)
#   TOTAL     seconds this script may take (560)
#   VARIANT   a name for a variant of the settings (with SET), e.g. VARIANT=onebucket
#             SET="trainer.strategy.init_args.bucket_cap_mb=100000" (DDP's gradients in one bucket: no
#             all-reduce overlapping the backward); its run folder and tag get the name, so that a warm
#             machine keeps the default run and the variant apart
#   REPORT    0: skip the report on the device (its 40 s go to steps); run ddp_modes_report.py on the host over
#             the extracted tarballs instead
#   DIAG      1: TORCH_LOGS=recompiles for the runs, and after them each recompile's guard failure counted,
#             beside the monitor's compiling steps (compiles_rank0) and the report's stalls: is a stall a compile?
#             The monitor also dumps every thread's stack while a step runs over 4 s (stall_stacks_s), and
#             stall_stacks_summary.py prints each slow step's innermost frames.
#   CLOCKS    1: nvidia-smi logs every GPU's SM and memory clocks, power, temperature, utilization and clock
#             event reasons every 250 ms while the runs train ($RUN/gpu_clocks_<tag>.csv; without the reasons
#             where the driver rejects clocks_event_reasons.active), beside the power limits and max clocks
#             ($RUN/gpu_limits_<tag>.txt); after the runs, gpu_clocks_summary.py writes
#             $RUN/gpu_clocks_summary_<tag>.json and gpu_clocks_<tag>.png into the run folder (the tarball):
#             is the rank-to-rank noise power-capped clocks? Default 0: no logger.
#   PROBE     1: benchmarks/balance/step_probe.py's StepProbe beside the monitor: per step and rank the GPU
#             and host times of forward, backward and optimizer and the GC pauses; PROBE_STEPS=first,last
#             (default 40,80) profiles every other step of that window with torch.profiler (kernel time by
#             name, idle gaps; the slowest and fastest profiled steps' traces kept). After the runs,
#             step_probe_summary.py prints where slow steps of identical work lose their time.
#   ALIGNED_GC 1: lightning_adaptiveload.AlignedGC beside the monitor (no automatic garbage collection
#             during the fit; every rank collects after the same steps). Run a mode with 0 and 1 on one
#             machine to see what it does to the straggler wait. Default 0. ALIGNED_GC_ARGS: its init_args as
#             JSON, e.g. '{"full_every_n_steps": 20, "log_pauses": true}' (gc/pause_ms in metrics.csv).
#             Tag and run folder _gc.
#   WARMUP    0: without lightning_adaptiveload.KernelWarmup, which the wan-1.3b recipes carry (each attention
#             shape of the rank's epoch run once through the first block before the first step, so that cuDNN
#             builds its graphs there and not on the step that first meets the shape; ddp_modes.py keeps the
#             recipes' callbacks but checkpoints). Tag and run folder _nowarm (a warm machine keeps it apart
#             from the default run). Default: the recipes' callbacks.
#
# It refuses at once (exit 3, before any build) a call whose modes cannot get 30 s of steps each, and says
# to split MODES: all four modes fit one call eager (about 12 steps each: a smoke run), not fast. The shards (seed 0) are the same on every call: found in /tmp when the machine is still warm,
# written again identically when not. A warm machine also keeps the run folder, so the second call of a
# split reports on both calls' modes; the tarballs of several calls extract into one folder for the report
# on the union (docs/load_balance_report.md, "Real DDP").
#
# Comes back in $OUT (7 files, flat): ddp_modes_<tag>.log, ddp_modes_<tag>.tgz (the run folder: every mode's
# monitor CSVs and JSON, metrics.csv, config.yaml, the full fit log, runs_*.json, data_index.json, the
# report), and the report's ddp_modes_<tag>_<date>.json and ddp_<tag>_{cv,step_time,loss,throughput}.png.
# Needs .whl carried (webdataset, braceexpand, jsonargparse and what it needs): see the docs.
set -uo pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
el() { echo "[$(($(date +%s) - T0)) s]"; }
SETTINGS=${SETTINGS:-eager}; NGPU=${NGPU:-4}; TOTAL=${TOTAL:-560}; SAMPLES=${SAMPLES:-768}
DIAG=${DIAG:-0}; REPORT=${REPORT:-1}; CLOCKS=${CLOCKS:-0}; PROBE=${PROBE:-0}; PROBE_STEPS=${PROBE_STEPS:-40,80}
ALIGNED_GC=${ALIGNED_GC:-0}; WARMUP=${WARMUP:-}
[ "$DIAG" = 1 ] && export TORCH_LOGS=recompiles
MODES=${MODES:-equal_tokens,dual,lockstep,packed}
left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
case "$SETTINGS" in eager|fast) ;; *) echo "SETTINGS must be eager or fast, got $SETTINGS"; exit 2 ;; esac
OUT=${OUT:-/tmp/gpu_ddp_modes}; mkdir -p "$OUT"
VARIANT=${VARIANT:-}
[[ "$VARIANT" =~ ^[A-Za-z0-9_-]*$ ]] || { echo "VARIANT must be a short name (letters, digits, -, _), got '$VARIANT'"; exit 2; }
KEY=${SETTINGS}_w${NGPU}${VARIANT:+_$VARIANT}  # the run folder: the settings, not the modes of this call
[ "$ALIGNED_GC" = 1 ] && KEY=${KEY}_gc
[ "$WARMUP" = 0 ] && KEY=${KEY}_nowarm
TAG=$KEY
[ "$MODES" = equal_tokens,dual,lockstep,packed ] || TAG=${TAG}_${MODES//,/-}
LOG="$OUT/ddp_modes_${TAG}.log"
exec > >(tee -a "$LOG") 2>&1
RUN_BASE=/tmp/ddp_modes; RUN=$RUN_BASE/$KEY; mkdir -p "$RUN"
FILTER='UserWarning|warnings.warn|return Variable|AccumulateGrad|_pytree|it/s\]$|sample/s\]$|^\s*$'

# The plan of the call: fixed costs, then per mode its start-up and 10 steps at least.
nmodes=$(echo "$MODES" | tr ',' '\n' | grep -c .)
if [ "$SETTINGS" = eager ]; then step_ms=3200; start_s=45; else step_ms=2100; start_s=105; fi
build_s=40
END_S=20     # the end of a fit (the monitor's files and plots, the processes' exit): ddp_modes.py's margin
REPORT_S=40  # the report, the tarball and the copies
[ "$REPORT" = 0 ] && REPORT_S=15
[ "$CLOCKS" = 1 ] && REPORT_S=$(( REPORT_S + 10 ))  # the clocks summary and its plot
shards_s=75; ls /tmp/adaptiveload_ddp_modes_shards/wan21_480p_n${SAMPLES}_seed0_*/index.json > /dev/null 2>&1 && shards_s=10
need=$(( 10 + build_s + shards_s + REPORT_S + nmodes * (start_s + END_S + 30) ))
echo "== ddp_modes: settings $SETTINGS, $NGPU GPUs, modes $MODES, tag $TAG; needs >= $need s of $TOTAL $(el)"
if [ "$need" -gt "$TOTAL" ]; then
  echo "does not fit: $nmodes mode(s) need $need s for 30 s of steps each; split MODES over calls, e.g."
  echo "  MODES=equal_tokens,lockstep SETTINGS=$SETTINGS NGPU=$NGPU bash $0, then MODES=dual,packed"
  exit 3
fi

if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" .whl/*.whl \
    || { echo "pip install of .whl failed"; exit 1; }
  export PYTHONPATH="$HOME/site:$PWD"
else
  echo "warning: no .whl/ carried; LightningCLI needs jsonargparse and the data path webdataset"
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
have=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
[ "$have" -ge "$NGPU" ] || { echo "NGPU=$NGPU but this machine has $have GPUs"; exit 2; }

# The op's library loads when the package is imported on a GPU (a user's cached build); built once here so
# that no rank builds it at import.
echo "== build-ops $(el)"; timeout 150 python3 -m lightning_adaptiveload build-ops 2>&1 | tail -2
echo "== shards $(el)"
python3 benchmarks/balance/ddp_modes.py --shards-only --samples "$SAMPLES" --devices "$NGPU" --out "$RUN" 2>&1 \
  | grep -Ev "$FILTER" | tail -3

budget=$(( $(left) - REPORT_S ))
epoch=(); [ "${STEPS:-}" = epoch ] && { epoch=(--epochs 1); STEPS=0; }
if [ -z "${STEPS:-}" ]; then
  STEPS=$(( (budget - nmodes * (start_s + END_S)) * 1000 / (nmodes * step_ms) ))
  [ "$STEPS" -ge 10 ] || STEPS=10
fi
if [ ${#epoch[@]} -gt 0 ]; then
  echo "== $nmodes mode(s), one whole epoch each (trainer.max_time may end it first), $budget s for the runs $(el)"
else
  echo "== $nmodes mode(s), $STEPS steps each, $budget s for the runs $(el)"
fi
[ ${#epoch[@]} -gt 0 ] || [ "$STEPS" -ge 30 ] || echo "note: fewer than 30 steps per mode is a smoke run; split MODES over calls for the table"
FIT_LOG="$RUN/fit_${TAG}.log"
sets=(); for kv in ${SET:-}; do sets+=(--set "$kv"); done
[ "$DIAG" = 1 ] && sets+=(--stall-stacks-s 4)
[[ "$PROBE_STEPS" =~ ^[0-9]+,[0-9]+$ ]] || { echo "PROBE_STEPS must be first,last, got '$PROBE_STEPS'"; exit 2; }
[ "$PROBE" = 1 ] && sets+=(--callback "{\"class_path\": \"benchmarks.balance.step_probe.StepProbe\", \"init_args\": {\"profile_steps\": [$PROBE_STEPS]}}")
[ "$ALIGNED_GC" = 1 ] && sets+=(--callback "{\"class_path\": \"lightning_adaptiveload.AlignedGC\", \"init_args\": ${ALIGNED_GC_ARGS:-{\}}}")
[ "$WARMUP" = 0 ] && sets+=(--without KernelWarmup)
CLOCKS_PID=
stop_clocks() {
  [ -n "$CLOCKS_PID" ] || return 0
  kill "$CLOCKS_PID" 2> /dev/null; wait "$CLOCKS_PID" 2> /dev/null; CLOCKS_PID=
}
if [ "$CLOCKS" = 1 ]; then
  trap stop_clocks EXIT  # an early exit (or a kill) stops the logger too
  CLOCKS_CSV="$RUN/gpu_clocks_${TAG}.csv"
  query=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu
  if nvidia-smi --query-gpu="$query,clocks_event_reasons.active" --format=csv,noheader -i 0 > /dev/null 2>&1; then
    query="$query,clocks_event_reasons.active"
  else
    echo "note: this nvidia-smi rejects clocks_event_reasons.active; logging clocks without the reasons"
  fi
  CLOCKS_LIMITS="$RUN/gpu_limits_${TAG}.txt"
  nvidia-smi --query-gpu=power.limit,clocks.max.sm,clocks.applications.graphics --format=csv > "$CLOCKS_LIMITS" \
    || nvidia-smi --query-gpu=power.limit,clocks.max.sm --format=csv > "$CLOCKS_LIMITS" || rm -f "$CLOCKS_LIMITS"
  nvidia-smi --query-gpu="$query" --format=csv -lms 250 > "$CLOCKS_CSV" &
  CLOCKS_PID=$!
  echo "== clocks: nvidia-smi every 250 ms into $CLOCKS_CSV (pid $CLOCKS_PID) $(el)"
fi
python3 benchmarks/balance/ddp_modes.py --settings "$SETTINGS" --devices "$NGPU" --modes "$MODES" --steps "$STEPS" "${epoch[@]}" \
  --samples "$SAMPLES" --out "$RUN" --time-budget-s "$budget" "${sets[@]}" > "$FIT_LOG" 2>&1
echo "ddp_modes rc=$? $(el)"
if [ "$CLOCKS" = 1 ]; then
  stop_clocks
  echo "== clocks: $(wc -l < "$CLOCKS_CSV") lines $(el)"
  limits=(); [ -s "$CLOCKS_LIMITS" ] && limits=(--limits "$CLOCKS_LIMITS")
  timeout 60 python3 benchmarks/balance/gpu_clocks_summary.py "$CLOCKS_CSV" "${limits[@]}" \
    --json "$RUN/gpu_clocks_summary_${TAG}.json" --plot "$RUN/gpu_clocks_${TAG}.png" 2>&1 | tail -25
fi
grep -Ev "$FILTER" "$FIT_LOG" | tail -120
if [ "$PROBE" = 1 ]; then
  echo "== step probe $(el)"
  timeout 60 python3 benchmarks/balance/step_probe_summary.py "$RUN" --json "$RUN/step_probe_summary_${TAG}.json" 2>&1 | tail -60
fi
if [ "$DIAG" = 1 ]; then
  echo "== recompiles (rank 0 and others; the guard that failed, counted)"
  echo "recompiles logged: $(grep -c "Recompiling function" "$FIT_LOG")"
  grep -h -A4 "Recompiling function" "$FIT_LOG" | grep -E -- '^[[:space:]]+- ' | sed 's/^[[:space:]]*- //' \
    | sort | uniq -c | sort -rn | head -20
  for f in "$RUN"/*/logs/version_*/load_balance.json; do
    python3 -c "import json,sys; m=json.load(open(sys.argv[1]))['summary']['meta']; print(sys.argv[1].split('/')[-4], 'compiles_rank0', m.get('compiles_rank0'))" "$f"
  done
  echo "== slow steps' stacks (rank files under the run folder)"
  python3 benchmarks/balance/stall_stacks_summary.py "$RUN" --frames 10 --steps 6 2>&1 | head -400
fi
if [ "$REPORT" != 0 ]; then
  echo "== report $(el)"
  rm -rf "$RUN/report"
  timeout $(( $(left) - 15 )) python3 benchmarks/balance/ddp_modes_report.py "$RUN" --results "$RUN/report" --img "$RUN/report" \
    --tag "$TAG" --simulate 8,16 2>&1 | tail -60
fi
echo "== tarball $(el)"
tar czf "$OUT/ddp_modes_${TAG}.tgz" -C "$RUN_BASE" "$(basename "$RUN")"
for f in "$RUN"/report/ddp_modes_"${TAG}"_*.json "$RUN"/report/ddp_"${TAG}"_*.png; do
  [ -f "$f" ] && cp "$f" "$OUT/"
done
ls -la "$OUT"
echo "== done $(el)"
