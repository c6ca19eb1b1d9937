"""The optimizer step of wan-1.3b's parameters, three ways (issue 17).

- ``fp32 AdamW``: fp32 parameters and gradients, PyTorch's fused AdamW (the eager baseline's and the fp32
  variants' optimizer).
- ``bf16 + master, torch``: bf16 parameters and gradients, ``MasterWeightAdamW(implementation="torch")``:
  the gradients cast to fp32, PyTorch's fused AdamW on the fp32 masters, the masters copied back.
- ``bf16 + master, triton``: the same state, ``implementation="triton"``: one kernel
  (``ops.adamw_kernels``) per step and group.

The parameter shapes are wan-1.3b's (``VideoDiT`` on the meta device), in the module's two groups (matrices
with weight decay, the rest without); the gradients are random. Each variant is timed alone (CUDA events
around ``step()``, host time to issue it too; warm-up, median of ``--iters``), its memory freed before the
next. The bytes each step must move: 28 per parameter for fused fp32 AdamW and for the kernel (read
gradient, master/parameter and two moments; write those and, for the kernel, the bf16 parameter), 40 for
the torch implementation (its gradient cast and copy-back passes). After timing, one step of the kernel is
compared with one of the torch implementation from the same state. ``--sweep`` also times the kernel at
other block sizes and warp counts.

    python benchmarks/model/bench_optimizer.py [--iters 20] [--preset wan-1.3b] [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import add_out_arg, cuda_event_times, device_tag, write_json  # noqa: E402

from lightning_adaptiveload.models import VideoDiT, VideoDiTConfig  # noqa: E402
from lightning_adaptiveload.models.master_weights import MasterWeightAdamW  # noqa: E402
from lightning_adaptiveload.ops import adamw_kernels  # noqa: E402

_ADAMW_PLAN = adamw_kernels.AdamWPlan

# name -> (parameter dtype, MasterWeightAdamW implementation or None for torch's fused AdamW, bytes moved per
# parameter, the kernel's launch overrides).
VARIANTS = {
    "fp32 AdamW (fused)": (torch.float32, None, 28, {}),
    "bf16 + master, torch": (torch.bfloat16, "torch", 40, {}),
    "bf16 + master, triton": (torch.bfloat16, "triton", 28, {}),
}
# The kernel's block and warps (the default is BLOCK = 2048, WARPS = 8: run 27), with --sweep.
SWEEP = [(1024, 4), (2048, 4), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]


def _shapes(preset: str) -> list[tuple[str, torch.Size]]:
    with torch.device("meta"):
        model = VideoDiT(VideoDiTConfig.preset(preset))
    return [(n, p.shape) for n, p in model.named_parameters()]


def _groups(shapes, dtype, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    decay, rest = [], []
    for name, shape in shapes:
        p = (torch.randn(shape, generator=g, device=dev) * 0.02).to(dtype)
        p.grad = (torch.randn(shape, generator=g, device=dev) * 1e-3).to(dtype)
        (decay if len(shape) >= 2 and not name.endswith("modulation") else rest).append(p)
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def _optimizer(groups, impl):
    if impl is None:
        return torch.optim.AdamW(groups, lr=1e-4, fused=True)
    return MasterWeightAdamW(groups, lr=1e-4, implementation=impl)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="wan-1.3b")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's other block and warp counts")
    add_out_arg(ap)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_optimizer.py needs a CUDA GPU")
    dev = torch.device("cuda")
    shapes = _shapes(args.preset)
    n_params = sum(s.numel() for _, s in shapes)
    print(f"{args.preset}: {len(shapes)} tensors, {n_params / 1e9:.3f} B parameters")
    rows = {}
    variants = dict(VARIANTS)
    if args.sweep:
        for block, warps in SWEEP:
            variants[f"triton, block {block}, {warps} warps"] = (
                torch.bfloat16, "triton", 28, {"block": block, "warps": warps}
            )  # fmt: skip
    for name, (dtype, impl, bytes_per, tuning) in variants.items():
        groups = _groups(shapes, dtype, dev)
        # Launch overrides by wrapping the plan class (the package keeps no tuning switches).
        adamw_kernels.AdamWPlan = functools.partial(_ADAMW_PLAN, **tuning) if tuning else _ADAMW_PLAN
        opt = _optimizer(groups, impl)
        times = cuda_event_times(opt.step, args.iters, warmup=args.warmup)
        host = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        ms = statistics.median(times)
        rows[name] = {
            "ms": ms,
            "ms_all": times,
            "host_ms": statistics.median(host),
            "bytes_per_param": bytes_per,
            "gb_per_s": bytes_per * n_params / ms / 1e6,
            "implementation": getattr(opt, "implementation", "torch.optim.AdamW(fused=True)"),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        }
        print(
            f"{name:24s} {ms:7.2f} ms  host {rows[name]['host_ms']:6.2f} ms  {rows[name]['gb_per_s']:7.0f} GB/s"
        )
        del groups, opt
        adamw_kernels.AdamWPlan = _ADAMW_PLAN
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    # One step of each master implementation from the same state: the masters must agree to fp32 rounding.
    results = []
    for impl in ("torch", "triton"):
        groups = _groups(shapes, torch.bfloat16, dev, seed=1)
        opt = MasterWeightAdamW(groups, lr=1e-4, implementation=impl)
        opt.step()
        results.append(torch.cat([m.flatten() for g in opt.inner.param_groups for m in g["params"]]))
        del groups, opt
        torch.cuda.empty_cache()
    diff = ((results[0] - results[1]).abs().max() / results[0].abs().max()).item()
    print(f"kernel vs torch implementation, one step: max relative difference {diff:.2e}")

    name = torch.cuda.get_device_name()
    write_json(
        args.out,
        f"bench_optimizer_{device_tag(name)}_{datetime.date.today()}.json",
        {
            "benchmark": "benchmarks/model/bench_optimizer.py",
            "device": name,
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "preset": args.preset,
            "tensors": len(shapes),
            "kernel_default": {"block": adamw_kernels.BLOCK, "warps": adamw_kernels.WARPS},
            "parameters": n_params,
            "timing": f"CUDA events around step(), {args.warmup} warm-up, median of {args.iters}",
            "variants": rows,
            "kernel_vs_torch_max_rel_diff": diff,
        },
    )


if __name__ == "__main__":
    main()
