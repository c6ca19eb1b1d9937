"""Training-step speed of wan-1.3b over the steps of a planned epoch of a mix (issue 17's judged figure).

The issue judges MFU and tokens/s "on the wan21_480p mix at the calibrated max_tokens", not on one clip. This
plans one epoch of the mix (a synthetic index drawn from ``--mix``; lockstep schedule, bucketed tail,
``--world`` ranks, ``max_compute="auto"``) with the library's planner and takes rank 0's steps: a histogram of
(latent shape, batch size). Each distinct (frames, batch size) is timed once per variant with the method of
``bench_step.py`` (CUDA events around forward + backward, warm-up, median; the optimizer step apart), on
the landscape shape of that frame count; the portrait and square buckets of the same frame count (tokens
within 2.5%) are priced by that time scaled by their FLOPs. The epoch's time is the sum over its steps; MFU =
3 x forward FLOPs (recompute not counted) over all steps / that time / dense bf16 peak; tokens/s the same
over tokens. Each variant's compile time (the first steps) is reported apart, not in the epoch time.

    python benchmarks/bench_step_mix.py --variants baseline,compile+sac10 --max-tokens 32760   # one H100
    python benchmarks/bench_step_mix.py --device cpu --preset tiny --mix tiny --max-tokens 900 \\
        --variants eager,compiled --reps 1                                                    # smoke test
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import gc
import json
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch._dynamo

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import (  # noqa: E402
    VARIANTS,
    _build,
    _fwd_bwd,
    _measure,
    add_common_args,
    device_setup,
    step_inputs,
)

from lightning_adaptiveload.monitor.report import jsonable  # noqa: E402
from lightning_adaptiveload.tools.memory import AUTO_BUDGET_FRACTION, ActivationMemory  # noqa: E402


def epoch_steps(
    mix_name: str, max_tokens: int, world: int, samples: int, seed: int = 0
) -> collections.Counter:
    """Rank 0's steps of one planned lockstep epoch of the mix: Counter of ((C, T, H, W), batch size)."""
    from lightning_adaptiveload.data.mixes import load_mix
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.planner import plan_epoch

    mix = load_mix(mix_name)
    shapes = [tuple(bk.latent_shape) for bk in mix.buckets]
    flat = [shapes[i] for i in mix.sample_buckets(np.random.default_rng(seed), samples)]
    index = [flat[i : i + 100] for i in range(0, len(flat), 100)]
    batcher = DualConstraintBatcher(max_tokens, max_compute="auto", partial="emit")
    plan = plan_epoch(index, world, 0, batcher, seed=seed, epoch=0, mode="lockstep", lockstep_tail="bucketed")
    steps: collections.Counter = collections.Counter()
    for k in range(plan.steps):
        b, refs = plan.step_batch(0, k)
        if refs:
            steps[(tuple(plan.buckets[b]["shape"]), len(refs))] += 1
    return steps


def probe_memory(model, opt, fwd, cfg, timed, args, dev) -> dict:
    """Fit the model's ActivationMemory (``acceleration.probe_activation_memory``) on three of the epoch's
    batches: the longest B = 1 batch (a clip), the largest batch (images) and the shortest B = 1 batch, each
    at every block and at half of them checkpointed; then set ``num_blocks="auto"`` with a budget of
    ``--ckpt-budget`` x the GPU's memory. Returns what was measured and fitted (for the results JSON)."""
    from lightning_adaptiveload.models.acceleration import cuda_step_peak, probe_activation_memory

    seq = {k: k[0] * (v[2] // cfg.patch_size[1]) * (v[3] // cfg.patch_size[2]) for k, v in timed.items()}
    ones = [k for k in timed if k[1] == 1]
    picks = [max(ones, key=seq.get), max(timed, key=lambda k: (k[1], seq[k])), min(ones, key=seq.get)]
    batches = [((k[1], cfg.in_channels, *timed[k][1:]), args.text_len) for k in dict.fromkeys(picks)]

    def step(shape, text_len):
        x, ts, ctx = step_inputs((shape[0], *shape[2:]), cfg, text_len, cfg.text_dim, dev)
        _fwd_bwd(fwd, x, ts, ctx, dev)
        opt.step()
        opt.zero_grad(set_to_none=True)

    # On CPU (a smoke run) there is no allocator peak to read: the fit sees zeros.
    peak_of = (
        cuda_step_peak(step) if dev.type == "cuda" else (lambda shape, text: (step(shape, text), 0.0)[1])
    )
    n = len(model.blocks)
    policy = model.blocks[0].checkpoint_policy
    memory, points = probe_activation_memory(model, peak_of, batches, policy, counts=(n, n // 2))
    total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 64 * 2**30
    budget = args.ckpt_budget * total
    model.set_activation_checkpointing(True, policy, "auto", memory=memory, budget_bytes=budget)
    return {
        "budget_bytes": budget,
        "fitted": memory.to_dict(),
        "points": [dict(p.__dict__) for p in points],
        "fit_error_gib": [
            (memory.peak_bytes(p.batch, p.seq, p.text, p.checkpointed) - p.peak_bytes) / 2**30 for p in points
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, reps=2)
    ap.add_argument("--mix", default="wan21_480p")
    ap.add_argument("--max-tokens", type=int, default=32760)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--variants", default="baseline,compile+sac10")
    ap.add_argument(
        "--ckpt-budget",
        type=float,
        default=AUTO_BUDGET_FRACTION,
        help="auto checkpointing: share of the GPU memory a step may use",
    )
    ap.add_argument(
        "--recompile-limit",
        type=int,
        default=None,
        help="torch._dynamo.config.recompile_limit for the run (default: PyTorch's, 8)",
    )
    args = ap.parse_args(argv)
    started = time.perf_counter()
    if args.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = args.recompile_limit
    from lightning_adaptiveload.models.video_dit import forward_flops

    dev, cfg, name, peak, tag = device_setup(args)
    ph, pw = cfg.patch_size[1], cfg.patch_size[2]
    steps = epoch_steps(args.mix, args.max_tokens, args.world, args.samples)
    # One timed shape per (frames, batch size): the most common (H, W) of that pair in the epoch.
    by_key: dict[tuple[int, int], collections.Counter] = collections.defaultdict(collections.Counter)
    for (shape, n), count in steps.items():
        by_key[(shape[1], n)][shape] += count
    timed = {key: c.most_common(1)[0][0] for key, c in by_key.items()}
    path = os.path.join(
        args.out, f"bench_step_mix_{tag}_{args.max_tokens}_{_dt.date.today().isoformat()}.json"
    )

    def tokens(shape):
        return shape[1] * (shape[2] // ph) * (shape[3] // pw)

    def flops(shape, n):
        return 3 * n * forward_flops(cfg, tokens(shape), args.text_len)

    result = {
        "benchmark": "benchmarks/bench_step_mix.py",
        "device": name,
        "torch": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "preset": args.preset,
        "mix": args.mix,
        "max_tokens": args.max_tokens,
        "plan": {
            "schedule": "lockstep",
            "lockstep_tail": "bucketed",
            "world": args.world,
            "samples": args.samples,
        },
        "epoch_steps": [
            {"shape": list(s), "batch_size": n, "steps": c} for (s, n), c in sorted(steps.items())
        ],
        "timed_shapes": [
            {"frames": k[0], "batch_size": k[1], "shape": list(v)} for k, v in sorted(timed.items())
        ],
        "mfu_convention": "3 x forward FLOPs (matmuls, forward_flops), recompute not counted; step = fwd+bwd+opt",
        "peak_flops": peak,
        "variants": {},
    }

    def save():
        with open(path, "w") as f:
            json.dump(jsonable(result), f, indent=1)

    print(f"{sum(steps.values())} steps of rank 0, {len(steps)} (shape, B); timing {len(timed)}", flush=True)
    for vname in args.variants.split(","):
        if time.perf_counter() - started > args.time_budget_s:
            print(f"time budget reached, skipping {vname}", flush=True)
            continue
        spec = VARIANTS[vname]
        entry: dict = {"spec": dict(spec), "rows": {}}
        result["variants"][vname] = entry
        t_build = time.perf_counter()
        try:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            model, opt, fwd, info = _build(spec, cfg, dev, cfg.text_dim)
            entry["info"] = info
            if spec.get("ckpt") and spec["ckpt"][1] == "auto":
                entry["memory"] = probe_memory(model, opt, fwd, cfg, timed, args, dev)
                print(f"{vname}: fitted {json.dumps(entry['memory']['fitted'])}", flush=True)
        except Exception as err:
            entry["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            continue
        ms_of: dict[tuple[int, int], float] = {}
        for key in sorted(timed, key=lambda k: (-k[0], k[1])):  # longest first: an OOM shows at once
            shape = timed[key]
            if time.perf_counter() - started > args.time_budget_s:
                break
            try:
                row = _measure(
                    fwd, model, opt, (key[1], *shape[1:]), cfg, args.text_len, cfg.text_dim, dev, args.reps,
                    False, spec["model"] == "diffusers",
                )  # fmt: skip
            except torch.OutOfMemoryError:
                row = {"error": "OOM"}
            except Exception as err:
                row = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                traceback.print_exc()
            opt.zero_grad(set_to_none=True)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            entry["rows"][f"T{key[0]}xB{key[1]}"] = row
            if getattr(model, "last_checkpointed_blocks", None) is not None:
                row["checkpointed_blocks"] = model.last_checkpointed_blocks
                if "memory" in entry:
                    mem = ActivationMemory.from_dict(entry["memory"]["fitted"])
                    seq = key[0] * (shape[2] // ph) * (shape[3] // pw)
                    row["predicted_peak_gib"] = (
                        mem.peak_bytes(key[1], seq, args.text_len, row["checkpointed_blocks"]) / 2**30
                    )
            if "fwd_bwd_ms" in row:
                ms_of[key] = row["fwd_bwd_ms"] + row["opt_ms"]
                f = flops(shape, key[1])
                row["mfu"] = f / (ms_of[key] / 1e3) / peak if peak else None
            print(
                f"{vname:18s} T={key[0]:2d} B={key[1]:2d} {json.dumps({k: row.get(k) for k in ('fwd_bwd_ms', 'opt_ms', 'peak_gib', 'predicted_peak_gib', 'checkpointed_blocks', 'first_step_s', 'mfu', 'error')})}",
                flush=True,
            )
            save()
        entry["graphs_compiled"] = int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))
        entry["compile_and_warmup_s"] = time.perf_counter() - t_build
        if len(ms_of) == len(timed):
            total_s = total_flops = total_tokens = 0.0
            for (shape, n), count in steps.items():
                key = (shape[1], n)
                ref = timed[key]
                seconds = ms_of[key] / 1e3 * flops(shape, n) / flops(ref, n)  # same frames, same B
                total_s += count * seconds
                total_flops += count * flops(shape, n)
                total_tokens += count * n * tokens(shape)
            entry["epoch"] = {
                "steps": sum(steps.values()),
                "seconds": total_s,
                "tokens_per_s": total_tokens / total_s,
                "mfu": total_flops / total_s / peak if peak else None,
            }
            print(f"{vname}: epoch {json.dumps(entry['epoch'])}", flush=True)
        else:
            entry["epoch"] = {"error": f"timed {len(ms_of)} of {len(timed)} (shape, B): no epoch figure"}
        save()
        del model, opt, fwd
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    base = result["variants"].get(args.variants.split(",")[0], {}).get("epoch", {})
    for entry in result["variants"].values():
        ep = entry.get("epoch", {})
        if "tokens_per_s" in ep and "tokens_per_s" in base:
            ep["speedup_vs_first"] = ep["tokens_per_s"] / base["tokens_per_s"]
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
