"""Per-bucket step-time trace of our wan-1.3b VideoDiT on one GPU (the simulator's measured input).

For every unique latent (T, H, W) of a length mix (default ``wan21_480p``), time forward + backward of the
``VideoDiT`` ``wan-1.3b`` preset (bf16 autocast, activation checkpointing, the fused LayerNorm-Modulate op
when it is available) at the batch sizes the batching modes use: the equal-token batch ``max_tokens // S``
and B = 1 (so the simulator can interpolate the dual modes' batch sizes in between). Timing: CUDA events
around one forward + backward, after warm-up, median of a few repetitions; peak allocated memory per
measurement. Forward + backward only (no optimizer step), as the anchor trace
(``shared/anchors/trace_wan13b_h100_2026-11-22.txt``).

Writes JSONL in the anchor trace's format, one line per (T, H, W, B), flushed as it goes, so a run cut short
still leaves what it measured::

    {"T": 21, "H": 60, "W": 104, "S": 32760, "B": 1, "tokens": 32760, "ms": 2743.1, "ms_per_sample": ...,
     "peak_gb": 12.3, "reps_ms": [...], "fused": true}

plus a leading ``# meta {...}`` line (device, torch, settings) and a trailing ``# fit ...`` line. Read it
with ``lightning_adaptiveload.tools.simulate.StepTimeTable.from_jsonl``.

Run (one H100, < 4 minutes with the defaults; prebuild the fused op first so the build is not timed)::

    python -m lightning_adaptiveload build-ops
    python benchmarks/balance/gpu_trace_wan13b.py                   # writes to $OUT/ or benchmarks/results/
    python benchmarks/balance/gpu_trace_wan13b.py --out trace.jsonl --reps 3
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


def _fusion_state(model: torch.nn.Module, want: bool) -> dict:
    """Switch on the fused op where possible; say which implementation will run."""
    state = {"requested": want, "fused_sites": 0, "backend": "eager", "report": ""}
    if not want:
        return state
    try:
        from lightning_adaptiveload.fusion import fuse_norm_modulate

        report = fuse_norm_modulate(model, verify=False)
        state["fused_sites"] = report.num_sites + sum(report.already_fused.values())
        state["report"] = str(report)
    except Exception as err:  # the op is optional here: measure eager rather than nothing
        state["report"] = f"fusion failed: {type(err).__name__}: {err}"
        return state
    from lightning_adaptiveload import ops

    status = getattr(ops, "fused_op_status", None)
    if status is None:
        state["backend"] = "reference (this version has no CUDA op)"
    else:
        ok, detail = status()  # builds the kernels on first use (cached); prebuild: build-ops
        state["backend"] = f"cuda kernels ({detail})" if ok else f"reference: {detail}"
    return state


def _buckets(mix_name: str, patch: tuple[int, int, int]) -> list[tuple[int, int, int, int, int]]:
    """Unique (C, T, H, W, S) of the mix, longest first (so the slowest are measured while time remains)."""
    from lightning_adaptiveload.shards.mixes import load_mix

    mix = load_mix(mix_name)
    seen = {}
    for b in mix.buckets:
        c, t, h, w = b.latent_shape
        seen[(t, h, w)] = (c, t, h, w, b.tokens_for(patch))
    return sorted(seen.values(), key=lambda v: -v[4])


def _step(model, x, t, ctx, mask) -> None:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
        out = model(x, t, ctx, mask)
    # Rectified-flow style target; the value does not matter for timing, the shapes do.
    loss = F.mse_loss(out.float(), x.float())
    loss.backward()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mix", default="wan21_480p")
    ap.add_argument("--preset", default="wan-1.3b")
    ap.add_argument("--max-tokens", type=int, default=32760, help="equal-token cap: B = max_tokens // S")
    ap.add_argument(
        "--extra-b", type=int, nargs="*", default=[1], help="batch sizes measured besides the cap's"
    )
    ap.add_argument("--reps", type=int, default=2, help="timed repetitions per measurement (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--text-len", type=int, default=512, help="text states per sample (umT5: 512)")
    ap.add_argument("--no-fused", action="store_true", help="time the eager norm + modulate")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--time-budget-s", type=float, default=200.0, help="stop measuring after this long")
    ap.add_argument("--out", default=None, help="JSONL path (default: $OUT/ or benchmarks/results/)")
    ap.add_argument("--device", default="cuda", help="'cpu' only for a smoke test (--preset tiny --mix tiny)")
    args = ap.parse_args(argv)

    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: this benchmark needs a CUDA GPU (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    from lightning_adaptiveload.models import VideoDiT, VideoDiTConfig

    started = time.perf_counter()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = VideoDiTConfig.preset(args.preset)
    torch.manual_seed(0)
    model = VideoDiT(cfg).to(dev)
    model.train()
    model.set_activation_checkpointing(not args.no_checkpointing)
    fusion = _fusion_state(model, not args.no_fused)
    # The time budget covers the measurements, not a first build of the CUDA kernels.
    started = time.perf_counter()
    # Wan zero-initialises the output projection; random weights keep every gradient of the backward
    # non-zero, as in a trained model (the work is the same, the numbers are realistic).
    torch.nn.init.normal_(model.head.head.weight, std=0.02)

    date = _dt.date.today().isoformat()
    tag = "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")
    out = args.out
    if out is None:
        folder = os.environ.get("OUT") or os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results"
        )
        os.makedirs(folder, exist_ok=True)
        out = os.path.join(folder, f"trace_{args.preset.replace('.', '')}_{tag}_{date}.jsonl")
    meta = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": date,
        "preset": args.preset,
        "params": model.num_parameters(),
        "mix": args.mix,
        "max_tokens": args.max_tokens,
        "dtype": "bf16 autocast, fp32 params" if cuda else "fp32 (cpu smoke test)",
        "activation_checkpointing": not args.no_checkpointing,
        "fusion": fusion,
        "text_len": args.text_len,
        "reps": args.reps,
        "warmup": args.warmup,
        "timing": ("CUDA events" if cuda else "perf_counter") + " around forward+backward, median",
    }
    print(json.dumps(meta, indent=1))
    rows = []
    skipped = []
    with open(out, "w", encoding="utf-8") as f:
        f.write("# meta " + json.dumps(meta) + "\n")
        f.flush()
        plan = []
        for c, t, h, w, s in _buckets(args.mix, cfg.patch_size):
            bs = sorted(
                {max(1, args.max_tokens // s), *[b for b in args.extra_b if b * s <= args.max_tokens]}
            )
            plan.extend((c, t, h, w, s, b) for b in bs)
        for c, t, h, w, s, b in plan:
            if time.perf_counter() - started > args.time_budget_s:
                skipped.append({"T": t, "H": h, "W": w, "B": b})
                continue
            g = torch.Generator(device=dev).manual_seed(t * 1000 + h + w + b)
            x = torch.randn(b, c, t, h, w, device=dev, generator=g)
            ts = torch.rand(b, device=dev, generator=g) * 1000
            ctx = (
                torch.randn(b, args.text_len, cfg.text_dim, device=dev, generator=g)
                if args.text_len
                else None
            )
            mask = torch.ones(b, args.text_len, dtype=torch.bool, device=dev) if args.text_len else None
            for _ in range(args.warmup):
                _step(model, x, ts, ctx, mask)
                model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(args.reps):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    _step(model, x, ts, ctx, mask)
                    end.record()
                    end.synchronize()
                    times.append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    _step(model, x, ts, ctx, mask)
                    times.append(1e3 * (time.perf_counter() - t0))
                model.zero_grad(set_to_none=True)
            ms = statistics.median(times)
            rec = {
                "T": t,
                "H": h,
                "W": w,
                "S": s,
                "B": b,
                "tokens": b * s,
                "ms": ms,
                "ms_per_sample": ms / b,
                "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                "reps_ms": times,
                "fused": fusion["fused_sites"] > 0 and fusion["backend"].startswith("cuda"),
            }
            rows.append(rec)
            f.write(json.dumps(rec) + "\n")
            f.flush()
            mem = "" if rec["peak_gb"] is None else f"  {rec['peak_gb']:.1f} GiB"
            print(f"T={t:>2} H={h:>3} W={w:>3} S={s:>6} B={b:>2}: {ms:8.1f} ms{mem}", flush=True)
            del x, ctx, mask
        if skipped:
            f.write("# skipped (time budget) " + json.dumps(skipped) + "\n")
        if len({r["S"] for r in rows}) >= 3:
            from lightning_adaptiveload.planning.cost_model import CostModel

            fit = CostModel.fit(
                [r["S"] for r in rows],
                [r["ms"] / 1e3 for r in rows],
                kind="quadratic",
                batch_sizes=[r["B"] for r in rows],
            )
            f.write(f"# fit s/sample = {fit.describe()}  ({fit.fit_info})\n")
            eq = [r for r in rows if r["B"] == max(1, args.max_tokens // r["S"])]
            if eq:
                lo, hi = min(r["ms"] for r in eq), max(r["ms"] for r in eq)
                f.write(f"# equal-token batch times (ms): min {lo:.0f} max {hi:.0f} ratio {hi / lo:.2f}\n")
    print(
        f"wrote {out} ({len(rows)} measurements, {len(skipped)} skipped, {time.perf_counter() - started:.0f} s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
