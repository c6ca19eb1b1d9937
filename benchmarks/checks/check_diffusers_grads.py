"""One block of diffusers' Wan (``WanTransformer3DModel``, wan-1.3b's sizes, random weights) at training size,
compiled, against eager mode: with PyTorch's own inductor settings (``torch``) and with ``compile_blocks``'
(``safe``: inductor's mix-order reductions off, ``acceleration.SAFE_REDUCTIONS``).

The upstream report of pytorch/pytorch#193061 found diffusers' shared ``scale_shift_table`` gradients wrong
under compile with torch 2.10; this measures it on the device's torch. The block's inputs come from one
forward of a one-layer model (``compile_check.capture_inputs``), the comparison from
``compile_check.compare_compiled``: the largest difference of the output and of every gradient, relative to
the eager value's largest magnitude, under bf16 autocast (about 1e-2 is rounding). A correctness check, not a
benchmark. Needs diffusers. Writes ``check_diffusers_grads_<device>_<date>.json``.

    python benchmarks/checks/check_diffusers_grads.py [--batch 1] [--latent 21,60,104] [--settings torch,safe]
        [--weights fp32|bf16]
    python benchmarks/checks/check_diffusers_grads.py --device cpu --preset tiny --latent 2,8,8 --text-len 8  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import add_out_arg, device_tag, diffusers_wan, write_json  # noqa: E402

from lightning_adaptiveload.models.acceleration import SAFE_REDUCTIONS  # noqa: E402
from lightning_adaptiveload.models.compile_check import CompileSettings, capture_inputs, compare_compiled  # noqa: E402
from lightning_adaptiveload.models.video_dit import VideoDiTConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument(
        "--latent", default="21,60,104", help="latent frames, height, width (before 1x2x2 patches)"
    )
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--preset", default="wan-1.3b", help="the sizes, from VideoDiTConfig's presets")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--weights", choices=("fp32", "bf16"), default="fp32", help="the model's parameter dtype")
    ap.add_argument(
        "--settings", default="torch,safe", help="torch (PyTorch's defaults), safe (compile_blocks')"
    )
    add_out_arg(ap)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = VideoDiTConfig.preset(args.preset)
    T, H, W = (int(v) for v in args.latent.split(","))
    torch.manual_seed(0)
    model = (
        diffusers_wan(cfg, cfg.text_dim, num_layers=1)
        .to(dev, torch.bfloat16 if args.weights == "bf16" else torch.float32)
        .train()
    )
    with torch.no_grad():  # away from the init (zero-initialised layers would hide their paths)
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    B = args.batch
    x = torch.randn(B, cfg.in_channels, T, H, W, device=dev)
    ctx = torch.randn(B, args.text_len, cfg.text_dim, device=dev)
    timestep = torch.full((B,), 500, device=dev)
    block = model.blocks[0]
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        block_args, block_kwargs = capture_inputs(
            block,
            lambda: model(hidden_states=x, timestep=timestep, encoder_hidden_states=ctx, return_dict=False),
        )
    tokens = T * (H // 2) * (W // 2)
    report = {}
    for label in args.settings.split(","):
        torch._dynamo.reset()
        diffs = compare_compiled(
            block,
            block_args,
            block_kwargs,
            settings=CompileSettings(safe_reductions=label == "safe"),
            ignore=["k.bias"],
        )
        worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:6]
        print(f"{label:6s} worst: " + ", ".join(f"{k} {v:.1e}" for k, v in worst), flush=True)
        report[label] = dict(inductor_options=SAFE_REDUCTIONS if label == "safe" else {}, rel_diff=diffs)
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    import diffusers

    out = dict(
        check="benchmarks/checks/check_diffusers_grads.py",
        device=name,
        torch=torch.__version__,
        diffusers=diffusers.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        batch=B,
        latent=[T, H, W],
        tokens=tokens,
        text_len=args.text_len,
        preset=args.preset,
        weights=args.weights,
        what="max |compiled - eager| / max |eager| per output and gradient of blocks[0], bf16 autocast",
        settings=report,
    )
    tag = f"b{B}_{args.weights}"
    write_json(args.out, f"check_diffusers_grads_{device_tag(name)}_{datetime.date.today()}_{tag}.json", out)


if __name__ == "__main__":
    main()
