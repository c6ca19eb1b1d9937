"""Peak GPU memory of one packed training step of wan-1.3b at the calibrated 131,040 tokens, beside a bucketed
batch of the same tokens (issue 15: packs of 131,040 tokens ran out of memory in ``calibrate`` on an H100).

Full activation checkpointing, the fused op, bf16 autocast, fp32 weights, text of 256 tokens per sample.
Writes ``packed_memory_<device>.json`` under ``--out``. Usage: ``python benchmarks/model/packed_memory.py --out DIR``.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from lightning_adaptiveload.fusion import fuse_norm_modulate
from lightning_adaptiveload.models import VideoDiT, VideoDiTConfig

CASES = {  # name -> list of (count, latent shape (C, T, H, W))
    "bucketed: 4 clips (131,040 tokens)": [(4, (16, 21, 60, 104))],
    "pack: 86 images (130,806 tokens)": [(86, (16, 1, 78, 78))],
    "pack: clip + 64 images (130,104 tokens)": [(1, (16, 21, 60, 104)), (64, (16, 1, 78, 78))],
    "pack: 4 clips (131,040 tokens)": [(4, (16, 21, 60, 104))],
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--text-len", type=int, default=256)
    args = ap.parse_args()
    dev = torch.device("cuda")
    cfg = VideoDiTConfig.preset("wan-1.3b")
    model = VideoDiT(cfg).to(dev).train()
    model.set_activation_checkpointing(True)
    fuse_norm_modulate(model, verify=False)
    rows = {}
    for name, spec in CASES.items():
        shapes = [s for n, s in spec for _ in range(n)]
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        try:
            ctx = torch.randn(len(shapes), args.text_len, cfg.text_dim, device=dev)
            t = torch.rand(len(shapes), device=dev) * 1000
            with torch.autocast("cuda", dtype=torch.bfloat16):
                if name.startswith("bucketed"):
                    x = torch.randn(len(shapes), *shapes[0], device=dev)
                    out = model(x, t, ctx)
                    loss = out.float().square().mean()
                else:
                    xs = [torch.randn(*s, device=dev) for s in shapes]
                    outs = model.forward_packed(xs, t, ctx)
                    loss = sum(o.float().square().sum() for o in outs) / sum(o.numel() for o in outs)
            loss.backward()
            torch.cuda.synchronize()
            rows[name] = {
                "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                "above_weights_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
                "seconds": time.perf_counter() - t0,
            }
        except torch.OutOfMemoryError:
            rows[name] = {"error": "OOM", "peak_gib": torch.cuda.max_memory_allocated() / 2**30}
        model.zero_grad(set_to_none=True)
        print(name, rows[name], flush=True)
    result = {
        "benchmark": "packed_memory",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "settings": "wan-1.3b, fp32 weights, bf16 autocast, full activation checkpointing, fused op, text 256",
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    with open(os.path.join(args.out, f"packed_memory_{name}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
