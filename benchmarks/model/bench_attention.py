"""Attention kernels alone, side by side: cuDNN, PyTorch's FlashAttention-2 and FlashAttention-4 (issue 17).

For each shape of a Wan 1.3B step on the wan21_480p mix (self-attention of clips and images, cross-attention
of their tokens to 512 text tokens; 12 heads of 128), times the forward alone and forward + backward with
CUDA events (3 warm-ups, median of ``--reps``) for each implementation:

- ``cudnn``: SDPA restricted to ``SDPBackend.CUDNN_ATTENTION`` (what the compiled step runs today);
- ``fa2``: SDPA restricted to ``SDPBackend.FLASH_ATTENTION``, PyTorch's built-in FlashAttention-2;
- ``fa4``: the same SDPA call after ``attention.flash_impl_ready("fa4")`` has routed PyTorch's FlashAttention
  backend to FlashAttention-4 (``flash-attn-4``) through ``torch.nn.attention``'s registry: the path the
  model takes with ``attention_backend="fa4"``;
- ``fa4-direct``: ``flash_attn.cute.flash_attn_func`` on (B, S, H, d) tensors, without PyTorch's wrapper
  (how much the registry's transposes and checks cost).

q, k, v are laid out as the model makes them: (B, S, H, d) projections viewed as (B, H, S, d). Every
implementation's output and gradients are compared with cuDNN's on the same inputs (max |diff| and the
relative Frobenius error), and both with an fp32 reference on a small shape. TFLOP/s counts 4 B H Sq Skv d
for the forward and 2.5 times that for the backward.

``--splits 1,2,4,8`` adds, on the cross-attention shapes, cuDNN and FA4 with the queries cut into that many
chunks (``attention.sdpa_split_queries``, the model's cross-attention path for long single samples).

Writes ``bench_attention_<device>_<date>.json`` into ``--out`` after every shape and prints a table last.

    python benchmarks/model/bench_attention.py --out benchmarks/results        # one H100, under 2 minutes
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import add_out_arg, cuda_event_times, device_tag  # noqa: E402

# name -> (B, Sq, Skv): the wan21_480p mix's attention shapes at 480p (60 x 104 latents, 1,560 tokens a frame
# group), 12 heads of 128.
SHAPES = {
    "self_81f": (1, 32760, 32760),
    "self_65f": (1, 26520, 26520),
    "self_49f": (1, 20280, 20280),
    "self_33f": (1, 14040, 14040),
    "self_17f": (1, 7800, 7800),
    "self_20img": (20, 1560, 1560),
    "cross_81f": (1, 32760, 512),
    "cross_20img": (20, 1560, 512),
    # More cross-attention shapes, for --splits: other clip lengths, three 17-frame clips, and an 81-frame
    # clip at 78 x 78 latents (1,521 tokens a frame group: an odd length, so the split pads).
    "cross_65f": (1, 26520, 512),
    "cross_49f": (1, 20280, 512),
    "cross_33f": (1, 14040, 512),
    "cross_17f": (1, 7800, 512),
    "cross_17f_b3": (3, 7800, 512),
    "cross_81f_sq": (1, 31941, 512),
}
# The shapes run unless --shapes names others (the first eight: the mix's main ones).
DEFAULT_SHAPES = list(SHAPES)[:8]
HEADS, HEAD_DIM = 12, 128


def _timed(fn, reps: int) -> float:
    return statistics.median(cuda_event_times(fn, reps, warmup=3))


def _time_impl(call, q, k, v, grad, reps: int) -> tuple[float, float]:
    """(forward ms, forward + backward ms), medians."""
    with torch.no_grad():
        fwd = _timed(lambda: call(q, k, v), reps)
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    return fwd, _timed(lambda: call(qq, kk, vv).backward(grad), reps)


def _inputs(b, sq, skv, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    q, k, v = (
        torch.randn(b, s, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
        for s in (sq, skv, skv)
    )
    grad = torch.randn(b, sq, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
    return q, k, v, grad


def _sdpa_call(backend, splits: int = 1):
    def call(q, k, v):  # (B, S, H, d) leaves -> (B, S, H, d), through the model's (B, H, S, d) views
        if splits > 1:  # the model's query split (attention.sdpa_split_queries)
            from lightning_adaptiveload.models.attention import sdpa_split_queries

            out = sdpa_split_queries(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, [backend], splits
            )
            return out.transpose(1, 2)
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return out.transpose(1, 2)

    return call


def _fa4_direct():
    from flash_attn.cute import flash_attn_func

    def call(q, k, v):
        out = flash_attn_func(q, k, v)
        return out[0] if isinstance(out, tuple) else out

    return call


def _run(call, q, k, v, grad):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = call(q, k, v)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _errors(got, ref):
    names = ("out", "dq", "dk", "dv")
    return {
        n: {
            "max_abs": float((a.float() - b.float()).abs().max()),
            "rel_fro": float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)),
        }
        for n, a, b in zip(names, got, ref)
    }


def _fp32_reference_errors(impls, dev):
    """Each implementation against fp32 math attention on one small shape (2 x 1,000 x 12 x 128)."""
    q, k, v, grad = _inputs(2, 1000, 1000, dev, seed=1)
    ref = _run(
        lambda a, b, c: F.scaled_dot_product_attention(
            a.transpose(1, 2), b.transpose(1, 2), c.transpose(1, 2)
        ).transpose(1, 2),
        q.float(),
        k.float(),
        v.float(),
        grad.float(),
    )
    rows = {}
    for name, call in impls.items():
        try:
            rows[name] = _errors(_run(call, q, k, v, grad), ref)
        except Exception as err:
            rows[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--impls", default="cudnn,fa2,fa4,fa4-direct")
    ap.add_argument(
        "--splits",
        default="1",
        help="query splits to time for cuDNN and FA4 on cross-attention shapes (e.g. 1,2,4,8): "
        "attention.sdpa_split_queries, named <impl>/split<k>",
    )
    ap.add_argument("--reps", type=int, default=10)
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from lightning_adaptiveload.models import attention

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    tag = device_tag(name)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench_attention_{tag}_{_dt.date.today()}.json")
    result = {
        "device": name,
        "torch": torch.__version__,
        "date": str(_dt.date.today()),
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "dtype": "bfloat16",
        "method": "CUDA events, 3 warm-ups, median of reps; fwd FLOPs 4*B*H*Sq*Skv*d, bwd 2.5x fwd",
        "reps": args.reps,
        "shapes": {},
    }
    wanted = args.impls.split(",")
    impls = {}
    if "cudnn" in wanted:
        impls["cudnn"] = _sdpa_call(SDPBackend.CUDNN_ATTENTION)
    if "fa2" in wanted:
        impls["fa2"] = _sdpa_call(SDPBackend.FLASH_ATTENTION)
    if "fa4-direct" in wanted:
        try:
            impls["fa4-direct"] = _fa4_direct()
        except Exception as err:
            result["fa4-direct"] = f"unavailable: {type(err).__name__}: {err}"
    result["fp32_reference"] = _fp32_reference_errors(impls, dev)  # before FA4 takes the flash backend
    if "fa4" in wanted:
        t0 = time.perf_counter()
        ok, why = attention.flash_impl_ready("fa4", dev)
        result["fa4"] = {"active": ok, "detail": why, "activate_s": time.perf_counter() - t0}
        if ok:
            impls["fa4"] = _sdpa_call(SDPBackend.FLASH_ATTENTION)
            result["fp32_reference"]["fa4"] = _fp32_reference_errors({"fa4": impls["fa4"]}, dev)["fa4"]
            impls.pop("fa2", None)  # the flash backend is FA4 from here on
    splits = [int(x) for x in args.splits.split(",") if int(x) > 1]
    for shape in args.shapes.split(","):
        b, sq, skv = SHAPES[shape]
        flops = 4 * b * HEADS * sq * skv * HEAD_DIM
        q, k, v, grad = _inputs(b, sq, skv, dev)
        rows, ref = {}, None
        shape_impls = dict(impls)
        if shape.startswith("cross"):
            for impl in ("cudnn", "fa4"):
                if impl in impls:
                    backend = SDPBackend.CUDNN_ATTENTION if impl == "cudnn" else SDPBackend.FLASH_ATTENTION
                    for n in splits:
                        shape_impls[f"{impl}/split{n}"] = _sdpa_call(backend, n)
        for impl, call in shape_impls.items():
            try:
                t0 = time.perf_counter()
                got = _run(call, q, k, v, grad)  # the first call (FA4: JIT compile) and the numbers
                first_s = time.perf_counter() - t0
                if ref is None:
                    ref = got
                fwd, both = _time_impl(call, q, k, v, grad, args.reps)
                rows[impl] = {
                    "fwd_ms": fwd,
                    "fwd_bwd_ms": both,
                    "bwd_ms": both - fwd,
                    "fwd_tflops": flops / fwd / 1e9,
                    "bwd_tflops": 2.5 * flops / max(both - fwd, 1e-9) / 1e9,
                    "fwd_bwd_tflops": 3.5 * flops / both / 1e9,
                    "first_call_s": first_s,
                    "vs_first_impl": _errors(got, ref),
                }
            except Exception as err:
                rows[impl] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                traceback.print_exc()
            print(shape, impl, json.dumps(rows[impl]), flush=True)
        result["shapes"][shape] = {"B": b, "Sq": sq, "Skv": skv, "impls": rows}
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        del q, k, v, grad
        torch.cuda.empty_cache()
    print(f"\n{'shape':<13} {'impl':<14} {'fwd ms':>8} {'bwd ms':>8} {'fwd TF/s':>9} {'bwd TF/s':>9}")
    for shape, entry in result["shapes"].items():
        for impl, r in entry["impls"].items():
            if "error" in r:
                print(f"{shape:<13} {impl:<14} {r['error'][:60]}")
            else:
                print(
                    f"{shape:<13} {impl:<14} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} "
                    f"{r['fwd_tflops']:9.0f} {r['bwd_tflops']:9.0f}"
                )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
