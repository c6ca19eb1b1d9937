"""Where the time of one small wan-1.3b step goes: GPU kernels or the host issuing them.

Times forward + backward of the ``VideoDiT`` preset (bf16 autocast, activation checkpointing, fused op when
available) for a few (T, H, W, B) with CUDA events, then profiles one step of each with ``torch.profiler``
and reports the sum of GPU kernel time, the host time of the step, and the top CUDA ops. When the kernel sum
is far below the step time, the step is bound by the host (Python, dispatcher, launches), not the GPU.

Writes ``profile_step_<device>_<date>.json`` into ``--out`` (default ``$OUT`` or ``benchmarks/results/``).

    python benchmarks/model/profile_step.py                      # one GPU, about a minute
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import add_out_arg, device_tag


def _step(model, x, t, ctx, mask) -> None:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x, t, ctx, mask)
    F.mse_loss(out.float(), x.float()).backward()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="wan-1.3b")
    ap.add_argument(
        "--shapes",
        default="1x60x104x1,1x60x104x21,21x60x104x1",
        help="TxHxWxB,... latent frames, height, width, batch",
    )
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--reps", type=int, default=3)
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from lightning_adaptiveload.fusion import fuse_norm_modulate
    from lightning_adaptiveload.models import VideoDiT, VideoDiTConfig

    dev = torch.device("cuda")
    cfg = VideoDiTConfig.preset(args.preset)
    torch.manual_seed(0)
    model = VideoDiT(cfg).to(dev).train()
    model.set_activation_checkpointing(not args.no_checkpointing)
    fused = fuse_norm_modulate(model, verify=False).num_sites
    torch.nn.init.normal_(model.head.head.weight, std=0.02)
    rows = []
    for spec in args.shapes.split(","):
        t_, h, w, b = (int(v) for v in spec.split("x"))
        x = torch.randn(b, cfg.in_channels, t_, h, w, device=dev)
        ts = torch.rand(b, device=dev) * 1000
        ctx = torch.randn(b, args.text_len, cfg.text_dim, device=dev)
        mask = torch.ones(b, args.text_len, dtype=torch.bool, device=dev)
        for _ in range(2):
            _step(model, x, ts, ctx, mask)
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        gpu_ms, host_ms = [], []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            _step(model, x, ts, ctx, mask)
            host_ms.append(1e3 * (time.perf_counter() - t0))  # until backward() returns (host side)
            end.record()
            end.synchronize()
            gpu_ms.append(start.elapsed_time(end))
            model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _step(model, x, ts, ctx, mask)
            torch.cuda.synchronize()
        model.zero_grad(set_to_none=True)
        events = prof.key_averages()
        # Kernels are the events on the device; the aten ops that launched them carry the same time again as
        # their "self device time", so only device events are summed.
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        kernel_ms = sum(e.self_device_time_total for e in kernels) / 1e3
        launches = sum(e.count for e in kernels)
        top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
        ops = sorted(
            (e for e in events if e.device_type == DeviceType.CPU and e.key.startswith("aten::")),
            key=lambda e: -e.count,
        )[:8]
        row = {
            "T": t_,
            "H": h,
            "W": w,
            "B": b,
            "tokens": b * t_ * (h // 2) * (w // 2),
            "step_ms_median": statistics.median(gpu_ms),
            "host_ms_median": statistics.median(host_ms),
            "kernel_ms_sum": kernel_ms,
            "kernel_share": kernel_ms / statistics.median(gpu_ms),
            "kernel_launches": launches,
            "top_kernels": [
                {"kernel": e.key[:100], "ms": e.self_device_time_total / 1e3, "count": e.count} for e in top
            ],
            "most_called_aten_ops": [{"op": e.key, "count": e.count} for e in ops],
        }
        rows.append(row)
        print(
            f"T={t_:>2} {h}x{w} B={b:>2} tokens={row['tokens']:>6}: step {row['step_ms_median']:8.1f} ms, host "
            f"{row['host_ms_median']:8.1f} ms, GPU kernels {kernel_ms:8.1f} ms ({100 * row['kernel_share']:.0f}%), "
            f"{launches} kernels",
            flush=True,
        )
        for e in row["top_kernels"][:5]:
            print(f"    {e['ms']:8.2f} ms  x{e['count']:<5} {e['kernel']}")
        print(
            "    most called: "
            + ", ".join(f"{e['op']} x{e['count']}" for e in row["most_called_aten_ops"][:5])
        )
    os.makedirs(args.out, exist_ok=True)
    name = torch.cuda.get_device_name(0)
    tag = device_tag(name)
    path = os.path.join(args.out, f"profile_step_{tag}_{_dt.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(
            {
                "benchmark": "benchmarks/model/profile_step.py",
                "device": name,
                "torch": torch.__version__,
                "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
                "preset": args.preset,
                "fused_sites": fused,
                "activation_checkpointing": not args.no_checkpointing,
                "text_len": args.text_len,
                "rows": rows,
            },
            f,
            indent=1,
        )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
