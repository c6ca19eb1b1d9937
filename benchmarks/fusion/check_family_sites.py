"""Check every fused norm-modulate call of one diffusers family, site by site, on the GPU.

A fused model's bf16 training step is run once while each call of ``ops.layer_norm_modulate`` /
``ops.rms_norm_modulate`` is recorded with its inputs and the gradient that reached its output. Each call
is then replayed alone: the CUDA kernels' output and gradients against the plain-PyTorch reference in fp32
on the same inputs, and, for LayerNorm per sample, both backward kernels (register-fed, bulk-copy) through
the private tuned operator. Then the whole model's gradients are compared: fp32 reference, bf16 unfused and
bf16 fused, with PyTorch's default attention backends and with cuDNN attention off.

This tells a kernel fault from a model-level one (attention, rounding) when a family's GPU test fails.
From the repository root, on a GPU machine with diffusers installed:

    python benchmarks/fusion/check_family_sites.py --family flux --out /tmp/flux_sites.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # _fusion_families.py

from lightning_adaptiveload import ops  # noqa: E402
from lightning_adaptiveload.fusion import fuse_norm_modulate  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _record(calls: list[dict]):
    originals = {"ln": ops.layer_norm_modulate, "rms": ops.rms_norm_modulate}

    def wrap(kind):
        fn = originals[kind]

        def recorded(x, shift, scale, weight=None, bias=None, eps=1e-6):
            y = fn(x, shift, scale, weight, bias, eps)
            entry = {
                "kind": kind,
                "eps": eps,
                "inputs": [t.detach().clone() if t is not None else None for t in (x, shift, scale, weight, bias)],
            }
            calls.append(entry)
            if y.requires_grad:
                y.register_hook(lambda g, e=entry: e.__setitem__("dy", g.detach().clone()))
            return y

        return recorded

    ops.layer_norm_modulate, ops.rms_norm_modulate = wrap("ln"), wrap("rms")
    return originals


def _replay(entry: dict) -> dict:
    kind, eps = entry["kind"], entry["eps"]
    fn = ops.layer_norm_modulate if kind == "ln" else ops.rms_norm_modulate
    ref = ops.layer_norm_modulate_reference if kind == "ln" else ops.rms_norm_modulate_reference
    dy = entry.get("dy")
    ins = [t.clone().requires_grad_(t.is_floating_point()) if t is not None else None for t in entry["inputs"]]
    y = fn(*ins, eps=eps)
    out: dict = {
        "kind": kind,
        "x": list(ins[0].shape),
        "shift": list(ins[1].shape),
        "scale": list(ins[2].shape),
        "x_dtype": str(ins[0].dtype),
        "mod_dtype": str(ins[1].dtype),
        "affine": ins[3] is not None,
        "path": ops.fused_op_paths(),
    }
    ins32 = [t.detach().float().clone().requires_grad_(True) if t is not None else None for t in entry["inputs"]]
    y32 = ref(*ins32, eps=eps)
    out["rel_y"] = _rel(y.float(), y32)
    out["finite_y"] = bool(torch.isfinite(y).all())
    if dy is not None:
        names = ("x", "shift", "scale", "weight", "bias")
        g = torch.autograd.grad(y, [t for t in ins if t is not None], dy)
        g32 = torch.autograd.grad(y32, [t for t in ins32 if t is not None], dy.float())
        out["rel_grads"] = {
            n: _rel(a.float(), b) for n, a, b in zip([n for n, t in zip(names, ins) if t is not None], g, g32)
        }
        out["finite_grads"] = all(bool(torch.isfinite(a).all()) for a in g)
        x, sh, sc = entry["inputs"][:3]
        if x.is_cuda and kind == "ln" and x.dim() == 3 and sc.dim() == 3 and sc.shape[1] == 1 and entry["inputs"][3] is None:
            # Per sample, no affine: both backward kernels through the private tuned operator.
            B, S, D = x.shape
            t_sh = sh.reshape(B, D).contiguous()
            t_sc = sc.reshape(B, D).contiguous()
            ns = torch.ops.lightning_adaptiveload
            xc = x.contiguous()
            _, mean, rstd = ns._norm_modulate_tuned(xc, t_sh, t_sc, None, None, S, eps, False, 0, 0, 0)
            by_path = {}
            for path, name in ((1, "register-fed"), (2, "bulk-copy")):
                try:
                    dx, dsh, dsc, _, _ = ns._norm_modulate_backward_tuned(
                        dy.contiguous(), xc, t_sc, None, None, mean, rstd, S, False, path, 0, 0, 0
                    )
                    by_path[name] = {
                        "x": _rel(dx.float(), g32[0]),
                        "shift": _rel(dsh.float().reshape(g32[1].shape), g32[1]),
                        "scale": _rel(dsc.float().reshape(g32[2].shape), g32[2]),
                    }
                except RuntimeError as e:  # a plan that cannot run here
                    by_path[name] = {"error": str(e).splitlines()[0][:200]}
            out["backward_kernels"] = by_path
    return out


def _model_grads(family, cudnn: bool, dev: str) -> dict:
    torch.backends.cuda.enable_cudnn_sdp(cudnn)
    reference = family.model.to(dev)
    unfused = copy.deepcopy(reference).to(torch.bfloat16)
    fused = copy.deepcopy(unfused)
    fuse_norm_modulate(fused)

    def signal(model, dtype):
        kwargs = {
            k: (v.to(dev, dtype) if v.is_floating_point() else v.to(dev)) if isinstance(v, torch.Tensor) else v
            for k, v in family.kwargs.items()
        }
        model.zero_grad(set_to_none=True)
        out = model(**kwargs, return_dict=False)[0]
        w = torch.randn(out.shape, generator=torch.Generator(dev).manual_seed(3), device=dev)
        (out.float() * w).sum().backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    out_r, g_r = signal(reference, torch.float32)
    out_u, g_u = signal(unfused, torch.bfloat16)
    out_f, g_f = signal(fused, torch.bfloat16)
    worst = sorted(
        ((n, _rel(g_u[n], g), _rel(g_f[n], g)) for n, g in g_r.items() if n in g_u and n in g_f),
        key=lambda t: -t[2],
    )[:8]
    torch.backends.cuda.enable_cudnn_sdp(True)
    return {
        "cudnn_sdp": cudnn,
        "rel_out_unfused": _rel(out_u.float(), out_r),
        "rel_out_fused": _rel(out_f.float(), out_r),
        "worst_grads (name, unfused, fused)": worst,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="flux")
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    from _fusion_families import FAMILIES

    family = FAMILIES[args.family]()
    dev = args.device
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    result: dict = {"family": args.family, "device": name, "torch": torch.__version__}
    result["model"] = [_model_grads(copy.deepcopy(family), c, dev) for c in ((True, False) if dev == "cuda" else (True,))]
    fused = copy.deepcopy(family.model).to(dev, torch.bfloat16)
    fuse_norm_modulate(fused)
    calls: list[dict] = []
    originals = _record(calls)
    try:
        kwargs = {
            k: (v.to(dev, torch.bfloat16) if v.is_floating_point() else v.to(dev))
            if isinstance(v, torch.Tensor)
            else v
            for k, v in family.kwargs.items()
        }
        out = fused(**kwargs, return_dict=False)[0]
        out.float().sum().backward()
    finally:
        ops.layer_norm_modulate, ops.rms_norm_modulate = originals["ln"], originals["rms"]
    result["sites"] = [_replay(c) for c in calls]
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
