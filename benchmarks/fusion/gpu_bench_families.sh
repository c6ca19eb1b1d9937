#!/usr/bin/env bash
# One device call on one H200 (issue 59): the diffusers DiT families x {eager, eager fused, compiled,
# compiled fused}, one training step each at a realistic shape (benchmarks/fusion/bench_families.py).
# Needs diffusers from the carried wheels (./.whl, made by ../shared/tools/device-wheels.sh; carry ".whl").
# Usage (device tool, from the repository root):
#   bash benchmarks/fusion/gpu_bench_families.sh
#   FAMILIES="hunyuan pixart dit sana" PHASES=compiled bash benchmarks/fusion/gpu_bench_families.sh  # what a
#       first call left for lack of time (its log ends with this line); then, here:
#   python benchmarks/fusion/bench_families.py --merge first.json second.json
# Settings (environment): FAMILIES, PHASES (eager compiled), LAYERS (2), EXTRA (more bench_families.py
# arguments, e.g. "--dynamic false" or "--attention cudnn"), TOTAL (seconds for the whole call, default 570),
# BUILD=0 (do not build the fused op first).
# The eager phase of every family runs first, then the compiled phase, family by family, until the time
# budget is spent; the JSON is rewritten after each family. A second call on the still-warm machine reuses
# the fused op's build (~/.cache/lightning_adaptiveload) and inductor's cache (/tmp/torchinductor_$USER).
# $OUT gets: bench_families.tar.gz (the whole run folder), the JSON, the log and build.log (the GPU machine
# returns at most 8 files).
GPU_JOB=bench_families; TOTAL=${TOTAL:-570}
source "$(dirname "$0")/../_gpu_preamble.sh"
WHL=.whl; [ -d "$WHL" ] || WHL=../.whl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$HOME/site" "$WHL"/*.whl \
  && export PYTHONPATH="$HOME/site:$PWD" || { echo "no diffusers wheels in ./.whl (carry .whl)"; exit 1; }
python3 -c "import torch, diffusers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'diffusers', diffusers.__version__)"
echo "== wheels, build $(el)"
RUN=$HOME/bench_families_run; rm -rf "$RUN"; mkdir -p "$RUN"
[ -f "$OUT/build.log" ] && cp "$OUT/build.log" "$RUN/"
LEFT=$(seconds_left)
BUDGET=$(( LEFT - 110 ))  # the budget stops new work; the last family (a compile) may run past it
# shellcheck disable=SC2086
timeout --signal=TERM --kill-after=5 $(( LEFT - 15 )) python3 benchmarks/fusion/bench_families.py \
  --out "$RUN" --layers "${LAYERS:-2}" --time-budget-s "$BUDGET" \
  ${FAMILIES:+--families $FAMILIES} ${PHASES:+--phases $PHASES} ${EXTRA:-} 2>&1 \
  | grep -v "^USDT\|Mismatch dtype between input and weight\|return torch.rms_norm" | tee "$RUN/bench_families.log"
echo "bench_families rc=${PIPESTATUS[0]} $(el)"
tar czf "$OUT/bench_families.tar.gz" -C "$(dirname "$RUN")" "$(basename "$RUN")"
cp "$RUN/bench_families.log" "$OUT/"
latest=$(ls -t "$RUN"/families_*.json 2>/dev/null | head -1)
[ -n "$latest" ] && cp "$latest" "$OUT/"
ls -la "$OUT"
echo "done $(el)"
