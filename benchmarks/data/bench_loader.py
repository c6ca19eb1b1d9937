"""Data-path speed on CPU: loader throughput, batcher cost per sample, plan time, runtime step overhead.

Measures, on this machine:

1. Loader throughput (samples/s, tokens/s, MB/s, ms per batch p50/p95, time to first batch) of
   ``AdaptiveLoadDataModule``'s training loader with 0 and 2 workers, both schedules, one rank, over
   synthetic shards of the ``wan21_480p`` mix (real Wan 2.1 latent shapes, float16; ``--scale`` divides
   H and W to fit small disks) written to a temporary directory.
2. The batcher as a WebDataset stage: microseconds per sample, bucketing only and with ``collate``.
3. ``plan_epoch`` time for large synthetic indexes (shapes only, no files): 1M samples at 64 ranks and
   more, both schedules, with the plan's own balance estimate.
4. Runtime bookkeeping per step: a worker's per-batch cost without reading or collating (the plan
   lookups and buffers), in microseconds.

Writes ``benchmarks/results/loader_<cpu>_<date>.json`` with the CPU name, shapes and date. Never asserts a
time. Run::

    python benchmarks/data/bench_loader.py                 # full run (~5-10 min on 2 cores)
    python benchmarks/data/bench_loader.py --quick         # smaller sizes, for a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import cpu_name

from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.planning.sizing import tokens_per_sample
from lightning_adaptiveload.shards.mixes import Mix, load_mix
from lightning_adaptiveload.shards.synthetic import SyntheticShards


def scaled_mix(name: str, scale: int) -> Mix:
    """The mix with H and W divided by ``scale`` (kept even): same shares and frame counts."""
    mix = load_mix(name)
    if scale == 1:
        return mix
    data = {"name": f"{mix.name}_div{scale}", "note": f"{mix.name} with H, W / {scale}", "buckets": []}
    for b in mix.buckets:
        c, t, h, w = b.latent_shape
        data["buckets"].append(
            {"latent_shape": [c, t, max(2, h // scale // 2 * 2), max(2, w // scale // 2 * 2)], "p": b.p}
        )
    path = os.path.join(tempfile.mkdtemp(), "mix.json")
    with open(path, "w") as f:
        json.dump(data, f)
    return load_mix(path)


def bench_loader(data: str, max_tokens: int, workers: int, schedule: str, epochs: int) -> dict:
    dm = AdaptiveLoadDataModule(
        train_shards=data,
        batching=Batching(max_tokens=max_tokens),
        plan=PlanSettings(schedule=schedule, chunk_samples=500_000),
        loader=Loader(num_workers=workers),
    )
    dm.setup("fit")
    per_epoch = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        it = iter(dm.train_dataloader())
        gaps, samples, tokens, nbytes = [], 0, 0, 0
        first = None
        last = time.perf_counter()
        for batch in it:
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            first = first if first is not None else now - t0
            samples += batch["batch_size"]
            tokens += batch["num_tokens"]
            nbytes += batch["latents"].numel() * batch["latents"].element_size()
        total = time.perf_counter() - t0
        per_epoch.append(
            {
                "seconds": total,
                "samples_per_s": samples / total,
                "tokens_per_s": tokens / total,
                "MB_per_s": nbytes / total / 1e6,
                "batches": len(gaps),
                "first_batch_s": first,
                "batch_ms_p50": 1e3 * statistics.median(gaps),
                "batch_ms_p95": 1e3 * float(np.percentile(gaps, 95)),
            }
        )
        del it
    best = max(per_epoch, key=lambda e: e["samples_per_s"])
    return {
        "workers": workers,
        "schedule": schedule,
        "epochs": per_epoch,
        "best": best,
        "plan": {k: dm.epoch_report[k] for k in ("samples", "steps", "batches", "tokens", "plan_seconds")},
    }


def bench_batcher(mix: Mix, n: int) -> dict:
    rng = np.random.default_rng(0)
    idx = mix.sample_buckets(rng, n)
    shapes = [mix.buckets[int(i)].latent_shape for i in idx]
    batcher = DualConstraintBatcher(max(tokens_per_sample(s) for s in shapes))
    batcher.resolve_max_compute(shapes)
    # bucketing only: the batch-size lookup and bucket bookkeeping of the stage
    t0 = time.perf_counter()
    pending: dict = {}
    for s in shapes:
        b = batcher.batch_size(s)
        group = pending.setdefault(s, [])
        group.append(s)
        if len(group) == b:
            pending[s] = []
    bucketing_us = 1e6 * (time.perf_counter() - t0) / n
    # the full stage on tiny tensors of the same T (collate's stack dominates with real sizes)
    small = [
        {
            "__key__": f"k{i}",
            "latent": torch.zeros((s[0], s[1], 2, 2), dtype=torch.float16),
            "text": None,
            "meta": None,
        }
        for i, s in enumerate(shapes)
    ]
    stage = DualConstraintBatcher(max(tokens_per_sample((c, t, 2, 2)) for c, t, _, _ in shapes) * 4)
    stage.resolve_max_compute(x["latent"].shape for x in small)
    t0 = time.perf_counter()
    batches = sum(1 for _ in stage(small))
    stage_us = 1e6 * (time.perf_counter() - t0) / n
    return {
        "samples": n,
        "bucketing_us_per_sample": bucketing_us,
        "stage_with_collate_us_per_sample": stage_us,
        "stage_batches": batches,
    }


def synthetic_index(mix: Mix, n: int, per_shard: int, seed: int = 0) -> list[list[tuple]]:
    rng = random.Random(seed)
    shapes = [tuple(b.latent_shape) for b in mix.buckets]
    weights = [b.p for b in mix.buckets]
    return [rng.choices(shapes, weights, k=min(per_shard, n - i)) for i in range(0, n, per_shard)]


def bench_plan(mix: Mix, sizes: list[tuple[int, int, int]], max_tokens: int) -> list[dict]:
    out = []
    for n, world, workers in sizes:
        index = synthetic_index(mix, n, 1000)
        for schedule in ("independent", "lockstep"):
            batcher = DualConstraintBatcher(max_tokens)
            t0 = time.perf_counter()
            plan = plan_epoch(index, world, workers, batcher, 0, 0, PlanSettings(schedule=schedule))
            seconds = time.perf_counter() - t0
            rep = plan.report
            out.append(
                {
                    "samples": n,
                    "shards": len(index),
                    "world_size": world,
                    "num_workers": workers,
                    "schedule": schedule,
                    "plan_seconds": seconds,
                    "steps": plan.steps,
                    **{
                        k: rep[k]
                        for k in (
                            "split_batches",
                            "moved_batches",
                            "moved_samples",
                            "reduced_steps",
                            "lockstep_tail_steps",
                            "unequal_steps",
                            "reads",
                            "est_compute_cv",
                            "est_wait_share",
                        )
                    },
                }
            )
            print(
                f"  plan {schedule:11s} {n:>8} samples, {world:>4} ranks x {workers} workers: {seconds:6.2f} s, "
                f"{plan.steps} steps, est. CV {rep['est_compute_cv']:.3f}, wait {rep['est_wait_share']:.3f}, "
                f"tail {rep['lockstep_tail_steps']}",
                flush=True,
            )
    return out


def bench_step_overhead(mix: Mix, n: int) -> dict:
    """Per-batch cost of a worker's stream loop with reading and collating replaced by no-ops."""
    import lightning_adaptiveload.datamodule as dmod
    import lightning_adaptiveload.loading.stream as stream_mod

    index_shapes = synthetic_index(mix, n, 100)

    class _Info:
        def __init__(self, i, shapes):
            self.path, self.keys, self.latent_shapes = (
                f"mem{i}",
                [f"s{i}_{j}" for j in range(len(shapes))],
                shapes,
            )

    class _Index:
        shards = [_Info(i, s) for i, s in enumerate(index_shapes)]

    def fake_iter_shard(info, shard_id=0, select=None, **_):
        for i in sorted(select):
            yield {"__ref__": (shard_id, i)}

    results = {}
    real_iter, real_collate = stream_mod.iter_shard, stream_mod.collate
    stream_mod.iter_shard = fake_iter_shard
    stream_mod.collate = lambda members, *a, **k: {"n": len(members)}
    try:
        for schedule in ("independent", "lockstep"):
            ds = dmod.PlannedShardDataset(
                _Index(), DualConstraintBatcher(32760), PlanSettings(schedule=schedule)
            )
            ds.begin_epoch(0)
            t0 = time.perf_counter()
            steps = sum(1 for _ in ds._stream(ds.plan, (0, 0)))
            results[schedule] = {"batches": steps, "us_per_batch": 1e6 * (time.perf_counter() - t0) / steps}
    finally:
        stream_mod.iter_shard, stream_mod.collate = real_iter, real_collate
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mix", default="wan21_480p")
    parser.add_argument("--scale", type=int, default=1, help="divide latent H and W by this (disk space)")
    parser.add_argument(
        "--num-samples", type=int, default=96, help="samples written for the loader benchmark"
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from lightning_adaptiveload.shards.synthetic import write_synthetic_shards

    mix = scaled_mix(args.mix, args.scale)
    max_tokens = max(b.tokens_for((1, 2, 2)) for b in mix.buckets)
    result: dict = {
        "benchmark": "bench_loader",
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "mix": mix.name,
        "latent_shapes": sorted({tuple(b.latent_shape) for b in mix.buckets}),
        "max_tokens": max_tokens,
        "dtype": "float16",
    }
    n = 48 if args.quick else args.num_samples
    with tempfile.TemporaryDirectory() as tmp:
        print(f"writing {n} synthetic {mix.name} samples ...", flush=True)
        index = write_synthetic_shards(
            tmp,
            settings=SyntheticShards(mix=mix, num_samples=n, samples_per_shard=max(4, n // 8), seed=0),
            progress=False,
        )
        result["shard_bytes"] = sum(s.num_bytes for s in index.shards)
        result["loader"] = []
        for schedule in ("independent", "lockstep"):
            for workers in (0, 2):
                r = bench_loader(tmp, max_tokens, workers, schedule, args.epochs)
                b = r["best"]
                print(
                    f"  loader {schedule:11s} workers={workers}: {b['samples_per_s']:8.1f} samples/s "
                    f"{b['tokens_per_s']:12.0f} tokens/s {b['MB_per_s']:7.1f} MB/s, batch p50 {b['batch_ms_p50']:.1f} "
                    f"ms p95 {b['batch_ms_p95']:.1f} ms, first batch {b['first_batch_s']:.2f} s",
                    flush=True,
                )
                result["loader"].append(r)
    result["batcher"] = bench_batcher(mix, 20_000 if args.quick else 200_000)
    print(
        f"  batcher: {result['batcher']['bucketing_us_per_sample']:.2f} us/sample bucketing, "
        f"{result['batcher']['stage_with_collate_us_per_sample']:.1f} us/sample as a stage with collate",
        flush=True,
    )
    result["step_overhead"] = bench_step_overhead(mix, 20_000 if args.quick else 100_000)
    print(f"  runtime bookkeeping per batch: {result['step_overhead']}", flush=True)
    sizes = [(100_000, 8, 2)] if args.quick else [(100_000, 8, 2), (1_000_000, 64, 2), (1_000_000, 256, 1)]
    result["plan"] = bench_plan(mix, sizes, max_tokens)
    out = args.out or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "results",
        f"loader_{re.sub(r'[^a-z0-9]+', '-', cpu_name().lower()).strip('-')}_{result['date']}.json",
    )
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
