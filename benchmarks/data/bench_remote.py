"""Reads from object storage on CPU: bytes fetched per epoch and samples/s per worker, over loopback HTTP.

The same synthetic shards (``tiny`` mix) are served by nginx on the loopback address; a fixed latency is
added to every request (``--delays-ms``, default 20 and 0) by a process of its own
(``tests/remote/servers.py``), in two ways measured in the same run (``--latency-by``):

- ``relay``: a TCP relay that holds the client's bytes for the delay and parses no HTTP, so that it costs
  the 2-core machine next to nothing per request, as a real object store costs the client nothing;
- ``proxy``: the HTTP proxy of the fault tests (Python, ~0.5 ms of CPU per request on the cores the
  client uses too): a reading that charges each request to the client's machine.

Measured, for each way and latency:

1. Ours, each schedule (independent, lockstep with its packed tail, packed), with the ranges sent from the
   loader's thread (``RemoteSettings.inline_http``, the default) and, as ``ours_fetch_threads``, from the
   fetch threads (``--inline-http``): one epoch planned for
   ``--ranks`` ranks of one worker, every rank's stream read one after another in this process with the
   plan-guided ranged reader and default ``RemoteSettings``. The machine's load average at the start and
   end is recorded. Bytes and requests counted at nginx; samples/s of each stream (its samples / the
   seconds from its first request to its last batch), reported as the mean, min and max over the streams,
   and the process's CPU seconds per sample over the epoch.
2. webdataset's ``WebLoader`` over ``WebDataset`` streaming the same tars in order, one worker (the
   sequential stream every streaming library's worker runs), each sample's ``.npy`` members decoded.
3. litdata's ``StreamingDataset`` over the same samples converted with litdata's ``optimize`` and served by
   the same nginx and proxy (litdata downloads whole chunks; it has no ``http://`` downloader, so a
   small one is registered that fetches a chunk with one GET, as its S3 downloader does). Skipped, and
   said so in the JSON, where litdata is not installed. litdata requires torch (a CUDA build from PyPI);
   beside the CPU torch, install it without its dependencies into a folder of its own:
   ``pip install --no-deps --target /tmp/ldpk litdata tifffile obstore``, then run with
   ``PYTHONPATH=/tmp/ldpk`` (its other dependencies are in the ``dev`` extra already).

Writes ``benchmarks/results/remote_<date>.json`` (CPU model, shapes, settings, date). Never asserts a time.
Run::

    python benchmarks/data/bench_remote.py            # ~2-4 min on 2 busy cores (480 samples)
    python benchmarks/data/bench_remote.py --samples 4800
    python benchmarks/data/bench_remote.py --quick    # a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import io
import os
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/: _common
sys.path.insert(0, os.path.join(ROOT, "tests", "remote"))  # servers.py
from _common import cpu_name, write_json  # noqa: E402
from servers import (  # noqa: E402
    AccessLog,
    Nginx,
    dataset_bytes,
    free_port,
    start_script,
    stop_script,
    total,
)

from lightning_adaptiveload.loading.stream import stream_batches  # noqa: E402
from lightning_adaptiveload.planning.batching import DualConstraintBatcher  # noqa: E402
from lightning_adaptiveload.planning.planner import plan_epoch  # noqa: E402
from lightning_adaptiveload.planning.settings import PlanSettings  # noqa: E402
from lightning_adaptiveload.shards.index import ShardIndex  # noqa: E402
from lightning_adaptiveload.shards.objstore import RemoteSettings  # noqa: E402
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards  # noqa: E402

SCHEDULES = {
    "independent": PlanSettings(schedule="independent"),
    "lockstep": PlanSettings(schedule="lockstep", lockstep_tail="packed"),
    "packed": PlanSettings(schedule="packed"),
}


def _settle(log: AccessLog, mark: int) -> dict[str, int]:
    return total(log.since(mark, settle=0.2), path_suffix=(".tar", ".bin"))


def bench_ours(url: str, log: AccessLog, ranks: int, max_tokens: int, remote: RemoteSettings) -> dict:
    out = {}
    for name, settings in SCHEDULES.items():
        index = ShardIndex.load(f"{url}/data/index.json")
        batcher = DualConstraintBatcher(max_tokens)
        plan = plan_epoch(index, ranks, 1, batcher, 0, 0, settings)
        mark = log.mark()
        rates, samples, requests, fetched = [], 0, 0, 0
        began, cpu0 = time.perf_counter(), time.process_time()
        for stream in sorted(plan.streams):
            t0 = time.perf_counter()
            n = 0
            for batch in stream_batches(plan, stream, index, batcher, remote=remote):
                n += len(batch["keys"])
                requests += batch.get("fetched", {}).get("requests", 0)
                fetched += batch.get("fetched", {}).get("bytes", 0)
            dt = time.perf_counter() - t0
            samples += n
            if n:
                rates.append(n / dt)
        wall, cpu = time.perf_counter() - began, time.process_time() - cpu0
        served = _settle(log, mark)
        out[name] = {
            "samples": samples,
            "streams": len(plan.streams),
            "bytes_served": served["bytes"],
            "requests_served": served["requests"],
            "bytes_fetched_client": fetched,
            "requests_client": requests,
            "samples_per_s_per_worker_mean": statistics.fmean(rates),
            "samples_per_s_per_worker_min": min(rates),
            "samples_per_s_per_worker_max": max(rates),
            "epoch_seconds_all_streams_in_turn": wall,
            "cpu_us_per_sample": 1e6 * cpu / max(1, samples),
            "packed_tail_steps": plan.report.get("packed_tail_steps"),
        }
        print(
            f"  ours {name}: {out[name]['samples_per_s_per_worker_mean']:.1f} samples/s/worker, "
            f"{served['bytes']} bytes in {served['requests']} requests, "
            f"{out[name]['cpu_us_per_sample']:.0f} us CPU/sample"
        )
    return out


def _decode_npy(sample: dict) -> int:
    n = 0
    for k, v in sample.items():
        if k.endswith(".npy") and isinstance(v, bytes | bytearray):
            n += np.load(io.BytesIO(v), allow_pickle=False).size
    return n


def bench_webdataset(urls: list[str], log: AccessLog) -> dict:
    import webdataset as wds

    ds = wds.WebDataset(urls, shardshuffle=False, empty_check=False)
    loader = wds.WebLoader(ds, batch_size=None, num_workers=0)
    mark = log.mark()
    t0 = time.perf_counter()
    n = 0
    for sample in loader:
        _decode_npy(sample)
        n += 1
    dt = time.perf_counter() - t0
    served = _settle(log, mark)
    print(
        f"  webdataset: {n / dt:.1f} samples/s/worker, {served['bytes']} bytes in {served['requests']} requests"
    )
    return {
        "samples": n,
        "bytes_served": served["bytes"],
        "requests_served": served["requests"],
        "samples_per_s_per_worker": n / dt,
        "note": "one worker streaming every tar in order (gopen: curl), .npy members decoded",
    }


def _litdata_samples(index_path: str, shard_id: int):
    """litdata's ``optimize`` input: shard ``shard_id``'s samples as arrays (module level: litdata pickles it)."""
    from lightning_adaptiveload.shards.reader import iter_shard

    index = ShardIndex.load(index_path)
    for s in iter_shard(index.shards[shard_id], shard_id=shard_id):
        yield {
            "key": s["__key__"],
            "latent": s["latent"].numpy(),
            # one type per field for litdata: an empty array where the sample has no text
            "text": np.zeros((0,), dtype=np.float16) if s["text"] is None else s["text"].numpy(),
        }


def make_litdata(index_path: str, num_shards: int, out_dir: str) -> str:
    """The same samples (latent and text arrays by key) converted with litdata's ``optimize``."""
    import functools

    from litdata import optimize

    optimize(
        fn=functools.partial(_litdata_samples, index_path),
        inputs=list(range(num_shards)),
        output_dir=out_dir,
        chunk_bytes="256KB",
        num_workers=1,
        mode="overwrite",
    )
    return out_dir


def _register_http_downloader() -> None:
    """litdata has no ``http://`` downloader: this one fetches a whole chunk with one GET, as its S3 one does."""
    import urllib.request

    from litdata.streaming import downloader as dl

    class HttpDownloader(dl.Downloader):
        def download_file(self, remote_filepath: str, local_filepath: str) -> None:
            if os.path.exists(local_filepath):
                return
            tmp = f"{local_filepath}.tmp.{os.getpid()}"
            with urllib.request.urlopen(remote_filepath, timeout=30) as resp, open(tmp, "wb") as f:  # noqa: S310
                f.write(resp.read())
            os.replace(tmp, local_filepath)

        async def adownload_file(self, remote_filepath: str, local_filepath: str) -> None:
            self.download_file(remote_filepath, local_filepath)

        async def adownload_fileobj(self, remote_filepath: str) -> bytes:
            with urllib.request.urlopen(remote_filepath, timeout=30) as resp:  # noqa: S310
                return resp.read()

        async def adownload_bytes(
            self, remote_filepath: str, offset: int, length: int, local_chunkpath: str
        ) -> bytes:
            req = urllib.request.Request(
                remote_filepath, headers={"Range": f"bytes={offset}-{offset + length - 1}"}
            )
            with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310
                return resp.read()

    dl.register_downloader("http://", HttpDownloader, overwrite=True)


def bench_litdata(url: str, log: AccessLog, cache: str) -> dict:
    from litdata import StreamingDataset
    from litdata.streaming.resolver import Dir

    _register_http_downloader()
    # A Dir with a URL only: litdata takes a plain "http://..." string for a local path
    ds = StreamingDataset(Dir(path=None, url=f"{url}/litdata"), cache_dir=cache, shuffle=False)
    mark = log.mark()
    t0 = time.perf_counter()
    n = 0
    for i in range(len(ds)):
        sample = ds[i]
        assert sample["latent"] is not None
        n += 1
    dt = time.perf_counter() - t0
    served = total(log.since(mark, settle=0.2), path_suffix=(".bin",))
    print(
        f"  litdata: {n / dt:.1f} samples/s/worker, {served['bytes']} bytes in {served['requests']} requests"
    )
    return {
        "samples": n,
        "bytes_served": served["bytes"],
        "requests_served": served["requests"],
        "samples_per_s_per_worker": n / dt,
        "note": "one worker, StreamingDataset(shuffle=False) read in order; whole 256 KB chunks fetched",
    }


def _one_row(args, url, log, remote, index, lit, work, tag, delay, first_threads=False) -> dict:
    """Ours (both ways with ``--inline-http both``, the fetch threads' first where ``first_threads``),
    webdataset and litdata, one after another (litdata with a cache folder of its own per ``tag``: a
    second read from its cache would fetch nothing)."""
    row: dict = {}
    variants = [("ours", remote)]
    if args.inline_http == "both":
        variants.append(("ours_fetch_threads", dataclasses.replace(remote, inline_http=False)))
        if first_threads:
            variants.reverse()  # every other repeat: neither way always reads first
    for name, settings in variants:
        print(f"  {name} (RemoteSettings.inline_http={settings.inline_http}):")
        row[name] = bench_ours(url, log, args.ranks, args.max_tokens, settings)
    urls = [f"{url}/data/{os.path.basename(s.path)}" for s in index.shards]
    row["webdataset"] = bench_webdataset(urls, log)
    if lit.get("converted"):
        try:
            row["litdata"] = bench_litdata(url, log, os.path.join(work, f"litcache-{tag}-{delay:g}"))
            row["litdata"]["version"] = lit.get("version")
        except Exception as err:  # noqa: BLE001 - reported in the JSON, not hidden
            row["litdata"] = {"failed": f"{type(err).__name__}: {err}"}
    else:
        row["litdata"] = lit
    return row


def _medians(runs: list[dict]) -> dict:
    """The median over the repeats of each reader's samples/s per worker (ours: the mean over the streams)."""
    out: dict = {}
    for name in runs[0]:
        if name.startswith("ours"):
            for sched in runs[0][name]:
                rates = [r[name][sched]["samples_per_s_per_worker_mean"] for r in runs]
                cpu = [r[name][sched]["cpu_us_per_sample"] for r in runs]
                out[f"{name}/{sched}"] = {
                    "samples_per_s_per_worker": statistics.median(rates),
                    "cpu_us_per_sample": statistics.median(cpu),
                    "each": rates,
                }
        elif all("samples_per_s_per_worker" in r[name] for r in runs):
            rates = [r[name]["samples_per_s_per_worker"] for r in runs]
            out[name] = {"samples_per_s_per_worker": statistics.median(rates), "each": rates}
    return out


def _uptime() -> str:
    """The machine's load (``uptime``): the numbers are of a shared, busy box."""
    try:
        with open("/proc/loadavg") as f:
            return "load average: " + ", ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=480)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--delays-ms", type=float, nargs="+", default=[20.0, 0.0])
    ap.add_argument(
        "--latency-by",
        nargs="+",
        choices=("relay", "proxy"),
        default=["relay", "proxy"],
        help="what adds the latency: a TCP relay (little CPU per request) and/or the HTTP proxy",
    )
    ap.add_argument(
        "--inline-http",
        choices=("on", "off", "both"),
        default="both",
        help="ours with RemoteSettings.inline_http on (the default: ranges sent from the loader's thread), "
        "off (from the fetch threads), or both side by side (rows 'ours' and 'ours_fetch_threads')",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure every reader this many times in turn (the JSON keeps each run and the medians; with "
        "--inline-http both, every other repeat reads the fetch threads' way first): a busy 2-core machine "
        "swings by 20%% between runs",
    )
    ap.add_argument("--quick", action="store_true", help="96 samples, 4 ranks")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"))
    args = ap.parse_args()
    load_start = _uptime()
    if args.quick:
        args.samples, args.shards, args.ranks = 96, 6, 4
    work = tempfile.mkdtemp(prefix="bench-remote-")
    www = os.path.join(work, "www")
    data = os.path.join(www, "data")
    per = [args.samples // args.shards + (i < args.samples % args.shards) for i in range(args.shards)]
    write_synthetic_shards(
        data,
        settings=SyntheticShards(mix="tiny", num_samples=args.samples, samples_per_shard=per, seed=1),
        progress=False,
    )
    index = ShardIndex.load(os.path.join(data, "index.json"))
    lit: dict = {}
    try:
        make_litdata(os.path.join(data, "index.json"), index.num_shards, os.path.join(www, "litdata"))
        import litdata

        lit["converted"] = True
        lit["version"] = getattr(litdata, "__version__", "unknown")
    except ImportError as err:
        lit = {"skipped": f"litdata is not installed ({err})"}
    except Exception as err:  # noqa: BLE001 - reported in the JSON, the rest still runs
        lit = {"skipped": f"litdata's optimize failed: {type(err).__name__}: {err}"[:500]}
    nginx = Nginx(www, os.path.join(work, "nginx")).start()
    remote = RemoteSettings(inline_http=args.inline_http != "off")
    results: dict = {}
    try:
        for harness in args.latency_by:
            rows: dict = {}
            for delay in args.delays_ms:
                port = free_port()
                if harness == "proxy":
                    plog = os.path.join(work, f"proxy-{delay:g}.jsonl")
                    cmd = ["proxy", str(port), str(nginx.port), str(delay), plog]
                else:
                    cmd = ["relay", str(port), str(nginx.port), str(delay)]
                proxy = start_script(cmd, port, work, harness)
                url = f"http://127.0.0.1:{port}"
                print(f"{harness}: latency {delay:g} ms per request")
                try:
                    runs = []
                    for rep in range(args.repeats):
                        if args.repeats > 1:
                            print(f" repeat {rep + 1} of {args.repeats}")
                        runs.append(
                            _one_row(
                                args,
                                url,
                                nginx.log,
                                remote,
                                index,
                                lit,
                                work,
                                f"{harness}-{rep}",
                                delay,
                                rep % 2 == 1,
                            )
                        )
                finally:
                    stop_script(proxy)
                row = runs[0] if len(runs) == 1 else {"runs": runs, "median": _medians(runs)}
                rows[f"{delay:g}ms"] = row
            results[harness] = rows
    finally:
        nginx.close()
    shapes = sorted({tuple(s) for sh in index.shards for s in sh.latent_shapes})
    payload = {
        "benchmark": "bench_remote",
        "device": "cpu",
        "cpu": cpu_name(),
        "date": datetime.date.today().isoformat(),
        "dataset": {
            "mix": "tiny",
            "samples": index.num_samples,
            "shards": index.num_shards,
            "shard_bytes": dataset_bytes(data),
            "span_bytes": sum(n for sh in index.shards for _, n in sh.spans),
            "latent_shapes": [list(s) for s in shapes],
            "dtype": "float16",
        },
        "settings": {
            "ranks": args.ranks,
            "workers_per_rank": 1,
            "max_tokens": args.max_tokens,
            "delays_ms": args.delays_ms,
            "repeats": args.repeats,
            "remote": {k: getattr(remote, k) for k in remote.__dataclass_fields__},
            "machine_load": {"start": load_start, "end": _uptime()},
            "server": "nginx on 127.0.0.1, the latency added by a process of its own (latency_by)",
            "latency_by": {
                "relay": "servers.py's TCP relay: the client's bytes held delay_ms, no HTTP parsed (little CPU)",
                "proxy": "servers.py's HTTP proxy (Python, ~0.5 ms CPU per request on the cores the client uses)",
            },
        },
        "results": results,
    }
    tag = "_quick" if args.quick else ("" if args.samples == 480 else f"_{args.samples}")
    name = f"remote_{payload['date']}{tag}.json"
    write_json(args.out, name, payload)


if __name__ == "__main__":
    main()
