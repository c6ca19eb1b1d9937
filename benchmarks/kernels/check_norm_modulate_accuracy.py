"""Accuracy of the fused norm-modulate ops against a float64 reference on rows far from zero.

    PYTHONPATH=$PWD python benchmarks/kernels/check_norm_modulate_accuracy.py [--out FILE.json]

For both ops, x in bf16, fp16 and fp32 at D = 1,536 and 5,120 (1 x 4,096 x D, per-sample fp32 modulation),
with x = offset + randn for offsets 0, 100 and (fp32 only) 1e4: the relative errors ||out - ref|| / ||ref||
of y, dx, d_shift and d_scale, the reference computed by the package's own reference in float64 from the
same (rounded) inputs. It prints one line per case and writes them to JSON; it asserts nothing (the tests in
tests/ops hold the tolerances). A naive E[x^2] - E[x]^2 in fp32 would lose the variance at offset 100.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    import lightning_adaptiveload.ops as ops

    ok, info = ops.fused_op_status()
    print("fused:", ok, info)
    rows = []
    torch.manual_seed(0)
    for name, fused, ref in (
        ("ln", ops.layer_norm_modulate, ops.layer_norm_modulate_reference),
        ("rms", ops.rms_norm_modulate, ops.rms_norm_modulate_reference),
    ):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for D in (1536, 5120):
                for off in (0.0, 100.0, 1e4):
                    if off == 1e4 and dtype != torch.float32:
                        continue
                    x = (torch.randn(1, 4096, D, device="cuda") + off).to(dtype)
                    sh = 0.5 * torch.randn(1, 1, D, device="cuda")
                    sc = 0.5 * torch.randn(1, 1, D, device="cuda")
                    dy = torch.randn(1, 4096, D, device="cuda").to(dtype)
                    ins = [t.clone().requires_grad_(True) for t in (x, sh, sc)]
                    rins = [t.double().requires_grad_(True) for t in (x, sh, sc)]
                    y = fused(*ins)
                    yr = ref(*rins)
                    g = torch.autograd.grad(y, ins, dy)
                    gr = torch.autograd.grad(yr, rins, dy.double())
                    r = {
                        "op": name,
                        "dtype": str(dtype).replace("torch.", ""),
                        "D": D,
                        "offset": off,
                        "y": _rel(y, yr),
                        "dx": _rel(g[0], gr[0]),
                        "dshift": _rel(g[1], gr[1]),
                        "dscale": _rel(g[2], gr[2]),
                    }
                    rows.append(r)
                    print(
                        "acc {op:3s} {dtype:8s} D={D:5d} offset={offset:g}: y {y:.2e} dx {dx:.2e} dshift {dshift:.2e} "
                        "dscale {dscale:.2e}".format(**r),
                        flush=True,
                    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
