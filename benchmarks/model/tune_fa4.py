"""FlashAttention-4's tile configurations on this GPU, side by side (issue 17: the attention kernels are 70%
of a clip's step).

flash-attn-4 picks its Hopper forward tile and backward configuration from the head dim alone (forward
128 x 128 for head dim 128, where FlashAttention-3's C++ uses 128 x 176; backward FA3's 80 x 128). This
script times each candidate on the wan21_480p mix's attention shapes (12 heads of 128, bf16, q, k, v as the
model lays them out), calling flash-attn-4's own ``_flash_attn_fwd`` / ``_flash_attn_bwd`` with CUDA events
(3 warm-ups, median of ``--reps``). Every candidate's output and gradients are compared with the default
configuration's (relative Frobenius error); a candidate that fails to compile or to run is recorded with
its error. The backward configuration cannot be passed on Hopper (flash-attn-4 derives it inside), so each
candidate replaces ``interface._tile_size_bwd_sm90`` for its own calls only.

Writes ``tune_fa4_<device>_<date>.json`` into ``--out`` after every candidate (``best_forward`` /
``best_backward``: the lowest total time over the self-attention shapes) and prints a table last.

    python benchmarks/model/tune_fa4.py --out benchmarks/results        # one H100, a few minutes
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import statistics
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import add_out_arg, cuda_event_times, device_tag  # noqa: E402
from bench_attention import HEAD_DIM, HEADS, SHAPES  # noqa: E402

# bench_attention.py's shapes (name -> (B, Sq, Skv)); by default the long clips, 20 images and one cross-attention.
DEFAULT_SHAPES = "self_81f,self_65f,self_33f,self_20img,cross_81f"
# (tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap); the first is flash-attn-4 4.0.0b36's own for head dim 128.
FORWARD = [
    (128, 128, True, True),
    (128, 144, True, True),
    (128, 160, True, True),
    (128, 176, True, True),
    (128, 192, True, True),
    (128, 112, True, True),
    (128, 176, False, True),
    (128, 128, False, True),
    (192, 128, True, True),
    (192, 112, True, True),
    (192, 96, True, True),
]
# BwdConfig overrides of the default (m 80, n 128, FA3's non-causal head-dim-128 choice).
BACKWARD = [
    {},
    {"m_block_size": 64, "dQ_swapAB": False},
    {"m_block_size": 96, "dQ_swapAB": True},
    {"m_block_size": 64, "dQ_swapAB": False, "AtomLayoutMdQ": 2},
    {"m_block_size": 128, "dQ_swapAB": False, "AtomLayoutMdQ": 2},
    {"m_block_size": 80, "n_block_size": 112},
    {"m_block_size": 64, "n_block_size": 160, "dQ_swapAB": False},
    {"m_block_size": 80, "num_stages_dO": 1},
]


def _flops(b, sq, skv):
    return 4 * b * HEADS * sq * skv * HEAD_DIM


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _label_fwd(c):
    return f"{c[0]}x{c[1]}{' rs' if c[2] else ''}{' ol' if c[3] else ''}"


def _label_bwd(o):
    return ",".join(f"{k}={v}" for k, v in o.items()) or "default"


def _candidate(call, reps: int, shape: str, flop_factor: float, refs: dict, compared: int) -> dict:
    """Time one configuration on one shape: the first call (a compile), then CUDA events. The first
    ``compared`` values it returns are compared with the first configuration's on this shape (``refs``,
    filled on first use)."""
    try:
        t0 = time.perf_counter()
        with torch.no_grad():
            got = call()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        with torch.no_grad():
            ms = statistics.median(cuda_event_times(call, reps, 3))
    except Exception as err:  # a configuration that does not compile or run: recorded, not fatal
        return {"error": f"{type(err).__name__}: {str(err)[:300]}"}
    got = tuple(got)[:compared]
    ref = refs.setdefault(shape, got)
    return {
        "ms": ms,
        "tflops": flop_factor * _flops(*SHAPES[shape]) / ms / 1e9,
        "first_call_s": first,
        "rel_err_vs_default": max(_rel(a, b) for a, b in zip(got, ref)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--time-budget-s", type=float, default=300.0)
    add_out_arg(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_fa4.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from flash_attn.cute import interface

    t_start = time.perf_counter()
    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"tune_fa4_{device_tag(name)}_{_dt.date.today()}.json")
    result = {
        "device": name,
        "capability": list(torch.cuda.get_device_capability(0)),
        "torch": torch.__version__,
        "date": str(_dt.date.today()),
        "heads": HEADS,
        "head_dim": HEAD_DIM,
        "method": "flash-attn-4 _flash_attn_fwd/_flash_attn_bwd, CUDA events, 3 warm-ups, median of reps; "
        "fwd FLOPs 4*B*H*Sq*Skv*d, bwd 2.5x fwd",
        "forward": {},
        "backward": {},
    }

    def save():
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    shapes = args.shapes.split(",")
    inputs = {}
    for s in shapes:
        b, sq, skv = SHAPES[s]
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (
            torch.randn(b, n, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
            for n in (sq, skv, skv)
        )
        dout = torch.randn(b, sq, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16, generator=g)
        inputs[s] = (q, k, v, dout)

    def out_of_time(kind: str, label: str) -> bool:
        if time.perf_counter() - t_start <= args.time_budget_s:
            return False
        result[kind][label] = {"skipped": "time budget"}
        return True

    def record(kind: str, label: str, row: dict) -> None:
        result[kind][label] = row
        save()
        print(kind[:3], label, json.dumps({s: round(r.get("ms", -1), 3) for s, r in row.items()}), flush=True)

    # Forward candidates.
    ref_fwd = {}
    for cfg in FORWARD:
        label = _label_fwd(cfg)
        if out_of_time("forward", label):
            continue
        kw = dict(tile_mn=(cfg[0], cfg[1]), mma_pv_is_rs=cfg[2], intra_wg_overlap=cfg[3], return_lse=True)
        row = {}
        for s in shapes:
            q, k, v, _ = inputs[s]
            call = partial(interface._flash_attn_fwd, q, k, v, **kw)
            row[s] = _candidate(call, args.reps, s, 1.0, ref_fwd, compared=1)  # out
        record("forward", label, row)

    # Backward candidates (with the default forward's out and lse).
    original = interface._tile_size_bwd_sm90
    base_cfg = original(HEAD_DIM, HEAD_DIM, False, False)
    fwd_state = {}
    for s in shapes:
        q, k, v, dout = inputs[s]
        with torch.no_grad():
            res = interface._flash_attn_fwd(q, k, v, return_lse=True)
        fwd_state[s] = (res[0], res[1])
    ref_bwd = {}
    for override in BACKWARD:
        label = _label_bwd(override)
        if out_of_time("backward", label):
            continue
        cfg = dataclasses.replace(base_cfg, **override)
        interface._tile_size_bwd_sm90 = lambda *a, _cfg=cfg, **k: _cfg
        row = {}
        try:
            for s in shapes:
                q, k, v, dout = inputs[s]
                out, lse = fwd_state[s]
                call = partial(interface._flash_attn_bwd, q, k, v, out, dout, lse)
                row[s] = _candidate(call, args.reps, s, 2.5, ref_bwd, compared=3)  # dq, dk, dv
        finally:
            interface._tile_size_bwd_sm90 = original
        record("backward", label, row)

    selfs = [s for s in shapes if s.startswith("self")]

    def best(table):
        scored = {
            label: sum(row[s]["ms"] for s in selfs)
            for label, row in table.items()
            if all("ms" in row.get(s, {}) and row[s]["rel_err_vs_default"] < 0.01 for s in selfs)
        }
        return min(scored, key=scored.get) if scored else None, scored

    result["best_forward"], result["forward_total_ms"] = best(result["forward"])
    result["best_backward"], result["backward_total_ms"] = best(result["backward"])
    fwd_best = next((c for c in FORWARD if _label_fwd(c) == result["best_forward"]), None)
    result["best_forward_args"] = list(fwd_best) if fwd_best else None
    bwd_best = next((o for o in BACKWARD if _label_bwd(o) == result["best_backward"]), None)
    result["best_backward_override"] = bwd_best
    result["elapsed_s"] = time.perf_counter() - t_start
    save()

    print(f"\n{'candidate':<44}" + "".join(f"{s:>12}" for s in shapes))
    for kind in ("forward", "backward"):
        for label, row in result[kind].items():
            cells = "".join(
                f"{row[s]['ms']:>12.3f}" if "ms" in row.get(s, {}) else f"{'-':>12}" for s in shapes
            )
            print(f"{kind[:3]} {label:<40}{cells}")
    print("best forward:", result["best_forward"], "best backward:", result["best_backward"])
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
