"""Does a model whose weights are NaN step at the same speed? (the 2 x H200 packed run of 2026-11-27)

That run's loss was NaN from its third step (a bug since fixed), so its tokens/s were timed on NaN weights.
This times wan-1.3b's forward + backward (bf16 autocast, every block checkpointed, CUDA events, median of 3
after 2 warm-up steps) on one mixed pack (a 20,280-token clip and four images) and one 32,760-token clip,
first with finite weights, then with every weight NaN, in one process. Writes a JSON result to --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from packed_grad_check import PACK_SHAPES, TEXT_LENGTHS  # noqa: E402

from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    cfg = VideoDiTConfig.preset("wan-1.3b", num_layers=args.layers)
    model = VideoDiT(cfg).to(dev)
    model.set_activation_checkpointing(True)
    g = torch.Generator().manual_seed(0)
    pack = [torch.randn(s, generator=g).to(dev) for s in PACK_SHAPES]
    clip = [torch.randn(16, 21, 60, 104, generator=g).to(dev)]
    text = torch.randn(len(pack), 512, cfg.text_dim, generator=g).to(dev)
    mask = torch.zeros(len(pack), 512, dtype=torch.bool, device=dev)
    for i, n in enumerate(TEXT_LENGTHS):
        mask[i, :n] = True

    def step(latents):
        n = len(latents)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            outs = model(latents, torch.full((n,), 500.0, device=dev), text[:n], mask[:n])
        sum(o.float().square().mean() for o in outs).backward()
        model.zero_grad(set_to_none=True)

    def time_ms(latents) -> float:
        for _ in range(2):
            step(latents)
        ms = []
        for _ in range(args.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(latents)
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        return statistics.median(ms)

    rows = {}
    for weights in ("finite", "nan"):
        if weights == "nan":
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
        rows[weights] = {"mixed_pack_ms": time_ms(pack), "clip_ms": time_ms(clip)}
        print(weights, json.dumps(rows[weights]), flush=True)
    result = {
        "benchmark": "nan_speed_check",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "settings": {
            "preset": "wan-1.3b",
            "layers": args.layers,
            "autocast": "bf16",
            "checkpointing": "full",
        },
        "shapes": {"mixed_pack": [list(s) for s in PACK_SHAPES], "clip": [16, 21, 60, 104]},
        "rows": rows,
        "nan_over_finite": {k: rows["nan"][k] / rows["finite"][k] for k in rows["finite"]},
    }
    os.makedirs(args.out, exist_ok=True)
    name = result["device"].lower().replace(" ", "-")
    path = os.path.join(args.out, f"nan_speed_check_{name}_{result['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["nan_over_finite"]), "wrote", path)


if __name__ == "__main__":
    main()
