"""Overhead of LoadBalanceMonitor: a training step with and without it, on CPU.

Two measurements:

1. End to end: the steady-state time of a training iteration (batch start to next batch start, after a
   warm-up) of a tiny MLP, with no monitor and with the monitor at two logging cadences, run interleaved
   ``--repeats`` times; single process, and with ``--ddp`` also 2 processes (gloo, ``ddp_spawn``).
2. Direct: the CPU time spent inside the monitor's own hooks (per step, and per flush: the one collective,
   the statistics and the CSV append; Lightning's ``log_dict`` of the 16 values timed apart), by a subclass
   that wraps them. This does not depend on the model, so it can be set against the step of a real model:
   we report it as a share of the 1.161 s step of the shortest Wan 2.1 1.3B bucket on an H100
   (shared/anchors), as well as of the tiny CPU step.

Writes ``benchmarks/results/bench_monitor_cpu.json``. Times are never asserted anywhere.

Usage::

    python benchmarks/balance/bench_monitor.py --steps 300 --repeats 5 --ddp
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from datetime import datetime, timezone

import lightning as L
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import cpu_name
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, IterableDataset

from lightning_adaptiveload.callbacks.load_balance import LoadBalanceMonitor

# The shortest step of the measured Wan 2.1 1.3B trace on an H100 (shared/anchors/README.md): the monitor's
# fixed per-step cost is the largest share of the cheapest real step.
REAL_STEP_S = 1.161


class _Batches(IterableDataset):
    def __init__(self, steps: int, batch: int, dim: int) -> None:
        self.steps, self.batch, self.dim = steps, batch, dim

    def __iter__(self):
        x = torch.randn(self.batch, self.dim)
        for _ in range(self.steps):
            yield {
                "latents": x,
                "seq_len": 16,
                "batch_size": self.batch,
                "num_tokens": 16 * self.batch,
                "cost": float(self.batch),
                "global_tokens": -1,
            }


class _MLP(L.LightningModule):
    def __init__(self, steps: int, batch: int, dim: int) -> None:
        super().__init__()
        self.steps, self.batch, self.dim = steps, batch, dim
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def training_step(self, batch, batch_idx):
        return self.net(batch["latents"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(_Batches(self.steps, self.batch, self.dim), batch_size=None)


class _IterTimer(Callback):
    """Steady-state iteration time: from the start of batch `warmup` to the start of the last batch."""

    def __init__(self, warmup: int, steps: int, out: str) -> None:
        self.warmup, self.steps, self.out = warmup, steps, out
        self.t0 = self.t1 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.warmup:
            self.t0 = time.perf_counter()
        if batch_idx == self.steps - 1:
            self.t1 = time.perf_counter()

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            with open(self.out, "w") as f:
                json.dump({"iter_s": (self.t1 - self.t0) / (self.steps - 1 - self.warmup)}, f)


class _TimedMonitor(LoadBalanceMonitor):
    """LoadBalanceMonitor whose hooks accumulate the CPU time of this thread spent in them.

    CPU time (``time.thread_time``) rather than wall time: this machine is shared, and wall time under
    contention measures the neighbours. It excludes blocking waits (the collective's wait for the other rank,
    which is the wait DDP's all-reduce would have had anyway). Lightning's own cost of ``log_dict`` is
    timed apart: it is what logging any 16 metrics costs, not the monitor's work.
    """

    def __init__(self, out: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out = out
        self.step_hooks = 0.0
        self.per_step: list[float] = []
        self.flush_times: list[float] = []
        self.log_times: list[float] = []
        self.steps_seen = 0
        self.end_s = 0.0

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        original = pl_module.log_dict

        def timed_log_dict(*args, **kwargs):
            t = time.thread_time()
            original(*args, **kwargs)
            self.log_times.append(time.thread_time() - t)

        pl_module.log_dict = timed_log_dict

    def on_train_batch_start(self, *args, **kwargs):
        t = time.thread_time()
        super().on_train_batch_start(*args, **kwargs)
        self.step_hooks = time.thread_time() - t

    def on_before_backward(self, *args, **kwargs):
        t = time.thread_time()
        super().on_before_backward(*args, **kwargs)
        self.step_hooks += time.thread_time() - t

    def on_train_batch_end(self, *args, **kwargs):
        flushes = len(self.flush_times)
        t = time.thread_time()
        super().on_train_batch_end(*args, **kwargs)
        self.step_hooks += time.thread_time() - t
        if len(self.flush_times) > flushes:  # a logging step: its flush is reported apart
            self.step_hooks -= self.flush_times[-1]
        self.per_step.append(self.step_hooks)
        self.steps_seen += 1

    def _flush(self, *args, **kwargs):
        t = time.thread_time()
        super()._flush(*args, **kwargs)
        self.flush_times.append(time.thread_time() - t)

    def on_train_end(self, trainer, pl_module):
        t = time.thread_time()
        super().on_train_end(trainer, pl_module)
        self.end_s = time.thread_time() - t
        if trainer.global_rank != 0:
            return
        in_steps = self.flush_times[: len(self.log_times)]  # the end-of-fit flush is in on_train_end
        # The first steps pay one-time costs (FlopCounterMode on the first batch shape, first imports): the
        # steady state is the mean over the later steps.
        later = self.per_step[10:] or self.per_step
        # the first flush pays one-time imports inside Lightning's logging (torch._dynamo): reported apart
        steady = [f - lg for f, lg in zip(in_steps[1:], self.log_times[1:])] or [0.0]
        with open(self.out, "w") as f:
            json.dump(
                {
                    "cpu_s_per_step_hooks": statistics.fmean(later),
                    "cpu_s_first_step_hooks": self.per_step[0] if self.per_step else 0.0,
                    "cpu_s_per_flush_monitor": statistics.median(steady),
                    "cpu_s_per_flush_lightning_log_dict": statistics.median(self.log_times[1:] or [0.0]),
                    "cpu_s_first_flush": in_steps[0] if in_steps else 0.0,
                    "flushes_logged": len(self.log_times),
                    "steps": self.steps_seen,
                    "cpu_s_on_train_end": self.end_s,
                },
                f,
            )


def _run(config: str, args: argparse.Namespace, devices: int, tmp: str) -> dict:
    iter_out = os.path.join(tmp, f"iter_{config}_{devices}.json")
    hook_out = os.path.join(tmp, f"hooks_{config}_{devices}.json")
    callbacks: list[Callback] = [_IterTimer(args.warmup, args.steps, iter_out)]
    log_every = 50
    if config != "none":
        log_every = int(config.removeprefix("log"))
        callbacks.append(
            _TimedMonitor(hook_out, dirpath=os.path.join(tmp, config), plots=False, print_summary=False)
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp_spawn" if devices > 1 else "auto",
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=log_every,
        callbacks=callbacks,
        default_root_dir=tmp,
    )
    trainer.fit(_MLP(args.steps, args.batch, args.dim))
    out = json.load(open(iter_out))
    if config != "none":
        out.update(json.load(open(hook_out)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ddp", action="store_true", help="also run 2 processes (gloo)")
    parser.add_argument(
        "--out",
        default=os.path.join(
            os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results", "bench_monitor_cpu.json"
        ),
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    configs = ["none", "log50", "log10"]
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for devices in [1, 2] if args.ddp else [1]:
            runs: dict[str, list[dict]] = {c: [] for c in configs}
            for rep in range(args.repeats):
                for c in configs if rep % 2 == 0 else configs[::-1]:  # interleave against drift
                    runs[c].append(_run(c, args, devices, tmp))
            # min over repeats: interference from other processes only ever adds time
            base = min(r["iter_s"] for r in runs["none"])
            res = {"iter_s_no_monitor": base, "iter_s_no_monitor_runs": [r["iter_s"] for r in runs["none"]]}
            for c in configs[1:]:
                it = min(r["iter_s"] for r in runs[c])
                every = int(c.removeprefix("log"))
                step = statistics.median(r["cpu_s_per_step_hooks"] for r in runs[c])
                flush = statistics.median(r["cpu_s_per_flush_monitor"] for r in runs[c])
                log = statistics.median(r["cpu_s_per_flush_lightning_log_dict"] for r in runs[c])
                monitor = step + flush / every
                res[c] = {
                    "iter_s": it,
                    "iter_s_runs": [r["iter_s"] for r in runs[c]],
                    "end_to_end_overhead_share": it / base - 1,
                    "cpu_s_per_step_hooks": step,
                    "cpu_s_per_flush_monitor": flush,
                    "cpu_s_per_flush_lightning_log_dict": log,
                    "cpu_s_first_flush": statistics.median(r["cpu_s_first_flush"] for r in runs[c]),
                    "cpu_s_first_step_hooks": statistics.median(r["cpu_s_first_step_hooks"] for r in runs[c]),
                    "cpu_s_per_step_amortised": monitor,
                    "cpu_s_per_step_amortised_with_log_dict": monitor + log / every,
                    "share_of_tiny_step": monitor / base,
                    "share_of_tiny_step_with_log_dict": (monitor + log / every) / base,
                    "share_of_real_step_with_log_dict": (monitor + log / every) / REAL_STEP_S,
                    "cpu_s_on_train_end": statistics.median(r["cpu_s_on_train_end"] for r in runs[c]),
                }
            results[f"{devices}_process"] = res
            print(json.dumps({f"{devices}_process": res}, indent=1))
    payload = {
        "benchmark": "LoadBalanceMonitor overhead, CPU",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "lightning": L.__version__,
        "python": platform.python_version(),
        "model": f"MLP {args.dim}-{4 * args.dim}-{args.dim}, batch {args.batch}, fp32, 1 thread per process",
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "real_step_s": REAL_STEP_S,
        "real_step_source": "shortest bucket of Wan 2.1 1.3B fwd+bwd on H100, shared/anchors/README.md",
        "results": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(payload, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
