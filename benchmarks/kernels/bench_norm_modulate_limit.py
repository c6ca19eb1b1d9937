"""The fused norm-modulate ops (LayerNorm and RMSNorm) against the limit: a device copy of the same bytes.

    PYTHONPATH=$PWD python benchmarks/kernels/bench_norm_modulate_limit.py --out benchmarks/results/

For both ops, at D = 1,152, 1,536, 3,072 and 5,120 and the shapes 1 x 32,760 x D and 8 x 4,096 x D, plus
1 x 75,600 x 5,120 (x bf16; shift and scale fp32 per sample, (B, 1, D); one per-token row), it reports:

- ``copy``: a device copy of x (``out.copy_(x)``, 2 x bytes of x moved), the ceiling of the same run;
- ``kernel`` times: the operators alone (forward; forward + backward = both operators), each call inside a
  replayed CUDA graph of back-to-back calls, so no launch gap counts (GPU time);
- ``python`` times, the view a training step has: CUDA events around each public call (``y = op(x, ...)``;
  ``op(x, ...).backward(dy)``), median of >= 20 after a warm-up; and the same for the eager reference
  (``*_reference``), and ``torch.compile`` of the reference at two shapes;
- ``% of copy``: forward moves the bytes of a copy (read x, write y), forward + backward 2.5 copies (also read
  x and dy, write dx): ``pct_fwd = copy / fwd``, ``pct_fwdbwd = 2.5 * copy / fwdbwd``;
- ``host_us``: host (CPU) time per call, from a tiny (1 x 8 x D) input called 2,000 times back to back
  (wall clock over the calls; the GPU work per call is shorter than the host's), for the forward with
  inputs that require grad (the autograd node included), forward + backward, and ``F.layer_norm`` beside
  them.

``--sweep`` also times the launch variants (threads, stages, the register-fed LayerNorm kernels) through the
library's private benchmark operators and checks each against a float64 reference; ``--compile-check``
compiles the references at batch 1 and 8 and compares their gradients with eager ones. Results (device,
torch version, shapes, dtypes, date, every number) go to a JSON file; nothing here asserts a time. The
launch overrides live here, not in the package.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import importlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

WIDTHS = (1152, 1536, 3072, 5120)
SHAPES = [(1, 32760, D, "sample") for D in WIDTHS] + [(8, 4096, D, "sample") for D in WIDTHS]
SHAPES += [(1, 75600, 5120, "sample"), (1, 32760, 1536, "token")]

# Launch variants for --sweep: forward (threads per row, stages), backward (vectors per thread, stages);
# 0 lets the launcher choose. Path codes: forward 1 = register-fed single row (v3), 2 = register-fed
# persistent (v4), 4 = bulk copies (v5); backward 1 = register-fed, 2 = bulk copies.
SWEEP_SHAPES = [(1, 32760, 1152), (1, 32760, 1536), (8, 4096, 1536), (1, 32760, 3072), (1, 75600, 5120)]
FWD_VARIANTS = (
    [(4, 0, 0)] + [(4, t, s) for t in (32, 64, 96, 128, 160, 192) for s in (2, 3)] + [(1, 0, 0), (2, 0, 0)]
)
# backward: (path, vectors per thread, rows per iteration, stages)
BWD_VARIANTS = (
    [(2, 0, 0, 0)] + [(2, v, r, s) for v in (1, 2) for r in (1, 2, 4) for s in (2, 3)] + [(1, 0, 0, 0)]
)


def _ops():
    import lightning_adaptiveload.ops as ops

    return ops


def _median_events(fn, warmup: int = 5, reps: int = 25) -> float:
    """Median ms per call, CUDA events around each call, calls enqueued back to back (the Python view)."""
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


def _graph_time(fn, calls: int = 20, reps: int = 10) -> float | None:
    """Median ms per call inside a replayed CUDA graph of ``calls`` back-to-back calls (kernel time)."""
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
    except Exception as exc:  # a graph failure is a finding: report it, and time back-to-back calls instead
        print(f"  graph timing failed ({type(exc).__name__}: {exc}); back-to-back events", file=sys.stderr)
        torch.cuda.synchronize()
        return _back_to_back(fn)


def _back_to_back(fn, calls: int = 50, reps: int = 5) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / calls)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(B, S, D, layout, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, S, D, device="cuda", dtype=torch.float32, generator=g).to(torch.bfloat16)
    m_shape = (B, 1, D) if layout == "sample" else (B, S, D)
    shift = 0.5 * torch.randn(m_shape, device="cuda", generator=g)
    scale = 0.5 * torch.randn(m_shape, device="cuda", generator=g)
    dy = torch.randn(B, S, D, device="cuda", dtype=torch.float32, generator=g).to(torch.bfloat16)
    return x, shift, scale, dy


def _op_handles(rms: bool):
    ns = torch.ops.lightning_adaptiveload
    if rms:
        return ns.rms_norm_modulate.default, ns.rms_norm_modulate_backward.default
    return ns.layer_norm_modulate.default, ns.layer_norm_modulate_backward.default


def _kernel_times(rms: bool, x, shift, scale, dy) -> dict:
    """Forward and forward + backward operator times (kernel time, CUDA graphs)."""
    fwd_op, bwd_op = _op_handles(rms)
    B, S, D = x.shape
    group = S if shift.shape[1] == 1 else 1
    t_sh, t_sc = shift.reshape(-1, D), scale.reshape(-1, D)
    out = fwd_op(x, t_sh, t_sc, None, None, group, 1e-6)
    stats = out[1:]

    def fwd():
        return fwd_op(x, t_sh, t_sc, None, None, group, 1e-6)

    def bwd():
        if rms:
            return bwd_op(dy, x, t_sc, None, None, stats[0], group)
        return bwd_op(dy, x, t_sc, None, None, stats[0], stats[1], group)

    t_f = _graph_time(fwd)
    t_b = _graph_time(bwd)
    return {"fwd": t_f, "bwd": t_b, "fwdbwd": (t_f + t_b) if t_f and t_b else None}


def _python_view(fn_fwd, x, shift, scale, dy) -> dict:
    """CUDA events per public call (forward; forward + backward through autograd), median of 25."""
    xs = x.detach().requires_grad_()
    sh = shift.detach().requires_grad_()
    sc = scale.detach().requires_grad_()
    t_f = _median_events(lambda: fn_fwd(xs, sh, sc))  # inputs that require grad, as in training

    def fb():
        # autograd.grad, not backward(): x is a leaf here, and accumulating into x.grad would add three
        # passes over x-sized tensors (read .grad and dx, write .grad) that a training step does not have
        # (there dx flows on to the layer before). 2026-12-02's run (docs/fused_op.md) still used backward().
        torch.autograd.grad(fn_fwd(xs, sh, sc), (xs, sh, sc), dy)

    t_fb = _median_events(fb)
    return {"fwd": t_f, "fwdbwd": t_fb}


def _check(rms: bool, fn, x, shift, scale, dy) -> dict:
    """Relative errors of the public op against the float64 reference (forward, dx, dshift, dscale)."""
    ops = _ops()
    ref = ops.rms_norm_modulate_reference if rms else ops.layer_norm_modulate_reference
    ins = [t.detach().clone().requires_grad_() for t in (x, shift, scale)]
    rins = [t.detach().double().requires_grad_() for t in (x, shift, scale)]
    y = fn(*ins)
    yr = ref(*rins)
    g = torch.autograd.grad(y, ins, dy)
    gr = torch.autograd.grad(yr, rins, dy.double())
    return {
        "y": _rel(y, yr),
        "dx": _rel(g[0], gr[0]),
        "dshift": _rel(g[1], gr[1]),
        "dscale": _rel(g[2], gr[2]),
    }


def host_overhead(D: int = 1536, calls: int = 1000, rounds: int = 15) -> dict:
    """Host microseconds per call at a tiny shape (1 x 8 x D): the GPU's work is shorter than the host's.

    Every variant is timed in each of ``rounds`` rounds (``calls`` calls, then a synchronize), the order
    reversed every other round, and reported as its median round: a host whose speed drifts (a shared
    machine's moves by 1.5x between minutes) then shifts all variants alike instead of favouring one.
    """
    ops = _ops()
    x = torch.randn(1, 8, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    sh = torch.randn(1, 1, D, device="cuda", requires_grad=True)
    sc = torch.randn(1, 1, D, device="cuda", requires_grad=True)
    dy = torch.randn(1, 8, D, device="cuda", dtype=torch.bfloat16)
    xf, shf, scf = x.detach(), sh.detach(), sc.detach()
    n_chain = 20

    def chain(f):  # n_chain calls in one graph, one backward: the engine's start is shared by the calls
        y = x
        for _ in range(n_chain):
            y = f(y, sh, sc)
        torch.autograd.grad(y, (x, sh, sc), dy, allow_unused=True)

    # name -> (function, calls it makes per invocation)
    variants: dict = {}
    for name, f in (
        ("layer_norm_modulate", ops.layer_norm_modulate),
        ("rms_norm_modulate", ops.rms_norm_modulate),
    ):
        variants[f"{name}.fwd_grad_us"] = (lambda f=f: f(x, sh, sc), 1)
        variants[f"{name}.fwd_nograd_us"] = (lambda f=f: f(xf, shf, scf), 1)
        variants[f"{name}.fwdbwd_us"] = (lambda f=f: chain(f), n_chain)
    variants["F.layer_norm_us"] = (lambda: F.layer_norm(xf, (D,)), 1)
    variants["F.layer_norm_grad_us"] = (lambda: F.layer_norm(x, (D,)), 1)
    variants["F.layer_norm_fwdbwd_us"] = (lambda: chain(lambda y, a, b: F.layer_norm(y, (D,))), n_chain)
    variants["torch.add_us"] = (lambda: torch.add(xf, 1), 1)
    # The operator alone through torch.ops (its schema parsing included), forward and backward.
    fwd_op, bwd_op = _op_handles(False)
    t_sh, t_sc = shf.reshape(1, D), scf.reshape(1, D)
    _, mean, rstd = fwd_op(xf, t_sh, t_sc, None, None, 8, 1e-6)
    variants["op_direct_us"] = (lambda: fwd_op(xf, t_sh, t_sc, None, None, 8, 1e-6), 1)
    variants["bwd_op_direct_us"] = (lambda: bwd_op(dy, xf, t_sc, None, None, mean, rstd, 8), 1)
    # The library's eager fast path called directly (the public function adds its Python frames and the
    # torch.compile check).
    impl = importlib.import_module("lightning_adaptiveload.ops.layer_norm_modulate")
    if impl._cfast is not None:
        ops.layer_norm_modulate(x, sh, sc)  # remembered
        variants["fast_entry_grad_us"] = (lambda: impl._cfast.forward(False, x, sh, sc, None, None, 1e-6), 1)
        variants["fast_entry_nograd_us"] = (
            lambda: impl._cfast.forward(False, xf, shf, scf, None, None, 1e-6),
            1,
        )
    # The wrapper's cached path before the library had its fast path (commit d8d8f92), re-created beside it
    # with its frames: a Python key of shapes and dtypes, a dict lookup, two views, the operator's entry.
    cache: dict = {}

    def old_key(name, x, shift, scale, weight, bias):
        try:
            return (name, x.shape, x.dtype, shift.shape, shift.dtype, scale.shape, scale.dtype, None, None)
        except AttributeError:
            return None

    def old_call(name, x, shift, scale, weight, bias, eps):
        if not torch.compiler.is_compiling():
            hit = cache.get(old_key(name, x, shift, scale, weight, bias))
            if hit is not None and x.is_cuda:
                M, group = hit
                D = x.shape[-1]
                return fwd_op._op(x, shift.reshape(M, D), scale.reshape(M, D), weight, bias, group, eps)[0]
        raise AssertionError("the re-created cached path missed")

    def old_public(x, shift, scale, weight=None, bias=None, eps=1e-6):
        return old_call("layer_norm_modulate", x, shift, scale, weight, bias, eps)

    cache[old_key("layer_norm_modulate", x, sh, sc, None, None)] = (1, 8)
    variants["before_fwd_grad_us"] = (lambda: old_public(x, sh, sc), 1)
    variants["before_fwd_nograd_us"] = (lambda: old_public(xf, shf, scf), 1)

    def launches():  # the fast path's direct launches so far (a library without them: None)
        f = getattr(impl._cfast, "direct_launches", None) if impl._cfast is not None else None
        return tuple(f()) if f is not None else None

    launches_before = launches()
    for fn, _ in variants.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    samples: dict = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            fn, per = variants[k]
            n = max(calls // per, 10)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            samples[k].append((time.perf_counter() - t0) / (n * per) * 1e6)
    x.grad = sh.grad = sc.grad = None
    out: dict = {"shape": [1, 8, D], "calls_per_round": calls, "rounds": rounds, "statistic": "median round"}
    after = launches()
    # Whether the timed calls launched the kernels without the dispatcher (csrc/norm_mod_direct.h): forward
    # and backward launches taken over the warm-up and timed rounds, all variants together.
    out["direct_launches"] = (
        None
        if after is None
        else {"forward": after[0] - launches_before[0], "backward": after[1] - launches_before[1]}
    )
    for k, v in samples.items():
        head, _, tail = (
            k.partition(".") if k.startswith(("layer_norm_modulate.", "rms_norm_modulate.")) else ("", "", k)
        )
        (out.setdefault(head, {}) if head else out)[tail] = statistics.median(v)
        (out.setdefault("spread", {}))[k] = [min(v), max(v)]
    # The profiler's CPU-side time of one forward call (the op's CPU self time and total).
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(100):
                ops.layer_norm_modulate(x, sh, sc)
        ev = [e for e in prof.key_averages() if e.key.endswith("layer_norm_modulate")]
        if ev:
            out["profiler_cpu_total_us"] = ev[0].cpu_time_total / max(ev[0].count, 1)
    except Exception as exc:  # informational only
        out["profiler_error"] = f"{type(exc).__name__}: {exc}"
    return out


def bench_shape(B, S, D, layout, args) -> dict:
    ops = _ops()
    x, shift, scale, dy = _inputs(B, S, D, layout)
    out_buf = torch.empty_like(x)
    t_copy = min(_graph_time(lambda: out_buf.copy_(x)) for _ in range(3))
    t_copy_py = _median_events(lambda: out_buf.copy_(x))
    # Bytes each pass must move, in copies of x: per sample the modulation is negligible (forward: read x,
    # write y = 1 copy; backward: read x, dy, write dx = 1.5); per token its rows and gradients count too.
    xb, mb = x.element_size(), shift.element_size()
    f_fwd, f_fb = (
        (1.0, 2.5) if layout == "sample" else ((2 * xb + 2 * mb) / (2 * xb), (5 * xb + 5 * mb) / (2 * xb))
    )
    row = {
        "B": B,
        "S": S,
        "D": D,
        "layout": layout,
        "x_bytes": x.numel() * x.element_size(),
        "copy_ms": t_copy,
        "copy_python_ms": t_copy_py,
        "copy_TBps": 2 * x.numel() * x.element_size() / (t_copy * 1e-3) / 1e12,
    }
    for rms in (False, True):
        name = "rms" if rms else "ln"
        fn = ops.rms_norm_modulate if rms else ops.layer_norm_modulate
        ref = ops.rms_norm_modulate_reference if rms else ops.layer_norm_modulate_reference
        k = _kernel_times(rms, x, shift, scale, dy)
        p = _python_view(fn, x, shift, scale, dy)
        r = _python_view(ref, x, shift, scale, dy) if not args.no_eager else {}
        entry = {
            "kernel_ms": k,
            "python_ms": p,
            "eager_reference_ms": r,
            "pct_copy_kernel": {"fwd": t_copy / k["fwd"], "fwdbwd": 2.5 * t_copy / k["fwdbwd"]},
            "pct_copy_python": {"fwd": t_copy_py / p["fwd"], "fwdbwd": 2.5 * t_copy_py / p["fwdbwd"]},
            # the speed of light: the bytes the op must move over the copy's bandwidth (= pct_copy per sample)
            "pct_sol_kernel": {"fwd": f_fwd * t_copy / k["fwd"], "fwdbwd": f_fb * t_copy / k["fwdbwd"]},
            "errors": _check(rms, fn, x, shift, scale, dy),
        }
        if args.compile and (B, S, D) in ((1, 32760, 1536), (8, 4096, 1152)) and layout == "sample":
            try:
                torch._dynamo.reset()
                entry["compiled_reference_ms"] = _python_view(torch.compile(ref), x, shift, scale, dy)
            except Exception as exc:  # a finding, reported
                entry["compiled_reference_ms"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        try:
            entry["plan"] = list(
                torch.ops.lightning_adaptiveload._norm_modulate_plans(
                    x, scale.reshape(-1, D), S if layout == "sample" else 1, rms, False, 0, 0, 0, 0, 0, 0, 0
                )
            )
        except Exception as exc:
            entry["plan"] = f"{type(exc).__name__}: {exc}"
        row[name] = entry
        torch.cuda.synchronize()
    return row


def sweep(args) -> list[dict]:
    """Launch variants of both ops through the private benchmark operators, each checked for accuracy."""
    ns = torch.ops.lightning_adaptiveload
    out = []
    for B, S, D in SWEEP_SHAPES:
        x, shift, scale, dy = _inputs(B, S, D, "sample", seed=1)
        t_sh, t_sc = shift.reshape(-1, D), scale.reshape(-1, D)
        buf = torch.empty_like(x)
        t_copy = _graph_time(lambda buf=buf, x=x: buf.copy_(x))
        ops = _ops()
        for rms in (False, True):
            ref = ops.rms_norm_modulate_reference if rms else ops.layer_norm_modulate_reference
            xd, shd, scd = (t.detach().double().requires_grad_() for t in (x, shift, scale))
            yr = ref(xd, shd, scd)
            gr = torch.autograd.grad(yr, (xd, shd, scd), dy.double())
            for path, threads, st in FWD_VARIANTS:
                if rms and path in (1, 2):
                    continue
                rec = {
                    "B": B,
                    "S": S,
                    "D": D,
                    "rms": rms,
                    "kind": "fwd",
                    "path": path,
                    "threads": threads,
                    "stages": st,
                    "copy_ms": t_copy,
                }
                try:
                    fn = functools.partial(
                        ns._norm_modulate_tuned, x, t_sh, t_sc, None, None, S, 1e-6, rms, path, threads, st
                    )
                    y = fn()[0]
                    rec["err_y"] = _rel(y, yr)
                    rec["ms"] = _graph_time(fn)
                    rec["pct_copy"] = t_copy / rec["ms"]
                    rec["plan"] = list(
                        ns._norm_modulate_plans(x, t_sc, S, rms, False, path, threads, st, 0, 0, 0, 0)[:9]
                    )
                except Exception as exc:
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                out.append(rec)
                print("sweep", json.dumps(rec), flush=True)
            _, mean, rstd = ns._norm_modulate_tuned(x, t_sh, t_sc, None, None, S, 1e-6, rms, 0, 0, 0)
            for path, vpt, rws, st in BWD_VARIANTS:
                if rms and path == 1:
                    continue
                rec = {
                    "B": B,
                    "S": S,
                    "D": D,
                    "rms": rms,
                    "kind": "bwd",
                    "path": path,
                    "vpt": vpt,
                    "rows": rws,
                    "stages": st,
                    "copy_ms": t_copy,
                }
                try:
                    m = None if rms else mean
                    fn = functools.partial(
                        ns._norm_modulate_backward_tuned,
                        dy,
                        x,
                        t_sc,
                        None,
                        None,
                        m,
                        rstd,
                        S,
                        rms,
                        path,
                        vpt,
                        rws,
                        st,
                    )
                    dx, dsh, dsc, _, _ = fn()
                    rec["err_dx"] = _rel(dx, gr[0])
                    rec["err_dshift"] = _rel(dsh.reshape(gr[1].shape), gr[1])
                    rec["err_dscale"] = _rel(dsc.reshape(gr[2].shape), gr[2])
                    rec["ms"] = _graph_time(fn)
                    rec["pct_copy"] = 1.5 * t_copy / rec["ms"]
                    rec["plan"] = list(
                        ns._norm_modulate_plans(x, t_sc, S, rms, False, 0, 0, 0, path, vpt, rws, st)[9:]
                    )
                except Exception as exc:
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                out.append(rec)
                print("sweep", json.dumps(rec), flush=True)
        torch.cuda.synchronize()
    return out


def compile_check() -> list[dict]:
    """torch.compile of both references at batch 1 and 8: does the backward compile, and match eager?"""
    ops = _ops()
    out = []
    for B, S, D in ((1, 32760, 1536), (8, 4096, 1152)):
        for name, ref in (
            ("ln", ops.layer_norm_modulate_reference),
            ("rms", ops.rms_norm_modulate_reference),
        ):
            x, shift, scale, dy = _inputs(B, S, D, "sample", seed=2)
            rec = {"B": B, "S": S, "D": D, "op": name}
            ins = [t.detach().clone().requires_grad_() for t in (x, shift, scale)]
            eins = [t.detach().clone().requires_grad_() for t in (x, shift, scale)]
            try:
                torch._dynamo.reset()
                y = torch.compile(ref)(*ins)
                g = torch.autograd.grad(y, ins, dy)
                ye = ref(*eins)
                ge = torch.autograd.grad(ye, eins, dy)
                rec.update(
                    ok=True,
                    shapes=[list(t.shape) for t in g],
                    err_y=_rel(y, ye),
                    err_grads=[_rel(a, b) for a, b in zip(g, ge)],
                )
            except Exception as exc:
                rec.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
            out.append(rec)
            print("compile", json.dumps(rec), flush=True)
    return out


def _fmt_sweep(recs) -> str:
    """Per shape, op and pass: the launcher's default, the best variant, and the worst error seen."""
    lines = []
    keys = sorted({(r["B"], r["S"], r["D"], r["rms"], r["kind"]) for r in recs})
    for B, S, D, rms, kind in keys:
        rs = [r for r in recs if (r["B"], r["S"], r["D"], r["rms"], r["kind"]) == (B, S, D, rms, kind)]
        ok = [r for r in rs if "ms" in r]
        bad = [r for r in rs if "error" in r]
        errs = [v for r in ok for k2, v in r.items() if k2.startswith("err_")]
        knob = "threads" if kind == "fwd" else "vpt"
        default = next((r for r in ok if r["path"] in (2, 4) and r[knob] == 0 and r["stages"] == 0), None)
        old_path = next((r for r in ok if r["path"] == (2 if kind == "fwd" else 1)), None)
        best = min(ok, key=lambda r: r["ms"]) if ok else None

        def desc(r, knob=knob):
            rows = f" r{r['rows']}" if "rows" in r else ""
            return (
                f"p{r['path']} {knob}{r[knob]}{rows} st{r['stages']} {r['ms']:.4f} ms {100 * r['pct_copy']:.0f}% "
                f"plan {r.get('plan')}"
            )

        lines.append(
            f"{'rms' if rms else 'ln'} {kind} {B}x{S}x{D}: default "
            f"{desc(default) if default else '-'} | best {desc(best) if best else '-'} | "
            f"regs {desc(old_path) if old_path else '-'} | max err "
            f"{max(errs) if errs else float('nan'):.2e} | {len(bad)} refused"
        )
    return "\n".join(lines)


def _fmt(rows) -> str:
    lines = [
        "| op | B x S x D | layout | copy ms (TB/s) | kernel fwd ms (% copy) | kernel fwd+bwd ms (% of 2.5 copies) "
        "| python fwd / fwd+bwd ms (% copy) | eager ref fwd / fwd+bwd ms |  (per token: % of the speed of light)",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name in ("ln", "rms"):
            e = r[name]
            k, p, ref = e["kernel_ms"], e["python_ms"], e["eager_reference_ms"]
            pk, pp = e["pct_copy_kernel"], e["pct_copy_python"]
            if r["layout"] != "sample":  # per token: the share of the speed of light (modulation bytes too)
                pk = e["pct_sol_kernel"]
            refs = f"{ref['fwd']:.3f} / {ref['fwdbwd']:.3f}" if ref else "-"
            lines.append(
                f"| {name} | {r['B']} x {r['S']} x {r['D']} | {r['layout']} | {r['copy_ms']:.4f} ({r['copy_TBps']:.2f}) "
                f"| {k['fwd']:.4f} ({100 * pk['fwd']:.0f}%) | {k['fwdbwd']:.4f} ({100 * pk['fwdbwd']:.0f}%) "
                f"| {p['fwd']:.4f} / {p['fwdbwd']:.4f} ({100 * pp['fwd']:.0f}% / {100 * pp['fwdbwd']:.0f}%) | {refs} |"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out", default="benchmarks/results", help="a directory (a dated name is made) or a .json path"
    )
    ap.add_argument("--sweep", action="store_true", help="also time the launch variants")
    ap.add_argument("--compile-check", action="store_true", help="compile the references at batch 1 and 8")
    ap.add_argument("--compile-check-only", action="store_true", help="only that (no timings)")
    ap.add_argument(
        "--compile", action="store_true", help="time torch.compile of the references at two shapes"
    )
    ap.add_argument("--no-eager", action="store_true", help="skip the eager references")
    ap.add_argument("--shapes", default="", help="comma-separated indices into SHAPES (default: all)")
    ap.add_argument("--tag", default="", help="appended to the file name")
    ap.add_argument("--host-only", action="store_true", help="only the host overhead per call")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_norm_modulate_limit: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name()
    meta = {
        "device": dev,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "date": _dt.date.today().isoformat(),
        "dtypes": {"x": "bfloat16", "shift/scale": "float32", "dy": "bfloat16"},
        "eps": 1e-6,
        "method": "kernel: CUDA graph of 20 back-to-back operator calls, median of 10 replays; python: CUDA "
        "events per public call, median of 25 after 5 warm-up calls; copy: out.copy_(x) timed both ways",
    }
    result = {"meta": meta}
    # Clocks up before the first number (an idle H200 sits at 345 MHz): half a second of copies.
    warm = torch.empty(2**28, device="cuda", dtype=torch.bfloat16)
    warm2 = torch.empty_like(warm)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.5:
        warm2.copy_(warm)
        torch.cuda.synchronize()
    del warm, warm2
    picked = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    if args.compile_check or args.compile_check_only:
        result["compile_check"] = compile_check()
    if args.compile_check_only:  # needs no fused kernels (LIGHTNING_ADAPTIVELOAD_FUSED=0 skips their build)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        return 0 if all(r.get("ok") for r in result["compile_check"]) else 1
    ops = _ops()
    ok, info = ops.fused_op_status()
    if not ok:
        print(f"bench_norm_modulate_limit: the fused kernels are unavailable: {info}", file=sys.stderr)
        return 1
    result["host"] = host_overhead()
    print("host", json.dumps(result["host"]), flush=True)
    if args.host_only:
        picked = []
    rows = []
    for B, S, D, layout in picked:
        row = bench_shape(B, S, D, layout, args)
        rows.append(row)
        print("row", json.dumps(row), flush=True)
    result["rows"] = rows
    if args.sweep:
        result["sweep"] = sweep(args)
    out = Path(args.out)
    if out.suffix != ".json":
        slug = dev.lower().replace(" ", "-")
        out = out / f"norm_modulate_limit_{slug}_{meta['date']}{('_' + args.tag) if args.tag else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    if args.sweep:
        print(_fmt_sweep(result["sweep"]))
    print(_fmt(rows))
    h = result["host"]
    print(
        "host us/call (1 x 8 x 1536): LN fwd {:.1f} (no grad {:.1f}; before {:.1f} / {:.1f}), fwd+bwd {:.1f}; RMS fwd {:.1f} (no grad {:.1f}), "
        "fwd+bwd {:.1f}; fast entry {:.1f} (no grad {:.1f}); op direct {:.1f}; bwd op direct {:.1f}; "
        "F.layer_norm {:.1f} (grad {:.1f}, fwd+bwd {:.1f}); torch.add {:.1f}; direct launches {}".format(
            h["layer_norm_modulate"]["fwd_grad_us"],
            h["layer_norm_modulate"]["fwd_nograd_us"],
            h["before_fwd_grad_us"],
            h["before_fwd_nograd_us"],
            h["layer_norm_modulate"]["fwdbwd_us"],
            h["rms_norm_modulate"]["fwd_grad_us"],
            h["rms_norm_modulate"]["fwd_nograd_us"],
            h["rms_norm_modulate"]["fwdbwd_us"],
            h.get("fast_entry_grad_us", float("nan")),
            h.get("fast_entry_nograd_us", float("nan")),
            h["op_direct_us"],
            h["bwd_op_direct_us"],
            h["F.layer_norm_us"],
            h["F.layer_norm_grad_us"],
            h["F.layer_norm_fwdbwd_us"],
            h["torch.add_us"],
            h.get("direct_launches"),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
