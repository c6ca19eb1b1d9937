"""Packed steps on a GPU: the varlen attention path against per-sample computation, and its kernel time.

1. Correctness: the `tiny`-width VideoDiT's packed forward + backward (bf16 autocast, varlen attention) against
   the same samples run one by one (relative L2 error of outputs and of the gradient of every parameter).
2. Kernel time (CUDA events, warm-up, median of 20): `varlen_attn` over a pack of samples of mixed lengths
   against batched SDPA over the same samples padded to one length, at Wan 1.3B's head layout (12 x 128).

Writes benchmarks/results style JSON to --out. Never asserted in a test.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import cuda_event_times  # noqa: E402

from lightning_adaptiveload.models.packing import varlen_attention_available
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig


def _time(fn, reps: int = 20) -> float:
    return statistics.median(cuda_event_times(fn, reps, warmup=3))


def correctness(device: str) -> dict:
    torch.manual_seed(0)
    cfg = VideoDiTConfig.preset("tiny", dim=256, num_heads=2, ffn_dim=512)  # head dim 128, as Wan
    model = VideoDiT(cfg).to(device)
    torch.nn.init.normal_(model.head.head.weight, std=0.02)  # the head starts at zero: give it an output
    shapes = [(16, 5, 16, 24), (16, 1, 30, 20), (16, 9, 8, 8), (16, 3, 12, 28)]
    lat = [torch.randn(s, device=device) for s in shapes]
    t = torch.rand(len(shapes), device=device) * 1000
    text = torch.randn(len(shapes), 7, cfg.text_dim, device=device)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        packed = model.forward_packed(lat, t, text)
        weights = [torch.randn(o.shape, device=device, generator=None) for o in packed]
        loss = sum((o.float() * w).mean() for o, w in zip(packed, weights))
    loss.backward()
    g_packed = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        single = [model(x[None], t[i : i + 1], text[i : i + 1])[0] for i, x in enumerate(lat)]
        loss2 = sum((o.float() * w).mean() for o, w in zip(single, weights))
    loss2.backward()
    g_single = [p.grad.detach() for p in model.parameters()]

    def rel(a, b):
        a, b = a.detach(), b.detach()
        return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))

    return {
        "varlen_available": varlen_attention_available(),
        "shapes": [list(s) for s in shapes],
        "output_rel_l2_max": max(rel(a, b) for a, b in zip(packed, single)),
        "grad_rel_l2_max": max(rel(a, b) for a, b in zip(g_packed, g_single) if b.norm() > 0),
    }


def kernel_time(device: str) -> list[dict]:
    rows = []
    heads, d = 12, 128
    for lens in ([19773, 1560, 1560, 1560, 1560], [8190] * 4, [32760], [1560] * 21):
        total, m = sum(lens), max(lens)
        q, k, v = (torch.randn(total, heads, d, device=device, dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device, dtype=torch.int32)
        row = {"seq_lens": lens, "tokens": total}
        if varlen_attention_available():
            from torch.nn.attention.varlen import varlen_attn

            row["varlen_ms"] = _time(lambda q=q, k=k, v=v, cu=cu, m=m: varlen_attn(q, k, v, cu, cu, m, m))
        qp = torch.randn(len(lens), heads, m, d, device=device, dtype=torch.bfloat16)
        row["sdpa_padded_ms"] = _time(lambda qp=qp: F.scaled_dot_product_attention(qp, qp, qp))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    device = "cuda"
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "correctness": correctness(device),
        "attention_forward": kernel_time(device),
    }
    os.makedirs(args.out, exist_ok=True)
    name = result["device"].lower().replace(" ", "-")
    path = os.path.join(args.out, f"packed_cuda_{name}_{result['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
