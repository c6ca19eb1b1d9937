"""One wan-1.3b block at training size, compiled as ``compile_blocks`` compiles it (dynamic shapes, one
graph, inductor's mix-order reductions off: ``acceleration.SAFE_REDUCTIONS``; ``--torch-defaults`` keeps
PyTorch's own settings, as run 21 did), against eager mode: the largest difference of the output and of
every gradient, relative to the eager value's largest magnitude, with the Triton norm kernels off, at the
library's default and all on.

A correctness check, not a benchmark: a compiled block must give eager mode's gradients up to bf16
rounding (about 1e-2 here). Writes ``check_block_grads_<device>_<date>.json``.

    python benchmarks/checks/check_block_grads.py [--batch 1] [--grid 21,30,52] [--checkpoint save_matmuls]
        [--settings none,default,all,rope] [--torch-defaults] [--inductor-option NAME=0|1 ...]
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
from _common import add_out_arg, device_tag, write_json  # noqa: E402

from lightning_adaptiveload.models.acceleration import SAFE_REDUCTIONS  # noqa: E402
from lightning_adaptiveload.models.compile_check import (
    CompileSettings,
    compare_compiled,  # noqa: E402
)
from lightning_adaptiveload.models.layers import rope_3d  # noqa: E402
from lightning_adaptiveload.models.video_dit import DiTBlock, VideoDiTConfig  # noqa: E402
from lightning_adaptiveload.ops import norm_kernels  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--grid", default="21,30,52", help="latent frames, rows, columns after patching")
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--checkpoint", default="save_matmuls", help="the block's policy, or 'none'")
    ap.add_argument("--preset", default="wan-1.3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--settings", default="none,default,all", help="which norm-kernel settings to check")
    ap.add_argument(
        "--torch-defaults", action="store_true", help="PyTorch's own inductor settings, not compile_blocks'"
    )
    ap.add_argument(
        "--inductor-option",
        action="append",
        default=[],
        metavar="NAME=0|1",
        help="an inductor setting for the compiled block, e.g. triton.mix_order_reduction=0 (repeatable)",
    )
    add_out_arg(ap)
    args = ap.parse_args()
    dev = torch.device(args.device)
    cfg = VideoDiTConfig.preset(args.preset)
    grid = tuple(int(v) for v in args.grid.split(","))
    S = grid[0] * grid[1] * grid[2]
    torch.manual_seed(0)
    block = DiTBlock(cfg).to(dev).train()
    with torch.no_grad():  # away from the init (zero gates would hide the attention and FFN paths)
        for p in block.parameters():
            p.add_(0.02 * torch.randn_like(p))
    block.checkpoint_policy = None if args.checkpoint == "none" else args.checkpoint
    B = args.batch
    x = torch.randn(B, S, cfg.dim, device=dev, requires_grad=True)
    e0 = (0.3 * torch.randn(B, 6, cfg.dim, device=dev)).requires_grad_()
    ctx = torch.randn(B, args.text_len, cfg.dim, device=dev)
    cos, sin = rope_3d(grid, cfg.head_dim, device=dev)
    inputs = dict(x=x, e0=e0, cos=cos, sin=sin, context=ctx, context_mask=None)
    default = dict(norm_kernels.ENABLED)
    settings = {
        "none": dict.fromkeys(default, False),
        "default": default,
        "all": dict.fromkeys(default, True),
        "rope": dict(dict.fromkeys(default, False), rms_norm_rope=True),  # RMSNorm + RoPE of q and k only
    }
    report = {}
    extra = {k: bool(int(v)) for k, v in (o.split("=", 1) for o in args.inductor_option)}
    for label in args.settings.split(","):
        sites = settings[label]
        norm_kernels.ENABLED = dict(sites)
        torch._dynamo.reset()
        # The keys' bias: zero gradient in theory (softmax ignores a shift shared by all keys).
        diffs = compare_compiled(
            block,
            settings=CompileSettings(options=extra or None, safe_reductions=not args.torch_defaults),
            kwargs=inputs,
            ignore=["k.bias"],
        )
        worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:6]
        print(f"{label:8s} worst: " + ", ".join(f"{k} {v:.1e}" for k, v in worst), flush=True)
        report[label] = dict(sites=sites, rel_diff=diffs)
    norm_kernels.ENABLED = default
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    out = dict(
        check="benchmarks/checks/check_block_grads.py",
        device=name,
        torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        batch=B,
        grid=grid,
        tokens=S,
        checkpoint=args.checkpoint,
        inductor_options=dict({} if args.torch_defaults else SAFE_REDUCTIONS, **extra),
        what="max |compiled - eager| / max |eager| per output and gradient, bf16 autocast",
        settings=report,
    )
    write_json(args.out, f"check_block_grads_{device_tag(name)}_{datetime.date.today()}.json", out)


if __name__ == "__main__":
    main()
