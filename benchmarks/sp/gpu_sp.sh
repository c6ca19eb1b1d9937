#!/usr/bin/env bash
# Ulysses sequence parallelism measured on 4 GPUs of one host (benchmarks/sp/sp_bench.py): degrees 1, 2 and 4
# of one configuration per call, tokens/s, MFU, memory per GPU and balance, one JSON per degree.
#
#   CONFIG   wan13b_480p (wan-1.3b, 480p, DDP, max_tokens 32,760 per GPU; default) or wan14b_720p (wan-14b,
#            720p, FSDP2, max_tokens 75,600 per GPU; degree 1 may run out of memory on 4 GPUs: recorded)
#   DEGREES  comma-separated, default 1,2,4
#   STEPS    timed steps per degree (default 20; wan14b_720p: 4, a step of 81-frame 720p clips takes ~1 min)
#   WARMUP   untimed steps first (default 5; wan14b_720p: 2)
#   NGPU     4
#   TOTAL    seconds this call may take (560); a degree that would not finish in what is left is skipped
#
#   CONFIG=wan13b_480p bash benchmarks/sp/gpu_sp.sh      # one device call
#   CONFIG=wan14b_720p DEGREES=2 bash benchmarks/sp/gpu_sp.sh   # one call per degree for the 14B model
#
# Writes $OUT/sp_<config>_g<G>_<device>_<date>.json and $OUT/sp_<config>_g<G>.log; copy the JSON files into
# benchmarks/results/ (docs/load_balance_report.md, "Sequence parallelism", sets them beside the simulation).
BUILD=${BUILD:-1}
source "$(dirname "$0")/../_gpu_preamble.sh"
CONFIG=${CONFIG:-wan13b_480p}
DEGREES=${DEGREES:-1,2,4}
NGPU=${NGPU:-4}
if [ "$CONFIG" = wan14b_720p ]; then STEPS=${STEPS:-4}; WARMUP=${WARMUP:-2}; PER=${PER:-420}; else
  STEPS=${STEPS:-20}; WARMUP=${WARMUP:-5}; PER=${PER:-150}; fi
for G in ${DEGREES//,/ }; do
  if [ "$(seconds_left)" -lt "$PER" ]; then echo "skip degree $G: $(seconds_left) s left (< $PER) $(el)"; continue; fi
  echo "== $CONFIG degree $G on $NGPU GPUs $(el)"
  timeout $(( $(seconds_left) - 10 )) python3 benchmarks/sp/sp_bench.py --config "$CONFIG" --degree "$G" \
    --gpus "$NGPU" --steps "$STEPS" --warmup "$WARMUP" --out "$OUT" > "$OUT/sp_${CONFIG}_g${G}.log" 2>&1
  echo "degree $G rc=$? $(el)"; tail -3 "$OUT/sp_${CONFIG}_g${G}.log"
done
ls -la "$OUT"
