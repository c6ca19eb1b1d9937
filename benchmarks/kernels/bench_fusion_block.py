"""One Wan 1.3B-sized diffusers block, forward + backward in bf16: fused norm + modulate vs unfused.

Times ``WanTransformerBlock`` (D = 1536, 12 heads of 128, FFN 8960, cross-attention to 512 text tokens,
qk RMSNorm, cross-attention LayerNorm: Wan 2.1 T2V-1.3B) with and without
``lightning_adaptiveload.fuse_norm_modulate``, at several sequence lengths, for per-sample modulation
(Wan 2.1, temb (B, 6, D)) and per-token modulation (Wan 2.2 TI2V, temb (B, S, 6, D)). Also times one
norm + modulate site alone (the code Wan runs inline vs ``layer_norm_modulate``), to show where the
block-level gain comes from.

Timing: CUDA events around each iteration (forward + backward, gradients of x, the weights and the
modulation), after warm-up; the fused and unfused blocks alternate in rounds so that clock and thermal drift
hit both; medians and 10th / 90th percentiles in ms. Weights are random (speed does not depend on them).
Parameters are bf16 except what diffusers keeps in fp32 when loading (norms and scale_shift_table).

Writes ``benchmarks/results/fusion_block_<gpu>_<date>.json`` and prints a table. Never asserts a time.

Usage::

    python benchmarks/kernels/bench_fusion_block.py                       # 4096, 16384, 32760 tokens
    python benchmarks/kernels/bench_fusion_block.py --seq-lens 32760 --iters 30 --compile
    python benchmarks/kernels/bench_fusion_block.py --quick               # smoke run, a few seconds
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: _common
from _common import cuda_event_times  # noqa: E402

WAN_13B = {"dim": 1536, "num_heads": 12, "ffn_dim": 8960, "text_len": 512, "eps": 1e-6}
# Set by main(): "cuda", or "cpu" for a smoke test of the script itself (with --tiny; times meaningless).
DEVICE = "cuda"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--seq-lens", type=int, nargs="+", default=[4096, 16384, 32760], help="video tokens per sample"
    )
    p.add_argument("--batch", type=int, default=1, help="samples per batch")
    p.add_argument(
        "--modulation", nargs="+", default=["per_sample", "per_token"], choices=["per_sample", "per_token"]
    )
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per block and round")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per block and round")
    p.add_argument("--rounds", type=int, default=3, help="alternating fused/unfused rounds")
    p.add_argument(
        "--compile", action="store_true", help="also time torch.compile'd blocks (slow to compile)"
    )
    p.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent.parent / "results", help="JSON folder"
    )
    p.add_argument("--quick", action="store_true", help="smoke run: one short sequence, few iterations")
    p.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu only checks that the script runs (use --tiny)",
    )
    p.add_argument(
        "--tiny", action="store_true", help="a tiny block instead of Wan 1.3B's (script check only)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.seq_lens, args.warmup, args.iters, args.rounds = [1024], 2, 3, 1
    if args.tiny:
        WAN_13B.update(dim=64, num_heads=2, ffn_dim=128, text_len=16)
        args.seq_lens = [min(s, 64) for s in args.seq_lens]
    return args


def _environment() -> dict[str, Any]:
    import diffusers

    import lightning_adaptiveload
    from lightning_adaptiveload import ops

    op = ops.layer_norm_modulate
    cuda = DEVICE == "cuda"
    return {
        "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if cuda else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers.__version__,
        "lightning_adaptiveload": lightning_adaptiveload.__version__,
        "python": platform.python_version(),
        # Which implementation the public op dispatches to: the custom op or the reference.
        "op": f"{getattr(op, '__module__', '?')}.{getattr(op, '__qualname__', repr(op))}",
    }


def _make_block(dtype: torch.dtype) -> torch.nn.Module:
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    torch.manual_seed(0)
    c = WAN_13B
    block = WanTransformerBlock(c["dim"], c["ffn_dim"], c["num_heads"], cross_attn_norm=True, eps=c["eps"])
    block = block.to(DEVICE)
    # As from_pretrained(torch_dtype=bf16) leaves it: diffusers' _keep_in_fp32_modules stay fp32.
    keep = {"norm1", "norm2", "norm3", "scale_shift_table"}
    for name, tensor in list(block.named_parameters()) + list(block.named_buffers()):
        if tensor.is_floating_point() and not keep.intersection(name.split(".")):
            tensor.data = tensor.data.to(dtype)
    return block


def _inputs(batch: int, seq: int, modulation: str, dtype: torch.dtype) -> dict[str, Any]:
    c = WAN_13B
    g = torch.Generator(DEVICE).manual_seed(1)
    head_dim = c["dim"] // c["num_heads"]
    angle = torch.rand(1, seq, 1, head_dim, generator=g, device=DEVICE) * 6.28
    temb_shape = (batch, seq, 6, c["dim"]) if modulation == "per_token" else (batch, 6, c["dim"])
    return {
        "hidden_states": torch.randn(batch, seq, c["dim"], generator=g, device=DEVICE, dtype=dtype),
        "encoder_hidden_states": torch.randn(
            batch, c["text_len"], c["dim"], generator=g, device=DEVICE, dtype=dtype
        ),
        "temb": torch.randn(temb_shape, generator=g, device=DEVICE, dtype=dtype),
        "rotary_emb": (angle.cos(), angle.sin()),
        "grad_out": torch.randn(batch, seq, c["dim"], generator=g, device=DEVICE, dtype=dtype),
    }


def _step(block: torch.nn.Module, inp: dict[str, Any]) -> torch.Tensor:
    """Forward + backward; gradients of x, temb and the weights, as in training."""
    x = inp["hidden_states"].detach().requires_grad_(True)
    temb = inp["temb"].detach().requires_grad_(True)
    for p in block.parameters():
        p.grad = None
    out = block(x, inp["encoder_hidden_states"], temb, inp["rotary_emb"])
    out.backward(inp["grad_out"])
    return out


def _time(fn, warmup: int, iters: int) -> list[float]:
    """Milliseconds per call of ``fn``, one CUDA-event pair per iteration."""
    for _ in range(warmup):
        fn()
    if DEVICE != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return times
    return cuda_event_times(fn, iters)


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]

    return {"median": statistics.median(ordered), "p10": pct(0.1), "p90": pct(0.9), "n": len(ordered)}


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _accuracy(blocks: dict[str, torch.nn.Module], inp: dict[str, Any]) -> dict[str, float]:
    """Fused vs unfused on the same inputs: output and gradient differences (they share weights)."""
    results = {}
    for name in ("unfused", "fused"):
        x = inp["hidden_states"].detach().requires_grad_(True)
        block = blocks[name]
        for p in block.parameters():
            p.grad = None
        out = block(x, inp["encoder_hidden_states"], inp["temb"], inp["rotary_emb"])
        out.backward(inp["grad_out"])
        grads = torch.cat([p.grad.double().flatten() for p in block.parameters() if p.grad is not None])
        results[name] = (out.detach(), x.grad.detach(), grads)
    (out_u, gx_u, gw_u), (out_f, gx_f, gw_f) = results["unfused"], results["fused"]
    return {
        "out_max_abs_diff": (out_f.float() - out_u.float()).abs().max().item(),
        "out_rel_l2": _rel_l2(out_f, out_u),
        "grad_x_rel_l2": _rel_l2(gx_f, gx_u),
        "grad_weights_rel_l2": _rel_l2(gw_f, gw_u),
    }


def _site_only(batch: int, seq: int, modulation: str, dtype: torch.dtype, warmup: int, iters: int) -> dict:
    """One norm + modulate site alone, forward + backward: Wan's inline code vs the op."""
    import torch.nn.functional as F

    from lightning_adaptiveload import ops

    c = WAN_13B
    g = torch.Generator(DEVICE).manual_seed(2)
    x = torch.randn(batch, seq, c["dim"], generator=g, device=DEVICE, dtype=dtype).requires_grad_(True)
    mod_shape = (batch, seq, c["dim"]) if modulation == "per_token" else (batch, 1, c["dim"])
    shift = torch.randn(mod_shape, generator=g, device=DEVICE).requires_grad_(True)  # fp32, as Wan
    scale = torch.randn(mod_shape, generator=g, device=DEVICE).requires_grad_(True)
    dy = torch.randn(batch, seq, c["dim"], generator=g, device=DEVICE, dtype=dtype)

    def inline():
        y = (F.layer_norm(x.float(), (c["dim"],), eps=c["eps"]) * (1 + scale) + shift).type_as(x)
        y.backward(dy)

    def fused():
        ops.layer_norm_modulate(x, shift, scale, eps=c["eps"]).backward(dy)

    out = {"inline_ms": [], "fused_ms": []}
    for _ in range(2):
        out["inline_ms"] += _time(inline, warmup, iters)
        out["fused_ms"] += _time(fused, warmup, iters)
    summary = {k: _summary(v) for k, v in out.items()}
    summary["speedup"] = summary["inline_ms"]["median"] / summary["fused_ms"]["median"]
    return summary


def _bench_one(blocks: dict[str, Any], args: argparse.Namespace, seq: int, modulation: str) -> dict[str, Any]:
    dtype = torch.bfloat16
    inp = _inputs(args.batch, seq, modulation, dtype)
    row: dict[str, Any] = {"seq_len": seq, "batch": args.batch, "modulation": modulation}
    row["accuracy"] = _accuracy({k: blocks[k] for k in ("unfused", "fused")}, inp)
    times: dict[str, list[float]] = {name: [] for name in blocks}
    peak: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, block in blocks.items():
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            times[name] += _time(lambda b=block: _step(b, inp), args.warmup, args.iters)
            if DEVICE == "cuda":
                peak[name] = max(peak.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)
    row["ms"] = {name: _summary(t) for name, t in times.items()}
    row["peak_memory_gib"] = peak
    row["speedup"] = row["ms"]["unfused"]["median"] / row["ms"]["fused"]["median"]
    if "fused+compile" in row["ms"]:
        row["speedup_compiled"] = (
            row["ms"]["unfused+compile"]["median"] / row["ms"]["fused+compile"]["median"]
        )
    row["site_only"] = _site_only(args.batch, seq, modulation, dtype, args.warmup, args.iters)
    return row


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    args = _parse_args(argv)
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("bench_fusion_block: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    try:
        import diffusers  # noqa: F401
    except ImportError:
        print(
            "bench_fusion_block: needs diffusers (pip install 'lightning-adaptiveload[diffusers]')",
            file=sys.stderr,
        )
        return 2
    from lightning_adaptiveload.fusion import fuse_norm_modulate

    env = _environment()
    unfused = _make_block(torch.bfloat16)
    fused = copy.deepcopy(unfused)
    report = fuse_norm_modulate(fused)
    print(report)
    if report.modules != {"WanTransformerBlock": 1}:
        print(
            "bench_fusion_block: the block was not fused (see the report above); nothing to compare",
            file=sys.stderr,
        )
        return 1
    blocks: dict[str, Any] = {"unfused": unfused, "fused": fused}
    if args.compile:
        blocks["unfused+compile"] = torch.compile(copy.deepcopy(unfused), dynamic=False)
        blocks["fused+compile"] = torch.compile(fused, dynamic=False)

    rows = []
    started = time.time()
    for seq in args.seq_lens:
        for modulation in args.modulation:
            try:
                row = _bench_one(blocks, args, seq, modulation)
            except torch.cuda.OutOfMemoryError as exc:
                row = {
                    "seq_len": seq,
                    "batch": args.batch,
                    "modulation": modulation,
                    "error": f"OOM: {exc}"[:300],
                }
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - record and go on: one bad shape must not lose the others
                row = {"seq_len": seq, "batch": args.batch, "modulation": modulation}
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            rows.append(row)
            _print_row(row)

    result = {
        "benchmark": "fusion_block",
        "description": "diffusers WanTransformerBlock at Wan 2.1 1.3B size, bf16, forward+backward, "
        "fused (fuse_norm_modulate) vs unfused; CUDA-event medians in ms",
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "environment": env,
        "block": WAN_13B,
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "fusion_report": report.as_dict(),
        "results": rows,
        "wall_seconds": round(time.time() - started, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = re.sub(r"[^A-Za-z0-9]+", "-", env["device"]).strip("-").lower()
    suffix = "_smoke" if DEVICE != "cuda" or args.tiny else ""
    path = args.out / f"fusion_block_{gpu}_{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}{suffix}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0


def _print_row(row: dict[str, Any]) -> None:
    head = f"S={row['seq_len']:>6} B={row['batch']} {row['modulation']:<10}"
    if "error" in row:
        print(f"{head} {row['error']}")
        return
    ms = "  ".join(f"{k} {v['median']:8.2f} ms" for k, v in row["ms"].items())
    site = row["site_only"]
    print(
        f"{head} {ms}  speed-up {row['speedup']:.3f}x"
        + (f" (compiled {row['speedup_compiled']:.3f}x)" if "speedup_compiled" in row else "")
        + f" | one site: inline {site['inline_ms']['median']:.3f} ms, fused {site['fused_ms']['median']:.3f} ms"
        f" ({site['speedup']:.2f}x) | out rel L2 {row['accuracy']['out_rel_l2']:.2e}"
    )


if __name__ == "__main__":
    sys.exit(main())
