"""Index scale on CPU: write time, file size, load time and resident memory of the JSON and the binary
(columnar ``index.npidx``) index, at 1M / 10M / 20M samples, with a straight-line fit to 100M.

The indexes are synthetic (no shard files): ``wan21_480p`` mix shapes, ~1,000 samples a shard, keys
``clip_000123456``, text lengths in [0, 512). They are generated as arrays (never Python lists), so 20M
samples stay under ~1.5 GiB while generating. Each load runs in a fresh process (``python -c``) and
reports its own wall time and memory:

- ``load_s``: ``CompactIndex.load`` (binary: map + every check) or ``ShardIndex.load`` (JSON), the file's
  pages first dropped from the page cache (cold-ish); ``warm_load_s``: a second load in that process;
- ``fingerprint_s`` and ``bucket_table_s``: what a rank computes next, before the schedules run;
- ``rss_mib`` (VmRSS: the binary index's file pages are released from the process after its checks and
  after the fingerprint, ``CompactIndex.release_pages``; they stay in the node's shared page cache),
  ``anon_mib`` (RssAnon: the process's own memory) and ``hwm_mib`` (peak RSS), each minus the same
  process's figures before the load (imports).

With ``--plan`` it also times ``plan_epoch`` at 1M samples from the binary index (independent and
lockstep, 64 ranks x 2 workers), with a cProfile breakdown by function, for whoever speeds up the
planner next. Writes ``benchmarks/results/index_scale_<cpu>_<date>.json``. Never asserts a time. Run::

    python benchmarks/bench_index_scale.py                  # 1M (JSON + binary), 10M, 20M (binary)
    python benchmarks/bench_index_scale.py --sizes 1e5 --json-sizes 1e5   # smoke test
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
from _common import cpu_name

from lightning_adaptiveload.shards.columnar import IndexColumns, shape_id_dtype, write_columns
from lightning_adaptiveload.shards.compact import CompactIndex
from lightning_adaptiveload.shards.mixes import load_mix

HERE = os.path.dirname(os.path.abspath(__file__))
PER_SHARD = 1000
KEY_DIGITS = 9


def synthetic_columns(n: int, seed: int = 0) -> IndexColumns:
    """An index of ``n`` samples as columns, generated in chunks (no per-sample Python objects)."""
    rng = np.random.default_rng(seed)
    mix = load_mix("wan21_480p")
    shapes = np.array([b.latent_shape for b in mix.buckets], dtype="<i4")
    p = np.array([b.p for b in mix.buckets], dtype=np.float64)
    raw = np.empty(n, dtype=np.uint8)
    for i in range(0, n, 1 << 22):
        raw[i : i + (1 << 22)] = rng.choice(len(shapes), size=min(1 << 22, n - i), p=p / p.sum())
    used, first = np.unique(raw, return_index=True)  # number the shapes in order of first use
    order = used[np.argsort(first)]
    renumber = np.zeros(len(shapes), dtype=np.uint8)
    renumber[order] = np.arange(len(order))
    key_len = len("clip_") + KEY_DIGITS
    blob = np.empty((n, key_len), dtype=np.uint8)
    blob[:, :5] = np.frombuffer(b"clip_", dtype=np.uint8)
    for i in range(0, n, 1 << 22):
        ids = np.arange(i, min(n, i + (1 << 22)), dtype=np.int64)
        for d in range(KEY_DIGITS):
            blob[i : i + len(ids), 5 + d] = 48 + (ids // 10 ** (KEY_DIGITS - 1 - d)) % 10
    m = -(-n // PER_SHARD)
    shard_offsets = np.minimum(np.arange(m + 1, dtype="<i8") * PER_SHARD, n)
    return IndexColumns(
        paths=[f"shard-{s:06d}.tar" for s in range(m)],
        shard_bytes=rng.integers(1 << 30, 4 << 30, m, dtype=np.int64),
        shard_offsets=shard_offsets,
        shapes=shapes[order],
        shape_id=renumber[raw].astype(shape_id_dtype(len(order))),
        text_len=rng.integers(0, 512, n, dtype=np.int32),
        key_offsets=np.arange(n + 1, dtype="<i8") * key_len,
        key_blob=blob.reshape(-1),
        patch_size=(1, 2, 2),
        values_checked=True,
        metadata={"synthetic": "bench_index_scale", "mix": "wan21_480p"},
    )


_LOAD = r"""
import json, sys, time
def mem():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "VmHWM"):
                out[k] = int(v.split()[0]) / 1024
    return out
from lightning_adaptiveload.shards.compact import CompactIndex
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.inputs import as_input, bucket_table, distinct_shapes, index_fingerprint
path, kind = sys.argv[1], sys.argv[2]
before = mem()
t = time.perf_counter()
index = CompactIndex.load(path) if kind == "binary" else ShardIndex.load(path)
load_s = time.perf_counter() - t
after_load = mem()
t = time.perf_counter()
fp = index_fingerprint(index)
fingerprint_s = time.perf_counter() - t
batcher = DualConstraintBatcher(75600)
batcher.resolve_max_compute(distinct_shapes(index))
t = time.perf_counter()
table = bucket_table(as_input(index), batcher.sizer, "skip")
bucket_table_s = time.perf_counter() - t
end = mem()
del table
t = time.perf_counter()
again = CompactIndex.load(path) if kind == "binary" else ShardIndex.load(path)
warm_load_s = time.perf_counter() - t
print(json.dumps({
    "warm_load_s": warm_load_s,
    "load_s": load_s, "fingerprint_s": fingerprint_s, "bucket_table_s": bucket_table_s,
    "samples": index.num_samples, "fingerprint": fp,
    "rss_mib": after_load["VmRSS"] - before["VmRSS"], "anon_mib": after_load["RssAnon"] - before["RssAnon"],
    "hwm_mib": after_load["VmHWM"] - before["VmRSS"],
    "rss_after_bucket_table_mib": end["VmRSS"] - before["VmRSS"],
    "anon_after_bucket_table_mib": end["RssAnon"] - before["RssAnon"],
}))
"""


def load_in_fresh_process(path: str, kind: str) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", _LOAD, path, kind],
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=3600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def drop_cache(path: str) -> None:
    """Ask the kernel to forget the file's pages (cold-ish load); a no-op where that is not possible."""
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    except (AttributeError, OSError):
        pass


def run_size(n: int, folder: str, with_json: bool) -> dict:
    row: dict = {"samples": n, "shards": -(-n // PER_SHARD)}
    t = time.perf_counter()
    cols = synthetic_columns(n)
    row["generate_s"] = time.perf_counter() - t
    path = os.path.join(folder, f"index_{n}.npidx")
    t = time.perf_counter()
    write_columns(path, cols)
    row["binary"] = {"write_s": time.perf_counter() - t, "file_bytes": os.path.getsize(path)}
    del cols
    drop_cache(path)
    row["binary"].update(load_in_fresh_process(path, "binary"))
    row["binary"]["bytes_per_sample_file"] = row["binary"]["file_bytes"] / n
    row["binary"]["bytes_per_sample_anon"] = row["binary"]["anon_mib"] * 2**20 / n
    row["binary"]["bytes_per_sample_rss"] = row["binary"]["rss_mib"] * 2**20 / n
    if with_json:
        jpath = os.path.join(folder, f"index_{n}.json")
        t = time.perf_counter()
        CompactIndex.load(path).to_shard_index().save(jpath)
        row["json"] = {
            "write_s (from binary, incl. conversion)": time.perf_counter() - t,
            "file_bytes": os.path.getsize(jpath),
        }
        drop_cache(jpath)
        row["json"].update(load_in_fresh_process(jpath, "json"))
        row["json"]["bytes_per_sample_rss"] = row["json"]["rss_mib"] * 2**20 / n
        assert row["json"]["fingerprint"] == row["binary"]["fingerprint"], (
            "JSON and binary fingerprints differ"
        )
        os.unlink(jpath)
    os.unlink(path)
    return row


def fit(rows: list[dict], kind: str, field: str, at: float = 1e8) -> dict:
    xs = np.array([r["samples"] for r in rows if kind in r], dtype=np.float64)
    ys = np.array([r[kind][field] for r in rows if kind in r], dtype=np.float64)
    if len(xs) < 2:
        return {}
    slope, intercept = np.polyfit(xs, ys, 1)
    return {"per_sample": slope, "intercept": intercept, "at_100M": slope * at + intercept, "points": len(xs)}


def plan_breakdown(n: int, folder: str) -> dict:
    """plan_epoch at ``n`` samples from the binary index: wall time per schedule and the top functions."""
    import cProfile
    import pstats

    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.planner import plan_epoch
    from lightning_adaptiveload.planning.settings import PlanSettings

    path = os.path.join(folder, f"plan_{n}.npidx")
    write_columns(path, synthetic_columns(n, seed=1))
    index = CompactIndex.load(path)
    out = {}
    for mode in ("independent", "lockstep"):
        batcher = DualConstraintBatcher(75600)
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        plan = plan_epoch(index, 64, 2, batcher, seed=0, epoch=0, settings=PlanSettings(schedule=mode))
        prof.disable()
        wall = time.perf_counter() - t
        stats = pstats.Stats(prof)
        top = sorted(
            ((v[3], f"{os.path.basename(k[0])}:{k[1]}({k[2]})") for k, v in stats.stats.items()), reverse=True
        )[:12]
        out[mode] = {
            "wall_s (under cProfile)": wall,
            "steps": plan.steps,
            "top_cumulative_s": [[name, round(c, 3)] for c, name in top],
        }
        t = time.perf_counter()
        plan_epoch(
            index, 64, 2, DualConstraintBatcher(75600), seed=0, epoch=0, settings=PlanSettings(schedule=mode)
        )
        out[mode]["wall_s"] = time.perf_counter() - t
    os.unlink(path)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", nargs="+", type=float, default=[1e6, 1e7, 2e7], help="binary index sizes (samples)"
    )
    parser.add_argument(
        "--json-sizes", nargs="+", type=float, default=[1e6], help="sizes also measured as JSON"
    )
    parser.add_argument(
        "--plan", type=float, default=0, help="time plan_epoch at this many samples (0: skip)"
    )
    parser.add_argument(
        "--out", default=None, help="result file (default: benchmarks/results/index_scale_<cpu>_<date>.json)"
    )
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="index_scale_")
    rows = []
    for n in sorted({int(s) for s in args.sizes}):
        rows.append(run_size(n, folder, with_json=n in {int(s) for s in args.json_sizes}))
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "benchmark": "bench_index_scale",
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
        "numpy": np.__version__,
        "python": sys.version.split()[0],
        "samples_per_shard": PER_SHARD,
        "mix": "wan21_480p",
        "rows": rows,
        "fit_binary (least squares, y = per_sample * n + intercept)": {
            f: fit(rows, "binary", f)
            for f in (
                "load_s",
                "warm_load_s",
                "fingerprint_s",
                "bucket_table_s",
                "rss_mib",
                "hwm_mib",
                "rss_after_bucket_table_mib",
                "anon_after_bucket_table_mib",
                "file_bytes",
            )
        },
    }
    if args.plan:
        result["plan_epoch_from_binary"] = {
            "samples": int(args.plan),
            **plan_breakdown(int(args.plan), folder),
        }
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(
        HERE, "results", f"index_scale_{re.sub(r'[^a-z0-9]+', '-', cpu_name().lower())[:40]}_{date}.json"
    )
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
