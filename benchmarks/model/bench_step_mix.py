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

``--schedule packed`` plans the same epoch with the packed schedule instead (issue 36): rank 0 takes one pack
of samples of any shapes per step. Each distinct pack (its shapes, in order) up to ``--max-packs`` of them,
the most frequent first, is timed through ``model(list_of_latents, ...)`` (forward + backward of every
sample's loss, CUDA events, median), the optimizer step apart as above. Packs not timed are priced by the
pack cost model ``c0 + sum(alpha*S + beta*S^2)`` fitted to the timed ones (``CostModel.fit_packs``); the
result says how many of the epoch's steps were timed and the fit's error on the timed packs. Regional
compile only (a whole-model compile does not take a list of latents).

    python benchmarks/model/bench_step_mix.py --variants baseline,compile+sac10 --max-tokens 32760   # one H100
    python benchmarks/model/bench_step_mix.py --device cpu --preset tiny --mix tiny --max-tokens 900 \\
        --variants eager,compiled --reps 1                                                    # smoke test
    python benchmarks/model/bench_step_mix.py --schedule packed --variants baseline,compile+sac10  # packed epoch
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

from lightning_adaptiveload.models.memory import AUTO_BUDGET_FRACTION, ActivationMemory  # noqa: E402
from lightning_adaptiveload.monitor.report import jsonable  # noqa: E402


def epoch_steps(
    mix_name: str, max_tokens: int, world: int, samples: int, seed: int = 0
) -> collections.Counter:
    """Rank 0's steps of one planned lockstep epoch of the mix: Counter of ((C, T, H, W), batch size)."""
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.planner import plan_epoch
    from lightning_adaptiveload.planning.settings import PlanSettings
    from lightning_adaptiveload.shards.mixes import load_mix

    mix = load_mix(mix_name)
    shapes = [tuple(bk.latent_shape) for bk in mix.buckets]
    flat = [shapes[i] for i in mix.sample_buckets(np.random.default_rng(seed), samples)]
    index = [flat[i : i + 100] for i in range(0, len(flat), 100)]
    batcher = DualConstraintBatcher(max_tokens, max_compute="auto", partial="emit")
    plan = plan_epoch(
        index,
        world,
        0,
        batcher,
        seed=seed,
        epoch=0,
        settings=PlanSettings(schedule="lockstep", lockstep_tail="bucketed"),
    )
    steps: collections.Counter = collections.Counter()
    for k in range(plan.steps):
        b, refs = plan.step_batch(0, k)
        if refs:
            steps[(tuple(plan.buckets[b]["shape"]), len(refs))] += 1
    return steps


def epoch_packs(mix_name: str, max_tokens: int, world: int, samples: int, seed: int = 0) -> list[tuple]:
    """Rank 0's steps of one planned packed epoch of the mix: one tuple of (C, T, H, W) shapes per step."""
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.planner import plan_epoch
    from lightning_adaptiveload.planning.settings import PlanSettings
    from lightning_adaptiveload.shards.mixes import load_mix

    mix = load_mix(mix_name)
    shapes = [tuple(bk.latent_shape) for bk in mix.buckets]
    flat = [shapes[i] for i in mix.sample_buckets(np.random.default_rng(seed), samples)]
    index = [flat[i : i + 100] for i in range(0, len(flat), 100)]
    batcher = DualConstraintBatcher(max_tokens, sizing="equal_tokens")
    plan = plan_epoch(index, world, 0, batcher, seed=seed, epoch=0, settings=PlanSettings(schedule="packed"))
    return [tuple(tuple(index[s][i]) for s, i in refs) for refs in plan.rank_batches(0) if refs]


def pick_packs(packs: list[tuple], limit: int) -> list[tuple]:
    """The distinct packs to time: the most frequent first, up to ``limit`` (ties: the plan's order)."""
    counts = collections.Counter(packs)
    return sorted(counts, key=lambda p: (-counts[p], packs.index(p)))[:limit]


def measure_pack(fwd, opt, shapes: tuple, cfg, text_len: int, dev, reps: int) -> dict:
    """Forward + backward of one pack through ``fwd(list_of_latents, t, text)`` (each sample's MSE summed),
    timed as ``bench_step._measure`` times a batch: 2 warm-up steps, then the median of ``reps`` (CUDA events
    on a GPU); the optimizer step on the last step's gradients, timed apart."""
    import statistics

    import torch.nn.functional as F

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    xs = [torch.randn(cfg.in_channels, *shape[1:], device=dev, dtype=dtype) for shape in shapes]
    ts = torch.rand(len(xs), device=dev) * 1000
    ctx = torch.randn(len(xs), text_len, cfg.text_dim, device=dev, dtype=dtype)

    def step():
        if dev.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            outs = fwd(xs, ts, ctx)
        sum(F.mse_loss(o.float(), x.float()) for o, x in zip(outs, xs)).backward()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    walls = []
    for _ in range(2):
        t0 = time.perf_counter()
        step()
        sync()
        walls.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    ms = []
    for i in range(reps):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            ms.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            ms.append(1e3 * (time.perf_counter() - t0))
        if i < reps - 1:
            opt.zero_grad(set_to_none=True)
    opt_ms = []
    for _ in range(2):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        opt_ms.append(1e3 * (time.perf_counter() - t0))
    opt.zero_grad(set_to_none=True)
    return {
        "fwd_bwd_ms": statistics.median(ms),
        "fwd_bwd_ms_all": ms,
        "opt_ms": min(opt_ms),
        "first_step_s": walls[0],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
    }


def add_speedups(result: dict, first: str) -> None:
    """Each variant's epoch tokens/s over the first variant's (``speedup_vs_first``), where both exist."""
    base = result["variants"].get(first, {}).get("epoch", {})
    for entry in result["variants"].values():
        ep = entry.get("epoch", {})
        if "tokens_per_s" in ep and "tokens_per_s" in base:
            ep["speedup_vs_first"] = ep["tokens_per_s"] / base["tokens_per_s"]


def probe_memory(model, opt, fwd, cfg, timed, args, dev) -> dict:
    """Fit the model's ActivationMemory (``acceleration.probe_activation_memory``) on three of the epoch's
    batches: the longest B = 1 batch (a clip), the largest batch (images) and the shortest B = 1 batch, each
    at every block and at half of them checkpointed; then set ``num_blocks="auto"`` with a budget of
    ``--ckpt-budget`` x the GPU's memory. Returns what was measured and fitted (for the results JSON)."""
    from lightning_adaptiveload.models.acceleration import cuda_step_peak, probe_activation_memory

    seq = {k: k[0] * (v[2] // cfg.patch_size[1]) * (v[3] // cfg.patch_size[2]) for k, v in timed.items()}
    ones = [k for k in timed if k[1] == 1]
    picks = [max(ones, key=seq.get), max(timed, key=lambda k: (k[1], seq[k])), min(ones, key=seq.get)]
    # The fit needs three distinct batches (5 points at least); where two picks coincide (a packed epoch's
    # singles hold no batch of several samples), take the next distinct ones by token count.
    picks = list(dict.fromkeys(picks))
    for k in sorted(timed, key=lambda k: (-seq[k] * k[1], k)):
        if len(picks) >= 3:
            break
        if k not in picks:
            picks.append(k)
    batches = [((k[1], cfg.in_channels, *timed[k][1:]), args.text_len) for k in picks]

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
        "--schedule",
        choices=("lockstep", "packed"),
        default="lockstep",
        help="lockstep (bucketed tail): bucketed batches; packed: one pack of any shapes per step",
    )
    ap.add_argument(
        "--max-packs",
        type=int,
        default=16,
        help="packed: distinct packs timed, the most frequent first; the rest priced by the fitted pack model",
    )
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
    if args.schedule == "packed":
        for vname in args.variants.split(","):
            spec = VARIANTS[vname]
            if spec["model"] != "ours" or spec["compile"] in ("model", "nested"):
                ap.error(
                    f"--schedule packed: variant {vname!r} ({spec['model']}, compile={spec['compile']!r}) "
                    "cannot run packs; use this package's model, eager or with regional compile"
                )
        if args.max_packs < 4:
            ap.error(f"--max-packs must be >= 4 (the pack model has 3 terms), got {args.max_packs}")
        return main_packed(args)
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
        "benchmark": "benchmarks/model/bench_step_mix.py",
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
    add_speedups(result, args.variants.split(",")[0])
    save()
    print(f"wrote {path}")
    return 0


def main_packed(args) -> int:
    """``--schedule packed``: see the module docstring."""
    started = time.perf_counter()
    if args.recompile_limit is not None:
        torch._dynamo.config.recompile_limit = args.recompile_limit
    from lightning_adaptiveload.models.video_dit import forward_flops
    from lightning_adaptiveload.planning.cost_model import CostModel

    dev, cfg, name, peak, tag = device_setup(args)
    ph, pw = cfg.patch_size[1], cfg.patch_size[2]
    packs = epoch_packs(args.mix, args.max_tokens, args.world, args.samples)
    chosen = pick_packs(packs, args.max_packs)
    counts = collections.Counter(packs)
    path = os.path.join(
        args.out, f"bench_step_mix_packed_{tag}_{args.max_tokens}_{_dt.date.today().isoformat()}.json"
    )

    def tokens(shape):
        return shape[1] * (shape[2] // ph) * (shape[3] // pw)

    def flops(pack):
        return sum(3 * forward_flops(cfg, tokens(shape), args.text_len) for shape in pack)

    result = {
        "benchmark": "benchmarks/model/bench_step_mix.py --schedule packed",
        "device": name,
        "torch": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "preset": args.preset,
        "mix": args.mix,
        "max_tokens": args.max_tokens,
        "plan": {"schedule": "packed", "world": args.world, "samples": args.samples},
        "epoch_packs": {"steps": len(packs), "distinct": len(counts), "timed": len(chosen)},
        "timed_packs": [
            {"shapes": [list(x) for x in p], "tokens": [tokens(x) for x in p], "steps": counts[p]}
            for p in chosen
        ],
        "mfu_convention": "3 x forward FLOPs (matmuls, forward_flops), recompute not counted; step = fwd+bwd+opt",
        "peak_flops": peak,
        "variants": {},
    }

    def save():
        with open(path, "w") as f:
            json.dump(jsonable(result), f, indent=1)

    print(
        f"{len(packs)} packed steps of rank 0, {len(counts)} distinct packs; timing {len(chosen)}", flush=True
    )
    for vname in args.variants.split(","):
        if time.perf_counter() - started > args.time_budget_s:
            print(f"time budget reached, skipping {vname}", flush=True)
            continue
        spec = VARIANTS[vname]
        entry: dict = {"spec": dict(spec), "rows": []}
        result["variants"][vname] = entry
        t_build = time.perf_counter()
        try:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            # fwd(x, t, ctx) is model(x, t, ctx, None): x a list of latents runs as a pack.
            model, opt, fwd, info = _build(spec, cfg, dev, cfg.text_dim)
            entry["info"] = info
            if spec.get("ckpt") and spec["ckpt"][1] == "auto":
                # A pack is checkpointed as one sequence of its summed tokens: probe on single samples.
                singles = {(p[0][1], 1): p[0] for p in chosen if len(p) == 1}
                if not singles:
                    raise ValueError(
                        "checkpoint_blocks auto needs a pack of one sample among the timed packs"
                    )
                # And a batch of the shortest sample up to max_tokens (a pack of equal lengths runs as one).
                pt, ph, pw = cfg.patch_size
                short = min(singles, key=lambda k: singles[k][1] * singles[k][2] * singles[k][3])
                c_, t_, h_, w_ = singles[short]
                most = max(2, args.max_tokens // ((t_ // pt) * (h_ // ph) * (w_ // pw)))
                for b in (most, max(2, most // 2)):  # two batch sizes: the fit needs three distinct batches
                    singles[(short[0], b)] = singles[short]
                entry["memory"] = probe_memory(model, opt, fwd, cfg, singles, args, dev)
        except Exception as err:
            entry["error"] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
            continue

        ms_of: dict[tuple, float] = {}
        for pack in chosen:
            if time.perf_counter() - started > args.time_budget_s:
                break
            try:
                row = measure_pack(fwd, opt, pack, cfg, args.text_len, dev, args.reps)
            except torch.OutOfMemoryError:
                row = {"error": "OOM"}
            except Exception as err:
                row = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                traceback.print_exc()
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            row["tokens"] = [tokens(x) for x in pack]
            if "fwd_bwd_ms" in row:
                ms_of[pack] = row["fwd_bwd_ms"] + row["opt_ms"]
                row["mfu"] = flops(pack) / (ms_of[pack] / 1e3) / peak if peak else None
            entry["rows"].append(row)
            print(
                f"{vname:18s} pack {row['tokens']} "
                f"{json.dumps({k: row.get(k) for k in ('fwd_bwd_ms', 'opt_ms', 'peak_gib', 'first_step_s', 'mfu', 'error')})}",
                flush=True,
            )
            save()
        entry["graphs_compiled"] = int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))
        entry["compile_and_warmup_s"] = time.perf_counter() - t_build
        if len(ms_of) >= 4:
            seqs = [[tokens(x) for x in p] for p in ms_of]
            try:
                model_fit = CostModel.fit_packs(seqs, [v / 1e3 for v in ms_of.values()])
            except ValueError as err:  # timings that do not grow with the tokens (a noisy CPU smoke run)
                entry["epoch"] = {"error": f"no pack model from {len(ms_of)} timed packs: {err}"}
                print(f"{vname}: {entry['epoch']['error']}", flush=True)
                save()
                continue
            errors = [model_fit.pack_cost(t) / (v / 1e3) - 1 for t, v in zip(seqs, ms_of.values())]
            total_s = total_flops = total_tokens = 0.0
            timed_steps = 0
            for pack, count in counts.items():
                if pack in ms_of:
                    seconds = ms_of[pack] / 1e3
                    timed_steps += count
                else:
                    seconds = model_fit.pack_cost([tokens(x) for x in pack])
                total_s += count * seconds
                total_flops += count * flops(pack)
                total_tokens += count * sum(tokens(x) for x in pack)
            entry["pack_model"] = {
                "model": model_fit.to_dict(),
                "mean_abs_error_on_timed": float(np.mean(np.abs(errors))),
                "max_abs_error_on_timed": float(np.max(np.abs(errors))),
            }
            entry["epoch"] = {
                "steps": len(packs),
                "steps_timed": timed_steps,
                "steps_priced_by_pack_model": len(packs) - timed_steps,
                "seconds": total_s,
                "tokens_per_s": total_tokens / total_s,
                "mfu": total_flops / total_s / peak if peak else None,
            }
            print(
                f"{vname}: epoch {json.dumps(entry['epoch'])}; pack model {json.dumps(entry['pack_model'])}"
            )
        else:
            entry["epoch"] = {
                "error": f"timed {len(ms_of)} packs: fewer than 4, no pack model, no epoch figure"
            }
        save()
        del model, opt, fwd
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    add_speedups(result, args.variants.split(",")[0])
    save()
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
