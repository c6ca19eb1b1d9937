"""Run by tests/ops/test_norm_kernels.py in a subprocess with TRITON_INTERPRET=1 (set before Triton is imported,
so the kernels run on CPU tensors), or in-process on a GPU. Prints one JSON line: check name -> the largest
difference from the plain-PyTorch reference, relative to the reference's largest magnitude."""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

from lightning_adaptiveload.models import layers
from lightning_adaptiveload.models.compile_check import relative_difference as _rel
from lightning_adaptiveload.models.layers import apply_rope, rope_3d
from lightning_adaptiveload.ops import norm_kernels as nk


def _grads(fn, leaves, dy):
    for t in leaves:
        t.grad = None
    y = fn()
    y.backward(dy.to(y.dtype))
    return [y.detach()] + [t.grad.detach().clone() for t in leaves]


def _compare(name, out, fn_kernel, fn_ref, leaves, dy):
    got, ref = _grads(fn_kernel, leaves, dy), _grads(fn_ref, leaves, dy)
    for i, (a, b) in enumerate(zip(got, ref)):
        out[f"{name}[{'out' if i == 0 else f'grad{i - 1}'}]"] = _rel(a, b)


def run(device: str, B: int, S: int, D: int, heads: int) -> dict:
    torch.manual_seed(0)
    dev = torch.device(device)
    out: dict = {}
    eps = 1e-6
    for x_dtype in (torch.float32, torch.bfloat16):
        for per_sample in (True, False):
            x = torch.randn(B, S, D, device=dev).to(x_dtype).requires_grad_()
            mb = B if per_sample else 1
            mult = (1 + 0.3 * torch.randn(mb, 1, D, device=dev)).requires_grad_()
            add = (0.3 * torch.randn(mb, 1, D, device=dev)).requires_grad_()
            dy = torch.randn(B, S, D, device=dev)
            for out_dtype in (x_dtype, torch.bfloat16):
                _compare(
                    f"ln_affine/{x_dtype}/{'sample' if per_sample else 'shared'}/{out_dtype}",
                    out,
                    lambda x=x, m=mult, a=add, o=out_dtype: nk.layer_norm_affine(x, m, a, eps, o),
                    lambda x=x, m=mult, a=add, o=out_dtype: (
                        F.layer_norm(x.float(), (D,), eps=eps) * m + a
                    ).to(o),
                    [x, mult, add],
                    dy,
                )
    grid = (S, 1, 1)
    cos, sin = rope_3d(grid, D // heads, device=dev)
    for x_dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(B, S, D, device=dev).to(x_dtype).requires_grad_()
        w = (1 + 0.2 * torch.randn(D, device=dev)).requires_grad_()
        dy = torch.randn(B, S, D, device=dev)

        def ref_norm(x=x, w=w):
            xf = x.float()
            return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w

        _compare(
            f"rms_rope/{x_dtype}",
            out,
            lambda x=x, w=w: nk.rms_norm_rope(x, w, cos, sin, eps).float(),
            lambda: apply_rope(ref_norm().unflatten(-1, (heads, -1)), cos, sin).flatten(-2),
            [x, w],
            dy,
        )
        _compare(
            f"rms/{x_dtype}",
            out,
            lambda x=x, w=w: nk.rms_norm_rope(x, w, None, None, eps).float(),
            ref_norm,
            [x, w],
            dy,
        )
    # The layers with the Triton path forced on (it is gated on CUDA + torch.compile) against their eager forms.
    block_checks(dev, B, S, D, heads, out)
    return out


def block_checks(dev, B, S, D, heads, out) -> None:
    from lightning_adaptiveload.models.video_dit import DiTBlock, VideoDiTConfig

    cfg = VideoDiTConfig(dim=D, num_heads=heads, num_layers=1, ffn_dim=2 * D, text_dim=D)
    torch.manual_seed(1)
    block = DiTBlock(cfg).to(dev)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x = torch.randn(B, S, D, device=dev).requires_grad_()
    e0 = 0.3 * torch.randn(B, 6, D, device=dev)
    ctx = torch.randn(B, 7, D, device=dev)
    cos, sin = rope_3d((S, 1, 1), D // heads, device=dev)
    dy = torch.randn(B, S, D, device=dev)
    leaves = [x] + list(block.parameters())
    original = layers._norm_kernels_on

    # The keys' bias gets an exactly zero gradient in theory (softmax ignores a shift shared by all keys), so
    # what it gets is rounding noise: left out.
    names = ["out", "x"] + [n for n, _ in block.named_parameters()]
    for autocast in (False, True):

        def call(kernels: bool, autocast: bool = autocast):
            layers._norm_kernels_on = (lambda t, site: True) if kernels else original
            try:
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                    return block(x, e0, cos, sin, ctx, None)
            finally:
                layers._norm_kernels_on = original

        got, ref = _grads(lambda: call(True), leaves, dy), _grads(lambda: call(False), leaves, dy)
        for name, a, b in zip(names, got, ref):
            if not name.endswith("k.bias"):
                out[f"block{'/bf16' if autocast else ''}/{name}"] = _rel(a, b)

    # Traced by dynamo in one graph (fullgraph: a graph break raises), the kernels as opaque custom ops.
    seen: set[str] = set()

    def recording_aot_eager(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    compiled = torch.compile(block, backend=recording_aot_eager, fullgraph=True, dynamic=True)

    def call_compiled():
        layers._norm_kernels_on = lambda t, site: True
        try:
            return compiled(x, e0, cos, sin, ctx, None)
        finally:
            layers._norm_kernels_on = original

    got = _grads(call_compiled, leaves, dy)
    ref = _grads(lambda: block(x, e0, cos, sin, ctx, None), leaves, dy)
    for name, a, b in zip(names, got, ref):
        if not name.endswith("k.bias"):
            out[f"compiled/{name}"] = _rel(a, b)
    # Graph nodes: the RMSNorm + RoPE custom op (three: q, k, the cross-attention's q; the context's k is
    # another) and the LayerNorm-affine autograd.Function (norm1, norm3, norm2).
    out["graph_targets"] = sorted(t for t in seen if "rms_norm_rope" in t or "autograd_function" in t)


if __name__ == "__main__":
    device, B, S, D, heads = sys.argv[1], *map(int, sys.argv[2:6])
    print(json.dumps(run(device, B, S, D, heads)))
