"""Speed of the fused LayerNorm-Modulate op against eager PyTorch and torch.compile, side by side.

    PYTHONPATH=$PWD python benchmarks/kernels/bench_modulate.py --out benchmarks/results/modulate_<device>_<date>.json

For each shape (x bf16 (B, S, D); shift and scale fp32, per sample (B, D) or per token (B, S, D)) it times
forward, backward and forward+backward of: eager PyTorch (``F.layer_norm`` in fp32, then the modulation),
``torch.compile`` of the same function, and ``layer_norm_modulate``. Times are medians over CUDA events
around each call after a warm-up ("call": what an eager training step sees, launch overhead included) and,
for the fused op, per call inside a replayed CUDA graph ("graph": GPU time alone). The speed of light is the
bytes that must move (forward: read x, write y; backward: read x and dy, write dx; per token also the
modulation tables and their gradients) over the copy bandwidth measured in the same run. Sanity checks
compare the fused results with eager ones. Nothing here asserts a time.

``--paths`` instead compares the forward kernels side by side on every shape (the single-row kernel of
version 3, the persistent one of version 4, and launch variants of the latter), each checked against an
fp32 eager forward and timed inside a CUDA graph: see ``compare_paths``. Launch overrides and the
benchmark-only kernel variants come from a separate build of the kernels (``modulate_variants.py``); the
shipped operator always uses the launchers' own plan.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

DEVICE = "cuda"

SHAPES = [
    # (B, S, D, layout, tag)
    (1, 32760, 1536, "sample", "wan1.3B-480p"),
    (1, 32760, 5120, "sample", "wan14B-480p"),
    (1, 75600, 5120, "sample", "wan14B-720p"),
    (8, 4096, 1536, "sample", "img-batch"),
    (1, 32760, 1536, "token", "wan2.2-per-token"),
]

# Launch-parameter variants timed next to the default plan: (shape index, kind) -> overrides.
SWEEPS = {
    (0, "fwd"): [{"warps_per_row": 1, "rows_per_cta": 4}, {"warps_per_row": 2, "rows_per_cta": 4}],
    (1, "fwd"): [{"warps_per_row": 4, "rows_per_cta": 1}, {"warps_per_row": 3, "rows_per_cta": 2}],
    (0, "bwd"): [{"vectors_per_thread": 1, "slots": 1}, {"vectors_per_thread": 2, "slots": 2}],
    (1, "bwd"): [{"vectors_per_thread": 4, "slots": 2}],
}


def _eager(x, shift, scale):
    """The eager baseline: fp32 LayerNorm without affine, then the modulation (as the anchors measured)."""
    if shift.dim() == 2:
        shift, scale = shift.unsqueeze(1), scale.unsqueeze(1)
    y = F.layer_norm(x.float(), (x.shape[-1],), None, None, 1e-6)
    return (y * (1.0 + scale) + shift).to(x.dtype)


def _time_calls(fn, warmup: int, reps: int) -> float:
    """Median ms per call, CUDA events around each call, calls enqueued back to back."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def _time_graph(fn, calls: int = 10, reps: int = 15) -> float | None:
    """Median ms per call inside a replayed CUDA graph of ``calls`` calls (GPU time without launch gaps)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / calls)
        del graph
        return statistics.median(times)
    except Exception as exc:  # report, do not hide: a graph failure is a finding
        print(f"  graph timing failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        torch.cuda.synchronize()
        return None


def copy_bandwidth(gib: float = 1.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = int(gib * 2**30) // 4
    a = torch.randn(n, device=DEVICE)
    b = torch.empty_like(a)
    ms = _time_calls(lambda: b.copy_(a), 5, 30)
    return 2 * a.numel() * 4 / (ms * 1e-3)


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bench_shape(B, S, D, layout, tag, bw, ops, args) -> dict:
    torch.manual_seed(0)
    dev = DEVICE
    x = torch.randn(B, S, D, device=dev, dtype=torch.bfloat16)
    mshape = (B, D) if layout == "sample" else (B, S, D)
    shift = 0.5 * torch.randn(mshape, device=dev)
    scale = 0.5 * torch.randn(mshape, device=dev)
    dy = torch.randn_like(x)
    n = B * S * D
    fwd_bytes = 4 * n  # read x, write y (bf16)
    bwd_bytes = 6 * n  # read x and dy, write dx
    if layout == "token":
        fwd_bytes += 8 * n  # read shift and scale (fp32)
        bwd_bytes += 12 * n  # read scale, write d_shift and d_scale (fp32)
    floor = {"fwd": fwd_bytes / bw * 1e3, "bwd": bwd_bytes / bw * 1e3}
    floor["fwdbwd"] = floor["fwd"] + floor["bwd"]
    row = {
        "shape": f"{B}x{S}x{D}",
        "tag": tag,
        "layout": layout,
        "dtype": "bfloat16",
        "mod_dtype": "float32",
        "bytes_fwd": fwd_bytes,
        "bytes_bwd": bwd_bytes,
        "floor_ms": floor,
    }
    xr = x.clone().requires_grad_()
    shr = shift.clone().requires_grad_()
    scr = scale.clone().requires_grad_()
    leaves = (xr, shr, scr)

    torch._dynamo.reset()
    compiled = torch.compile(_eager, dynamic=False)
    impls = {"eager": _eager, "compile": compiled, "ours": ops.layer_norm_modulate}
    for name, f in impls.items():
        r = {}
        with torch.no_grad():
            r["fwd"] = _time_calls(lambda f=f: f(x, shift, scale), args.warmup, args.reps)

        def fwdbwd(f=f):
            y = f(*leaves)
            return torch.autograd.grad(y, leaves, dy)

        r["fwdbwd"] = _time_calls(fwdbwd, args.warmup, args.reps)
        y = f(*leaves)
        try:
            r["bwd"] = _time_calls(
                lambda y=y: torch.autograd.grad(y, leaves, dy, retain_graph=True), args.warmup, args.reps
            )
            r["bwd_method"] = "autograd.grad(retain_graph=True)"
        except RuntimeError as exc:
            r["bwd"] = r["fwdbwd"] - r["fwd"]
            r["bwd_method"] = f"fwdbwd - fwd ({type(exc).__name__})"
        del y
        row[name] = r
        print(f"  {name:8s} fwd {r['fwd']:.4f}  bwd {r['bwd']:.4f}  fwd+bwd {r['fwdbwd']:.4f} ms", flush=True)

    # The fused op's kernels alone: the backward op called directly, and CUDA-graph replays.
    impl = importlib.import_module("lightning_adaptiveload.ops.layer_norm_modulate")
    table_sh, group = impl._as_groups(shift, x)
    table_sc, _ = impl._as_groups(scale, x)
    _, mean, rstd = impl._fwd_op(x, table_sh, table_sc, None, None, group, 1e-6)
    bwd_direct = lambda: impl._bwd_op(dy, x, table_sc, None, None, mean, rstd, group)  # noqa: E731
    row["ours"]["bwd_op_call"] = _time_calls(bwd_direct, args.warmup, args.reps)
    with torch.no_grad():
        g_fwd = _time_graph(lambda: ops.layer_norm_modulate(x, shift, scale))
    g_bwd = _time_graph(bwd_direct)
    g_fb = _time_graph(lambda: torch.autograd.grad(ops.layer_norm_modulate(*leaves), leaves, dy))
    row["ours_graph"] = {"fwd": g_fwd, "bwd": g_bwd, "fwdbwd": g_fb}
    for name in ("compile", "eager"):
        f = impls[name]
        with torch.no_grad():
            gf = _time_graph(lambda f=f: f(x, shift, scale))
        gfb = _time_graph(lambda f=f: torch.autograd.grad(f(*leaves), leaves, dy))
        row[f"{name}_graph"] = {"fwd": gf, "fwdbwd": gfb}

    # Sanity: the fused results against eager (bf16 output rounding dominates).
    y_o = ops.layer_norm_modulate(*leaves)
    y_e = _eager(*leaves)
    g_o = torch.autograd.grad(y_o, leaves, dy)
    g_e = torch.autograd.grad(y_e, leaves, dy)
    row["check_rel_err_vs_eager"] = {
        "y": _rel(y_o, y_e),
        **{f"d{n}": _rel(a, b) for n, a, b in zip(("x", "shift", "scale"), g_o, g_e)},
    }
    row["backward_plan"] = dict(
        zip(
            (
                "vpt",
                "rows_per_iter",
                "tpr",
                "slots",
                "grid",
                "chunks",
                "rows_per_chunk",
                "items",
                "smem",
                "ws",
            ),
            _ext().backward_plan(x, table_sc, False, group, 0, 0),
        )
    )
    for kind in ("fwd", "bwd", "fwdbwd"):
        row.setdefault("sol_pct", {})[kind] = {
            name: 100.0 * floor[kind] / row[name][kind] for name in ("eager", "compile", "ours")
        }
        g = row["ours_graph"][kind]
        row["sol_pct"][kind]["ours_graph"] = 100.0 * floor[kind] / g if g else None
    row["speedup_fwdbwd"] = {
        "vs_compile": row["compile"]["fwdbwd"] / row["ours"]["fwdbwd"],
        "vs_eager": row["eager"]["fwdbwd"] / row["ours"]["fwdbwd"],
    }
    g_ours, g_comp, g_eager = (
        row["ours_graph"]["fwdbwd"],
        row["compile_graph"]["fwdbwd"],
        row["eager_graph"]["fwdbwd"],
    )
    row["speedup_fwdbwd_graph"] = {
        "vs_compile": g_comp / g_ours if g_ours and g_comp else None,
        "vs_eager": g_eager / g_ours if g_ours and g_eager else None,
    }
    return row


def _ext():
    """The benchmark build of the kernels, with launch overrides and the benchmark-only variants."""
    from modulate_variants import load_variants

    from lightning_adaptiveload.ops import fused_op_status

    ok, reason = fused_op_status()
    if not ok:
        raise SystemExit(f"the fused kernels are unavailable: {reason}")
    return load_variants()


def run_sweeps(bw, args) -> list[dict]:
    impl = importlib.import_module("lightning_adaptiveload.ops.layer_norm_modulate")
    ext = _ext()
    out = []
    for (idx, kind), overrides in SWEEPS.items():
        B, S, D, layout, tag = SHAPES[idx]
        x = torch.randn(B, S, D, device=DEVICE, dtype=torch.bfloat16)
        shift = 0.5 * torch.randn(B, D, device=DEVICE)
        scale = 0.5 * torch.randn(B, D, device=DEVICE)
        t_sh, group = impl._as_groups(shift, x)
        t_sc, _ = impl._as_groups(scale, x)
        _, mean, rstd = impl._fwd_op(x, t_sh, t_sc, None, None, group, 1e-6)
        dy = torch.randn_like(x)
        for override in [{}] + overrides:
            tune = {"warps_per_row": 0, "rows_per_cta": 0, "vectors_per_thread": 0, "slots": 0, **override}
            if kind == "fwd":

                def fn(x=x, t_sh=t_sh, t_sc=t_sc, group=group, t=tune):
                    return ext.forward(
                        x, t_sh, t_sc, None, None, group, 1e-6, t["warps_per_row"], t["rows_per_cta"]
                    )

                nbytes = 4 * x.numel()
            else:

                def fn(dy=dy, x=x, t_sc=t_sc, mean=mean, rstd=rstd, group=group, t=tune):
                    return ext.backward(
                        dy, x, t_sc, None, None, mean, rstd, group, t["vectors_per_thread"], t["slots"]
                    )

                nbytes = 6 * x.numel()
            try:
                ms = _time_graph(fn) or _time_calls(fn, args.warmup, args.reps)
                res = {"ms": ms, "sol_pct": 100.0 * nbytes / bw / (ms * 1e-3)}
            except RuntimeError as exc:
                res = {"error": str(exc).splitlines()[0]}
            out.append({"shape": f"{B}x{S}x{D}", "kind": kind, "override": override or "default", **res})
            shown = f"{res['ms']:.4f} ms {res['sol_pct']:.1f}%" if "ms" in res else res["error"]
            print(f"  sweep {kind} {B}x{S}x{D} {override or 'default'}: {shown}", flush=True)
    return out


# Forward kernel variants for --paths: (name, path, warps_per_row, rows_per_cta); 0 = the host's choice.
# path 1: single-row CTAs (version 3); 2: persistent CTAs of one row slot with the next row prefetched
# (version 4); 3: as 2 under an 80-register cap at 4 vectors per thread.
FWD_PATHS = [
    ("default", 0, 0, 0),
    ("v3", 1, 0, 0),
    ("v4", 2, 0, 0),
    ("v4 r80", 3, 0, 0),
]
# Extra warps-per-row variants of the persistent kernel per D (bf16): fewer vectors per thread.
FWD_PATH_WARPS = {1536: [3, 6], 5120: [7, 10]}


def compare_paths(picked, bw, out: list, save=None) -> list[dict]:
    """Each forward variant per shape: relative error of y against an fp32 eager forward, the largest
    difference of y, mean and rstd from the host's default, and the GPU time per call (CUDA graph).
    Appends to ``out``; ``save()`` after each shape."""
    ext = _ext()
    impl = importlib.import_module("lightning_adaptiveload.ops.layer_norm_modulate")
    for B, S, D, layout, _tag in picked:
        torch.manual_seed(0)
        x = torch.randn(B, S, D, device=DEVICE, dtype=torch.bfloat16)
        mshape = (B, D) if layout == "sample" else (B, S, D)
        shift = 0.5 * torch.randn(mshape, device=DEVICE)
        scale = 0.5 * torch.randn(mshape, device=DEVICE)
        t_sh, group = impl._as_groups(shift, x)
        t_sc, _ = impl._as_groups(scale, x)
        n = x.numel()
        nbytes = 4 * n + (8 * n if layout == "token" else 0)
        y_ref = _eager(x, shift, scale).float()
        variants = list(FWD_PATHS) + [(f"v4 W{w}", 2, w, 0) for w in FWD_PATH_WARPS.get(D, [])]
        base = None
        for name, path, w, r in variants:
            res = {
                "shape": f"{B}x{S}x{D}",
                "layout": layout,
                "variant": name,
                "path": path,
                "warps_per_row": w,
                "rows_per_cta": r,
            }
            try:

                def fn(path=path, w=w, r=r, x=x, t_sh=t_sh, t_sc=t_sc, group=group):
                    return ext.forward(x, t_sh, t_sc, None, None, group, 1e-6, w, r, path)

                y, mean, rstd = fn()
                torch.cuda.synchronize()
                res["rel_err_vs_eager_fp32"] = _rel(y.float(), y_ref)
                res["nan"] = bool(torch.isnan(y).any().item())
                if base is None:
                    base = (y, mean, rstd)
                else:
                    res["max_abs_dy_vs_default"] = (y.float() - base[0].float()).abs().max().item()
                    res["max_rel_dmean_vs_default"] = (
                        (mean - base[1]).abs().max() / base[1].abs().max().clamp_min(1e-30)
                    ).item()
                    res["max_rel_drstd_vs_default"] = ((rstd - base[2]).abs() / base[2]).max().item()
                del y, mean, rstd
                ms = _time_graph(fn)
                if ms:
                    res["ms"] = ms
                    res["sol_pct"] = 100.0 * nbytes / bw / (ms * 1e-3)
            except RuntimeError as exc:
                res["error"] = str(exc).splitlines()[0]
            out.append(res)
            if "ms" in res:
                shown = (
                    f"{res['ms']:.4f} ms {res['sol_pct']:.1f}%  err {res['rel_err_vs_eager_fp32']:.2e}"
                    f"  dy {res.get('max_abs_dy_vs_default', 0.0):.3g}"
                    f"  dmean {res.get('max_rel_dmean_vs_default', 0.0):.2g}"
                    f"  drstd {res.get('max_rel_drstd_vs_default', 0.0):.2g}"
                    f"{'  NaN!' if res['nan'] else ''}"
                )
            else:
                shown = res.get("error", "no time")
            print(f"  path {B}x{S}x{D} {layout:6s} {name:9s}: {shown}", flush=True)
        del base, x, y_ref
        torch.cuda.empty_cache()
        if save is not None:
            save()
    return out


def _profile_once(shapes) -> int:
    impl = importlib.import_module("lightning_adaptiveload.ops.layer_norm_modulate")
    for B, S, D, layout, _ in shapes:
        x = torch.randn(B, S, D, device=DEVICE, dtype=torch.bfloat16)
        mshape = (B, D) if layout == "sample" else (B, S, D)
        shift, scale = torch.randn(mshape, device=DEVICE), torch.randn(mshape, device=DEVICE)
        t_sh, group = impl._as_groups(shift, x)
        t_sc, _ = impl._as_groups(scale, x)
        _, mean, rstd = impl._fwd_op(x, t_sh, t_sc, None, None, group, 1e-6)
        impl._bwd_op(torch.randn_like(x), x, t_sc, None, None, mean, rstd, group)
        torch.cuda.synchronize()
    return 0


def _fmt_table(rows, bw) -> str:
    def tri(d, keys=("fwd", "bwd", "fwdbwd")):
        return "/".join(f"{d[k]:.3f}" if d.get(k) else "-" for k in keys)

    def ratio(x):
        return f"{x:.2f}x" if x else "-"

    lines = [
        f"copy bandwidth {bw / 1e12:.2f} TB/s; ms per call (median); graph = per call in a replayed CUDA graph",
        f"{'shape':13s} {'mod':6s} | {'floor f/b/fb':17s} | {'eager f/b/fb':20s} | {'compile f/b/fb':17s} | "
        f"{'ours f/b/fb':17s} | {'ours graph f/b/fb':17s} | {'%SOL graph':10s} | {'comp graph f/fb':15s} | "
        "fb x comp call/graph | fb x eager",
    ]
    for r in rows:
        sol = r["sol_pct"]
        gs = "/".join(
            f"{sol[k]['ours_graph']:.0f}" if sol[k]["ours_graph"] else "-" for k in ("fwd", "bwd", "fwdbwd")
        )
        sp, spg = r["speedup_fwdbwd"], r["speedup_fwdbwd_graph"]
        lines.append(
            f"{r['shape']:13s} {r['layout']:6s} | {tri(r['floor_ms']):17s} | {tri(r['eager']):20s} | "
            f"{tri(r['compile']):17s} | {tri(r['ours']):17s} | {tri(r['ours_graph']):17s} | {gs:10s} | "
            f"{tri(r['compile_graph'], ('fwd', 'fwdbwd')):15s} | {ratio(sp['vs_compile'])} / "
            f"{ratio(spg['vs_compile'])} | {ratio(sp['vs_eager'])} / {ratio(spg['vs_eager'])}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="results JSON (default: benchmarks/results/...)"
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--shapes", type=str, default=None, help="comma-separated indices into SHAPES")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-parameter sweep")
    parser.add_argument(
        "--paths", action="store_true", help="only compare the forward kernels (version 3, 4, variants)"
    )
    parser.add_argument(
        "--profile-once",
        action="store_true",
        help="run the fused forward and backward once per shape (for ncu)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_modulate: needs a CUDA GPU", file=sys.stderr)
        return 1
    ops = importlib.import_module("lightning_adaptiveload.ops")
    _ext()  # build both libraries before timing anything
    if args.profile_once:
        return _profile_once([SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES)
    for key in ("recompile_limit", "cache_size_limit"):  # renamed across torch versions
        if hasattr(torch._dynamo.config, key):
            setattr(torch._dynamo.config, key, 64)
    bw = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    picked = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    date = _dt.date.today().isoformat()
    result = {
        "benchmark": "layer_norm_modulate_paths" if args.paths else "layer_norm_modulate",
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": date,
        "copy_bandwidth_Bps": bw,
        "method": "median of CUDA-event times per call after warm-up; graph = per call in a replayed CUDA graph",
    }
    out = args.out
    if out is None:
        slug = "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()
        kind = "modulate_paths" if args.paths else "modulate"
        out = Path(__file__).resolve().parent.parent / "results" / f"{kind}_{slug}_{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.paths:
        result["paths"] = []
        compare_paths(picked, bw, result["paths"], lambda: out.write_text(json.dumps(result, indent=2)))
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
        return 0
    rows = []
    result["rows"] = rows
    result["sweeps"] = []
    for B, S, D, layout, tag in picked:
        print(f"{B}x{S}x{D} {layout} ({tag})", flush=True)
        rows.append(bench_shape(B, S, D, layout, tag, bw, ops, args))
        torch.cuda.empty_cache()
        out.write_text(json.dumps(result, indent=2))  # each shape as it completes: a cut-off run keeps them
    result["sweeps"] = [] if args.no_sweep else run_sweeps(bw, args)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    print(_fmt_table(rows, bw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
