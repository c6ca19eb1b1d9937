"""LoadBalanceMonitor
==================

Balance, memory and throughput of every rank, every training step.

Lightning's :class:`~lightning.pytorch.callbacks.ThroughputMonitor` times rank 0 and scales by the world size,
and :class:`~lightning.pytorch.callbacks.DeviceStatsMonitor` reads rank 0's memory: on a job whose ranks get
different work, both report the average rank and hide the straggler that everyone waits for. This callback
measures every rank, gathers the measurements in one small collective per logged step, and logs the
balance statistics of :mod:`lightning_adaptiveload.monitor.stats`. See ``docs/monitor.md``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_adaptiveload import _dist
from lightning_adaptiveload.monitor import stats

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LoadBalanceMonitor"]

_GIB = float(1 << 30)

# Per-step record gathered from every rank, in this order (one float each). Batches that lack a field, and
# memory on a device without CUDA, give nan: such fields are absent from the logs, empty in the CSV.
_FIELDS = (
    "batch_idx",  # trainer.fit_loop.total_batch_idx of the batch: the same on every rank (checked)
    "step",  # trainer.global_step after the batch
    "cost",  # batch["cost"]: cost-model estimate of the batch
    "num_tokens",  # batch["num_tokens"]
    "batch_size",  # batch["batch_size"]
    "seq_len",  # batch["seq_len"]
    "flops",  # model FLOPs of forward + backward (3x forward)
    "compute_time_s",  # the rank's own compute: step start -> last gradient bucket ready (or the whole step)
    "step_time_s",  # step start -> step end (on_train_batch_start -> on_train_batch_end), waiting included
    "iter_time_s",  # previous step end -> this step end: data loading, step and callbacks
    "data_time_s",  # previous step end -> this step start (nan for the first step and after validation)
    "peak_allocated_bytes",  # torch.cuda peak allocated within the step (reset at the step start)
    "peak_reserved_bytes",
    "alloc_retries",  # cumulative cudaMalloc retries (torch.cuda.memory_stats "num_alloc_retries")
    "ooms",  # cumulative out-of-memory errors
    "flags",  # bit 0: warm-up step (FLOPs counted on a meta copy before it, or torch.compile compiled in
    # it: its times are inflated); bit 1: timed by DDP hook; bit 2: torch.compile compiled in it
)
_F = len(_FIELDS)
_IDX = {name: i for i, name in enumerate(_FIELDS)}
_HEADER = ("num_steps", "peak_flops", "device_total_bytes")  # per-rank block header
_FLAG_COUNTED = 1
_FLAG_HOOK = 2
_FLAG_COMPILED = 4

_WORK_KEYS = ("cost", "num_tokens", "batch_size", "seq_len")

# Columns of the per-step table (load_balance_steps.csv, the "steps" of load_balance.json).
_STEP_COLUMNS = (
    "step",
    "batch_idx",
    "counted",  # 1 if some rank counted FLOPs or compiled (warm-up) at the step: its time statistics are left out
    "hook_timed",  # 1 if every rank's compute time came from the DDP hook
    "compute_cv",
    "compute_imbalance",
    "token_cv",
    "step_time_cv",
    "imbalance",
    "straggler_wait",
    "compute_time_max_s",
    "step_time_s",
    "iter_time_s",
    "data_share",
    "tokens",
    "samples",
    "flops",
    "tokens_per_s",
    "samples_per_s",
    "tflops_per_device",
    "mfu",
    "vram_efficiency_mean",
    "vram_efficiency_min",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "fill",  # tokens / (ranks * max_tokens) of the data module's batcher (nan when unknown)
)
_SUMMARY_ALL_STEPS = (
    "compute_cv",
    "compute_imbalance",
    "token_cv",
    "iter_time_s",
    "tokens_per_s",
    "samples_per_s",
    "tflops_per_device",
    "mfu",
    "vram_efficiency_mean",
    "vram_efficiency_min",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "fill",
)
_SUMMARY_TIMED_STEPS = (
    "step_time_cv",
    "imbalance",
    "straggler_wait",
    "data_share",
    "compute_time_max_s",
    "step_time_s",
)
_MAX_PLOTTED_RANKS = 16  # above this, plots and history keep min/mean/max over ranks instead of every rank


class _HostClock:
    """Host wall clock (CPU training): a mark is a ``time.perf_counter()`` reading in seconds."""

    def mark(self) -> float:
        return time.perf_counter()

    def new_bucket_mark(self) -> None:
        return None

    def record_bucket(self, current: Any) -> float:
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        return float(end - start)

    def wait(self, mark: Any) -> None:
        pass


class _CudaClock:
    """CUDA events on the current stream: no host synchronisation per step, resolved at the flush."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def new_bucket_mark(self) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def record_bucket(self, current: torch.cuda.Event) -> torch.cuda.Event:
        # Re-recording one event per step keeps only the last bucket, which is all the timing needs.
        current.record()
        return current

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1e3

    def wait(self, mark: torch.cuda.Event) -> None:
        # The whole device, not just `mark`: bucket events may sit on the autograd engine's stream.
        torch.cuda.synchronize(self.device)


class _BucketTimer:
    """State of the DDP communication hook: the time the last gradient bucket of the step became ready."""

    def __init__(self, clock: _HostClock | _CudaClock, process_group: Any) -> None:
        self.clock = clock
        self.process_group = process_group
        self.active = False
        self.mark: Any = None
        self.buckets = 0

    def start_step(self) -> None:
        self.mark = self.clock.new_bucket_mark()
        self.buckets = 0
        self.active = True


def _timed_allreduce_hook(state: _BucketTimer, bucket):
    # `bucket` stays unannotated: DDP compares annotations with dist.GradBucket, and postponed annotations
    # (a string) would fail that check.
    # DDP calls this when a bucket's gradients are computed. Timing here, before the all-reduce is launched,
    # separates the rank's own backward from the wait for slower ranks that follows in finalize.
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if state.active:
        state.mark = state.clock.record_bucket(state.mark)
        state.buckets += 1
    return default_hooks.allreduce_hook(state.process_group, bucket)


@dataclass
class _Pending:
    """One step of this rank, before its clock marks are resolved to seconds at the flush."""

    batch_idx: int
    step: int
    work: tuple[float, float, float, float]
    flops: float
    start: Any
    end: Any
    prev_end: Any
    bucket: Any
    memory: tuple[float, float, float, float]
    flags: int


def _nanmean(values: np.ndarray) -> float:
    x = np.asarray(values, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(x.mean()) if x.size else math.nan


def _nanmax(values: np.ndarray) -> float:
    x = np.asarray(values, dtype=np.float64)
    x = x[~np.isnan(x)]
    return float(x.max()) if x.size else math.nan


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


class LoadBalanceMonitor(Callback):
    r"""Measure the work, time and memory of every rank at every training step and log their balance.

    **Measured on every rank, every step** (buffered locally, never synchronised per step):

    - work: ``batch["cost"]`` (the cost model's estimate), ``batch["num_tokens"]``, ``batch["batch_size"]``,
      ``batch["seq_len"]`` (the batch contract of ``docs/architecture.md``) and the step's model FLOPs;
    - time: the rank's own *compute* time, from the step start to the moment its last gradient bucket is
      ready (a DDP communication hook that wraps the default all-reduce; CUDA events on GPU, the host clock on
      CPU), so waiting for slower ranks in the all-reduce is excluded; the step's wall time; the iteration
      time (step end to step end, data loading included);
    - memory (CUDA only): peak allocated and reserved bytes within the step (peaks reset at each step start),
      the device's total, allocation retries and OOMs.

    The buffered steps of all ranks are gathered in **one** ``all_gather`` of a few floats per step at each
    logging step (``Trainer(log_every_n_steps=...)``), so per-step files cover every step while the
    collectives stay one per logged step.

    **Logged** (through ``pl_module.log``, so any logger or none; the mean over the window's steps):
    ``compute_cv``, ``compute_imbalance`` (of the cost estimates), ``token_cv``, ``step_time_cv`` (of the
    ranks' compute times), ``imbalance`` (``max / mean - 1`` of compute times), ``straggler_wait``
    (the share of the window's compute time spent waiting for the slowest rank: ``sum(max - mean) /
    sum(max)`` over its steps, :func:`lightning_adaptiveload.monitor.stats.straggler_wait`), ``step_wait_mean``
    (the per-step ``1 - mean / max``, averaged over steps unweighted), ``tokens_per_s`` and
    ``samples_per_s`` (summed over ranks), ``tflops_per_device``, ``mfu``,
    ``vram_efficiency_mean``/``_min``, ``peak_vram_util_eff``, ``peak_allocated_gib``, ``peak_reserved_gib``, ``data_share``; each under ``prefix``.

    **End of fit** (rank 0): a summary table is printed; ``load_balance_ranks.csv`` (one row per rank and
    step), ``load_balance_steps.csv`` and ``load_balance.json`` (one row per step, summary, metadata) and PNG
    plots are written to ``dirpath`` (default: ``trainer.log_dir``).

    **Warm-up steps**: a step in which ``torch.compile`` compiled (dynamo's frame counter moved) or
    before which FLOPs were counted is marked (``counted`` in the step table, ``flops_counted`` in the rank
    table) and left out of the time-balance statistics (``step_time_cv``, ``imbalance``,
    ``straggler_wait``, ``data_share``): a compiling rank holds the others for many seconds, which is not
    load imbalance. The summary's ``meta`` gives ``steps_with_flop_counting`` (all warm-up steps) and
    ``steps_compiling``.

    Args:
        dirpath: where to write the files; ``None`` for ``trainer.log_dir`` (the logger's directory, or
            ``default_root_dir`` without a logger).
        prefix: prepended to every logged key.
        flops_fn: ``flops_fn(batch) -> float``, the training FLOPs (forward + backward) of one batch on this
            rank. Default: ``pl_module.flops_per_batch(batch)`` (or the attribute's value), else
            ``3 * model.flops(batch_size, seq_len, text_len)`` of the first submodule that has an analytic
            forward ``flops`` method, else :func:`~lightning_adaptiveload.monitor.flops.wan_flops_per_batch` for a
            diffusers ``WanTransformer3DModel`` inside the module, else ``FlopCounterMode`` counting
            ``training_step`` on a meta-device copy of the module once per distinct batch shape (times 3;
            :func:`~lightning_adaptiveload.monitor.flops.meta_training_flops`). The module that trains is never run
            under a FLOP counter (that would stop ``torch.compile`` from compiling it). When no way works,
            a warning says so once and TFLOP/s and MFU are not logged.
        count_flops: set ``False`` to disable the meta-copy count (no TFLOP/s or MFU then, unless one of
            the analytic ways applies).
        peak_flops: dense peak FLOP/s of one device; default: :func:`lightning_adaptiveload.monitor.stats.peak_flops`
            from the device name and the trainer's precision (``None`` on CPU: no MFU).
        write_files: write the CSV and JSON files.
        plots: write the PNG plots (matplotlib, Agg).
        print_summary: print the summary table on rank 0 at the end of fit.
        max_buffered_steps: flush (gather) at least every this many batches even when nothing is logged
            (``log_every_n_steps=0``), to bound the buffer.

    Raises:
        ValueError: on a bad argument.
        RuntimeError: if the ranks' buffered steps do not line up (ranks running different batch counts).

    Example::

        from lightning import Trainer
        from lightning_adaptiveload import LoadBalanceMonitor

        trainer = Trainer(strategy="ddp", devices=8, log_every_n_steps=20, callbacks=[LoadBalanceMonitor()])
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        prefix: str = "balance/",
        flops_fn: Callable[[Any], float] | None = None,
        count_flops: bool = True,
        peak_flops: float | None = None,
        write_files: bool = True,
        plots: bool = True,
        print_summary: bool = True,
        max_buffered_steps: int = 1000,
    ) -> None:
        super().__init__()
        if max_buffered_steps < 1:
            raise ValueError(
                f"LoadBalanceMonitor: max_buffered_steps must be >= 1, got {max_buffered_steps!r}"
            )
        if peak_flops is not None and not peak_flops > 0:
            raise ValueError(f"LoadBalanceMonitor: peak_flops must be > 0 FLOP/s or None, got {peak_flops!r}")
        if flops_fn is not None and not callable(flops_fn):
            raise ValueError(
                f"LoadBalanceMonitor: flops_fn must be callable(batch) -> float, got {flops_fn!r}"
            )
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.prefix = prefix
        self.flops_fn = flops_fn
        self.count_flops = count_flops
        self.peak_flops = peak_flops
        self.write_files = write_files
        self.plots = plots
        self.print_summary = print_summary
        self.max_buffered_steps = max_buffered_steps
        self.summary: dict[str, Any] = {}
        self._reset()

    # ------------------------------------------------------------------ state

    def _reset(self) -> None:
        self._rank, self._world = 0, 1
        self._device = torch.device("cpu")
        self._clock: _HostClock | _CudaClock = _HostClock()
        self._bucket_timer: _BucketTimer | None = None
        self._timing_method = "step"
        self._flops_source: str | None = None
        self._analytic: Any = None
        self._flops_cache: dict[Any, float] = {}
        self._meta_clone: Any = None  # the meta-device copy FLOPs are counted on (no weights)
        self._step_key: Any = None
        self._counted_step = False  # FLOPs were counted before this step
        self._frames_at_start = 0  # dynamo's compiled-frame count at the step start
        self._compile_steps = 0  # steps in which some rank compiled (rank 0's count)
        self._device_name = "cpu"
        self._device_total = math.nan
        self._peak = math.nan
        self._dtype_key: str | None = None
        self._pending: list[_Pending] = []
        self._start: Any = None
        self._prev_end: Any = None
        self._warned: set[str] = set()
        self._num_collectives = 0
        self._high_water = 0.0
        self._peaks_flops: np.ndarray | None = None  # (world,) dense peak FLOP/s of each rank's device
        self._totals: np.ndarray | None = None  # (world,) device memory of each rank in bytes
        # rank 0's history: per-step tables (one per flush) and, for the plots, per-rank (steps, ranks) blocks
        self._tables: list[dict[str, np.ndarray]] = []
        self._rank_compute: list[np.ndarray] = []
        self._rank_peak: list[np.ndarray] = []
        self._outdir: str | None = None
        self._ranks_csv: str | None = None

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=UserWarning)

    # ------------------------------------------------------------------ hooks

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self._rank, self._world = _dist.rank_and_world(trainer)
        self._device = trainer.strategy.root_device
        if self._device.type == "cuda":
            self._clock = _CudaClock(self._device)
            self._device_name = torch.cuda.get_device_name(self._device)
            self._device_total = float(torch.cuda.get_device_properties(self._device).total_memory)
        else:
            self._clock = _HostClock()
            self._device_name = self._device.type
        self._peak = self._resolve_peak(trainer)
        # The memory cap per rank and step, for the per-step fill (packed steps fill it; buckets do not).
        batcher = getattr(getattr(trainer, "datamodule", None), "batcher", None)
        self._max_tokens = float(getattr(batcher, "max_tokens", math.nan) or math.nan)
        self._install_comm_hook(trainer)
        self._resolve_flops_source(pl_module)
        # trainer.log_dir broadcasts from rank 0, so every rank must ask (once, here).
        outdir = self.dirpath if self.dirpath is not None else (trainer.log_dir or trainer.default_root_dir)
        if self._rank == 0 and self.write_files:
            self._outdir = outdir
            os.makedirs(outdir, exist_ok=True)
            self._ranks_csv = os.path.join(outdir, "load_balance_ranks.csv")
            with open(self._ranks_csv, "w", newline="") as f:
                csv.writer(f).writerow(["rank", *_FIELDS[:-1], "flops_counted", "ddp_hook_timed"])
        elif self._rank == 0:
            self._outdir = outdir

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        if self._flops_source == "flop_counter":
            key = self._step_key = _shape_key(batch)
            if key not in self._flops_cache:
                self._count_on_meta(pl_module, batch, batch_idx, key)
        self._frames_at_start = _dynamo_frames()
        if self._bucket_timer is not None:
            self._bucket_timer.start_step()
        self._start = self._clock.mark()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:  # the batch started before this callback was set up
            return
        end = self._clock.mark()
        flags = _FLAG_COUNTED if self._counted_step else 0
        if _dynamo_frames() != self._frames_at_start:
            flags |= _FLAG_COUNTED | _FLAG_COMPILED
        bucket = None
        if self._bucket_timer is not None:
            self._bucket_timer.active = False
            if self._bucket_timer.buckets > 0:
                bucket = self._bucket_timer.mark
                flags |= _FLAG_HOOK
        memory = (math.nan,) * 4
        if self._device.type == "cuda":
            s = torch.cuda.memory_stats(self._device)
            memory = (
                float(s.get("allocated_bytes.all.peak", math.nan)),
                float(s.get("reserved_bytes.all.peak", math.nan)),
                float(s.get("num_alloc_retries", math.nan)),
                float(s.get("num_ooms", math.nan)),
            )
        self._pending.append(
            _Pending(
                batch_idx=int(trainer.fit_loop.total_batch_idx),
                step=int(trainer.global_step),
                work=self._work(batch),
                flops=self._batch_flops(pl_module, batch),
                start=self._start,
                end=end,
                prev_end=self._prev_end,
                bucket=bucket,
                memory=memory,
                flags=flags,
            )
        )
        self._counted_step = False
        self._start = None
        self._prev_end = end
        if self._should_log(trainer):
            self._flush(trainer, pl_module, log=True)
        elif len(self._pending) >= self.max_buffered_steps:
            self._flush(trainer, pl_module, log=False)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Validation between two training steps is not part of the next step's iteration time.
        self._prev_end = None

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending:
            self._flush(trainer, pl_module, log=False)
        if self._bucket_timer is not None:
            # DDP cannot unregister a hook: it stays on the module as a plain all-reduce.
            self._bucket_timer.active = False
        if self._rank != 0:
            return
        self.summary = self._summarize()
        if self.print_summary:
            print(self._format_summary(), file=sys.stdout, flush=True)
        if self._outdir is not None and self.write_files:
            self._write_step_files()
        if self._outdir is not None and self.plots and self._tables:
            self._write_plots()

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._bucket_timer is not None:
            self._bucket_timer.active = False

    # ------------------------------------------------------------------ setup helpers

    def _resolve_peak(self, trainer: pl.Trainer) -> float:
        if self.peak_flops is not None:
            return float(self.peak_flops)
        if self._device.type != "cuda":
            return math.nan
        try:
            key = stats.normalize_dtype(trainer.precision)
        except ValueError:
            self._warn_once(
                "dtype",
                f"LoadBalanceMonitor: no peak FLOP/s for precision {trainer.precision!r}; "
                "MFU is not logged. Pass `peak_flops=` to set it.",
            )
            return math.nan
        if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
            key = "tf32"
        self._dtype_key = key
        peak = stats.peak_flops(self._device_name, key)
        if peak is None:
            self._warn_once(
                "peak",
                f"LoadBalanceMonitor: no peak FLOP/s known for {self._device_name!r} in {key}; MFU is not logged."
                " Pass `LoadBalanceMonitor(peak_flops=...)` (dense FLOP/s of one device) to set it.",
            )
            return math.nan
        return peak

    def _install_comm_hook(self, trainer: pl.Trainer) -> None:
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.strategy.model
        if not isinstance(model, DistributedDataParallel):
            if self._world > 1:
                self._warn_once(
                    "hook",
                    f"LoadBalanceMonitor: the strategy {type(trainer.strategy).__name__} does not wrap the model "
                    "in DistributedDataParallel; compute time is the whole step, waiting for other ranks included"
                    " (step_time_cv and straggler_wait understate the imbalance).",
                )
            return
        if getattr(model, "_comm_hooks", None) or getattr(model, "_use_python_reducer", False):
            self._warn_once(
                "hook",
                "LoadBalanceMonitor: a DDP communication hook is already registered; compute time is the whole "
                "step, waiting for other ranks included (step_time_cv and straggler_wait understate the "
                "imbalance).",
            )
            return
        timer = _BucketTimer(self._clock, model.process_group)
        try:
            model.register_comm_hook(timer, _timed_allreduce_hook)
        except RuntimeError as err:  # a built-in (C++) hook was registered: the reducer takes only one
            self._warn_once(
                "hook",
                f"LoadBalanceMonitor: could not register the timing DDP communication hook ({err}); compute "
                "time is the whole step, waiting for other ranks included.",
            )
            return
        self._bucket_timer = timer
        self._timing_method = "ddp_comm_hook"

    def _resolve_flops_source(self, pl_module: pl.LightningModule) -> None:
        if self.flops_fn is not None:
            self._flops_source = "flops_fn"
        elif hasattr(pl_module, "flops_per_batch"):
            self._flops_source = "flops_per_batch"
        else:
            for module in pl_module.modules():  # the LightningModule first, then its submodules
                if callable(getattr(module, "flops", None)):
                    self._analytic = module
                    self._flops_source = "analytic"
                    return
            from lightning_adaptiveload.monitor.flops import find_wan_config

            self._analytic = find_wan_config(pl_module)
            if self._analytic is not None:
                self._flops_source = "wan_config"
            elif self.count_flops:
                self._flops_source = "flop_counter"  # FlopCounterMode on a meta copy
            else:
                self._flops_source = None
                self._warn_flops_unknown("count_flops=False")

    def _warn_flops_unknown(self, why: str) -> None:
        self._warn_once(
            "flops",
            f"LoadBalanceMonitor: the model's FLOPs are unknown ({why}); TFLOP/s and MFU are not logged. "
            "Define `flops_per_batch(self, batch) -> float` (training FLOPs, 3x forward) on your "
            "LightningModule, or pass `LoadBalanceMonitor(flops_fn=...)`; for a diffusers Wan use "
            "`lightning_adaptiveload.monitor.flops.wan_flops_per_batch(config, batch)`.",
        )

    def _count_on_meta(self, pl_module: pl.LightningModule, batch: Any, batch_idx: int, key: Any) -> None:
        """Count this batch shape's FLOPs on a meta copy of the module (never on the module that trains)."""
        from lightning_adaptiveload.monitor.flops import meta_copy, meta_training_flops

        try:
            if self._meta_clone is None:
                self._meta_clone = meta_copy(pl_module, drop=pl_module._trainer)
            self._flops_cache[key] = meta_training_flops(pl_module, batch, batch_idx, clone=self._meta_clone)
        except Exception as err:  # any failure of a user's step on meta tensors: go without FLOPs
            self._flops_source = None
            self._meta_clone = None
            self._warn_flops_unknown(
                f"counting training_step on a meta-device copy failed: {type(err).__name__}: {err}"
            )
            return
        self._counted_step = True

    # ------------------------------------------------------------------ per-step helpers

    def _work(self, batch: Any) -> tuple[float, float, float, float]:
        if not isinstance(batch, Mapping):
            self._warn_once(
                "work",
                f"LoadBalanceMonitor: the batch is a {type(batch).__name__}, not a dict with keys "
                f"{list(_WORK_KEYS)}; compute_cv, token_cv and tokens/s are not logged. Batches of "
                "AdaptiveLoadDataModule carry them; add them in `on_after_batch_transfer` for other data.",
            )
            return (math.nan,) * 4
        missing = [k for k in _WORK_KEYS if k not in batch]
        if missing:
            self._warn_once(
                "work",
                f"LoadBalanceMonitor: the batch has no key(s) {missing} (keys: {sorted(map(str, batch))}); the "
                "statistics that need them are not logged. Add them in `on_after_batch_transfer`.",
            )
        return tuple(_as_float(batch.get(k)) for k in _WORK_KEYS)  # type: ignore[return-value]

    def _batch_flops(self, pl_module: pl.LightningModule, batch: Any) -> float:
        source = self._flops_source
        if source is None:
            return math.nan
        if source == "flops_fn":
            return float(self.flops_fn(batch))  # type: ignore[misc]
        if source == "flops_per_batch":
            value = pl_module.flops_per_batch  # type: ignore[attr-defined]
            return float(value(batch) if callable(value) else value)
        if source == "analytic":
            args = _analytic_args(batch)
            if args not in self._flops_cache:
                self._flops_cache[args] = 3.0 * float(self._analytic.flops(*args))
            return self._flops_cache[args]
        if source == "wan_config":
            from lightning_adaptiveload.monitor.flops import wan_flops_per_batch

            return wan_flops_per_batch(self._analytic, batch)
        # flop_counter: counted on the meta copy at the batch start
        return self._flops_cache.get(self._step_key, math.nan)

    def _should_log(self, trainer: pl.Trainer) -> bool:
        # Same rule as Lightning's ThroughputMonitor: Lightning's own logging cadence, at optimizer steps only
        # (with gradient accumulation every micro-batch of a logging step would match otherwise).
        try:
            if trainer.fit_loop._should_accumulate():
                return False
            return bool(trainer._logger_connector.should_update_logs)
        except AttributeError:  # a Lightning without these internals: fall back to the public step counter
            n = trainer.log_every_n_steps
            return n > 0 and trainer.global_step % n == 0

    # ------------------------------------------------------------------ gather and statistics

    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule, log: bool) -> None:
        pending, self._pending = self._pending, []
        self._clock.wait(pending[-1].end)  # the one host synchronisation per flush (no-op on CPU)
        block: list[float] = [float(len(pending)), self._peak, self._device_total]
        for p in pending:
            block.extend(self._resolve(p))
        gathered = _dist.all_gather_floats(block)
        self._num_collectives += 1
        steps = _split_blocks(gathered)  # (K, world, F)
        if self._peaks_flops is None:
            self._peaks_flops = np.array([g[1] for g in gathered], dtype=np.float64)
            self._totals = np.array([g[2] for g in gathered], dtype=np.float64)
        peaks = steps[:, :, _IDX["peak_allocated_bytes"]]
        if not np.isnan(peaks).all():
            self._high_water = max(self._high_water, float(np.nanmax(peaks)))
        table = _step_table(steps, self._peaks_flops, self._totals, getattr(self, "_max_tokens", math.nan))
        if self._rank == 0:
            self._record(steps, table)
        if log:
            metrics = self._window_metrics(steps, table)
            if metrics:
                pl_module.log_dict(
                    {self.prefix + k: v for k, v in metrics.items()},
                    on_step=True,
                    on_epoch=False,
                    batch_size=1,
                )

    def _resolve(self, p: _Pending) -> list[float]:
        step_time = self._clock.seconds(p.start, p.end)
        compute = self._clock.seconds(p.start, p.bucket) if p.bucket is not None else step_time
        if p.prev_end is not None:
            iter_time = self._clock.seconds(p.prev_end, p.end)
            data_time = self._clock.seconds(p.prev_end, p.start)
        else:
            iter_time, data_time = step_time, math.nan
        return [
            float(p.batch_idx),
            float(p.step),
            *p.work,
            p.flops,
            compute,
            step_time,
            iter_time,
            data_time,
            *p.memory,
            float(p.flags),
        ]

    def _window_metrics(self, steps: np.ndarray, table: dict[str, np.ndarray]) -> dict[str, float]:
        """The logged values of one window: means over its steps (time balance over un-counted steps only)."""
        timed = table["counted"] == 0
        out: dict[str, float] = {}
        for key in (
            "compute_cv",
            "compute_imbalance",
            "token_cv",
            "vram_efficiency_mean",
            "vram_efficiency_min",
            "fill",
        ):
            out[key] = _nanmean(table[key])
        for key in ("step_time_cv", "imbalance", "data_share"):
            out[key] = _nanmean(table[key][timed])
        figures = _balance_figures(table)
        out["straggler_wait"] = figures["straggler_wait"]  # time-weighted over the window's timed steps
        out["step_wait_mean"] = figures["step_wait_mean"]
        for key in ("peak_allocated_gib", "peak_reserved_gib"):
            out[key] = _nanmax(table[key])
        out.update(_throughput(table, steps.shape[1], self._peaks_flops))
        peaks = steps[:, :, _IDX["peak_allocated_bytes"]]
        if peaks.size and not np.isnan(peaks).any():
            out["peak_vram_util_eff"] = stats.peak_vram_utilisation_efficiency(
                peaks.ravel(), self._high_water
            )
        return {k: float(v) for k, v in out.items() if _finite(v)}

    def _record(self, steps: np.ndarray, table: dict[str, np.ndarray]) -> None:
        """Rank 0 keeps the per-step table and, for the plots, per-rank compute time and peak memory."""
        self._tables.append(table)
        self._compile_steps += int(((steps[:, :, -1].astype(np.int64) & _FLAG_COMPILED) > 0).any(axis=1).sum())
        for name, store in (
            ("compute_time_s", self._rank_compute),
            ("peak_allocated_bytes", self._rank_peak),
        ):
            x = steps[:, :, _IDX[name]]
            if x.shape[1] > _MAX_PLOTTED_RANKS:  # keep a band, not every rank, on large jobs
                x = np.stack([x.min(axis=1), x.mean(axis=1), x.max(axis=1)], axis=1)
            store.append(x.astype(np.float32))
        if self._ranks_csv is None:
            return
        k, world, _ = steps.shape
        flags = steps[:, :, -1].astype(np.int64)
        with open(self._ranks_csv, "a", newline="") as f:
            writer = csv.writer(f)
            for i in range(k):
                for r in range(world):
                    row = steps[i, r]
                    writer.writerow(
                        [
                            r,
                            *(_csv_cell(float(v), _FIELDS[j]) for j, v in enumerate(row[:-1])),
                            int(bool(flags[i, r] & _FLAG_COUNTED)),
                            int(bool(flags[i, r] & _FLAG_HOOK)),
                        ]
                    )

    # ------------------------------------------------------------------ end of fit (rank 0)

    def _history(self) -> dict[str, np.ndarray]:
        if not self._tables:
            return {}
        return {k: np.concatenate([t[k] for t in self._tables]) for k in self._tables[0]}

    def _summarize(self) -> dict[str, Any]:
        table = self._history()
        world = self._world
        peaks_flops = self._peaks_flops if self._peaks_flops is not None else np.full(world, self._peak)
        totals = self._totals if self._totals is not None else np.full(world, self._device_total)
        n = len(table.get("step", ()))
        described: dict[str, dict[str, float]] = {}
        overall: dict[str, float] = {}
        if n:
            timed = table["counted"] == 0
            for key in _SUMMARY_ALL_STEPS:
                described[key] = stats.describe(table[key].tolist())
            for key in _SUMMARY_TIMED_STEPS:
                described[key] = stats.describe(table[key][timed].tolist())
            overall.update(_throughput(table, world, peaks_flops))
            overall.update(_balance_figures(table))
            overall["tokens"] = float(np.nansum(table["tokens"]))
            overall["samples"] = float(np.nansum(table["samples"]))
            peak_cols = [p for p in self._rank_peak]
            if peak_cols and world <= _MAX_PLOTTED_RANKS:
                peaks = np.concatenate(peak_cols).astype(np.float64)
                if not np.isnan(peaks).any():
                    overall["peak_vram_util_eff"] = stats.peak_vram_utilisation_efficiency(peaks.ravel())
            elif _finite(self._high_water) and self._high_water > 0:
                # Large jobs keep min/mean/max per step only; the mean column gives the same mean over ranks.
                means = np.concatenate(peak_cols)[:, 1].astype(np.float64)
                overall["peak_vram_util_eff"] = float(means.mean() / self._high_water)
        return {
            "meta": {
                "world_size": world,
                "device": self._device_name,
                "device_total_bytes": totals.tolist(),
                "peak_flops_per_device": peaks_flops.tolist(),
                "peak_flops_dtype": self._dtype_key,
                "timing_method": self._timing_method,
                "flops_source": self._flops_source,
                "num_steps": n,
                "steps_with_flop_counting": int(table["counted"].sum()) if n else 0,
                "steps_compiling": self._compile_steps,
                "num_collectives": self._num_collectives,
                "norm_modulate_path": _norm_modulate_path(),
                "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            },
            "overall": overall,
            "table": described,
        }

    def _format_summary(self) -> str:
        meta, overall, table = self.summary["meta"], self.summary["overall"], self.summary["table"]
        lines = [
            f"LoadBalanceMonitor: {meta['num_steps']} steps x {meta['world_size']} ranks on {meta['device']}; "
            f"compute time by {meta['timing_method']}, FLOPs by {meta['flops_source']}",
            f"{'statistic':<22}{'mean':>12}{'p50':>12}{'p95':>12}{'max':>12}",
        ]
        for key, d in table.items():
            if d["n"] == 0:
                continue
            lines.append(f"{key:<22}" + "".join(f"{_fmt(d[c]):>12}" for c in ("mean", "p50", "p95", "max")))
        lines.append("whole job: " + ", ".join(f"{k}={_fmt(v)}" for k, v in overall.items() if _finite(v)))
        lines.append(f"layer_norm_modulate (rank 0): {meta.get('norm_modulate_path', 'not called')}")
        return "\n".join(lines)

    def _write_step_files(self) -> None:
        assert self._outdir is not None
        table = self._history()
        keys = list(_STEP_COLUMNS)
        rows = [dict(zip(keys, vals)) for vals in zip(*(table[k].tolist() for k in keys))] if table else []
        with open(os.path.join(self._outdir, "load_balance_steps.csv"), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(keys)
            for row in rows:
                writer.writerow([_csv_cell(row[k], k) for k in keys])
        payload = {"summary": _jsonable(self.summary), "steps": [_jsonable(r) for r in rows]}
        with open(os.path.join(self._outdir, "load_balance.json"), "w") as f:
            json.dump(payload, f, indent=1, allow_nan=False)

    def _write_plots(self) -> None:
        assert self._outdir is not None
        totals = self._totals if self._totals is not None else np.full(self._world, self._device_total)
        _write_plots(
            self._outdir,
            self._history(),
            np.concatenate(self._rank_compute),
            np.concatenate(self._rank_peak),
            totals,
            banded=self._world > _MAX_PLOTTED_RANKS,
        )


# ---------------------------------------------------------------------- module helpers


def _norm_modulate_path() -> str:
    # Only where the model imported the op: importing it here would load (or build) the CUDA kernels.
    ops = sys.modules.get("lightning_adaptiveload.ops")
    return ops.fused_op_paths() if ops is not None else "not called"


def _as_float(value: Any) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _dynamo_frames() -> int:
    """Frames torch.compile (dynamo) has compiled in this process so far; 0 when dynamo was never loaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    return int(sum(utils.counters["frames"].values()))


def _shape_key(batch: Any) -> Any:
    """A hashable key of the tensor shapes in a batch (dicts, lists and tuples are walked; the rest ignored)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape  # torch.Size is a hashable tuple
    if isinstance(batch, Mapping):
        return tuple(
            (k, _shape_key(v))
            for k, v in batch.items()
            if isinstance(v, (torch.Tensor, Mapping, list, tuple))
        )
    if isinstance(batch, (list, tuple)):
        return tuple(_shape_key(v) for v in batch if isinstance(v, (torch.Tensor, Mapping, list, tuple)))
    return None


def _analytic_args(batch: Any) -> tuple[int, int, int]:
    if not isinstance(batch, Mapping) or "batch_size" not in batch or "seq_len" not in batch:
        raise ValueError(
            "LoadBalanceMonitor: the model's analytic `flops(batch_size, seq_len, text_len)` needs batches with "
            f"'batch_size' and 'seq_len' keys; got {type(batch).__name__}"
            + (f" with keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else "")
            + ". Pass `flops_fn=` to LoadBalanceMonitor instead."
        )
    text = batch.get("text")
    text_len = int(text.shape[1]) if isinstance(text, torch.Tensor) and text.ndim >= 2 else 0
    return int(batch["batch_size"]), int(batch["seq_len"]), text_len


def _split_blocks(gathered: list[list[float]]) -> np.ndarray:
    """Turn the ranks' flat blocks into an array (steps, ranks, fields), checking that the ranks line up."""
    counts = [int(g[0]) for g in gathered]
    if len(set(counts)) != 1:
        raise RuntimeError(
            f"LoadBalanceMonitor: the ranks buffered different step counts {counts} (index = rank); every rank "
            "must run the same number of training batches (unequal counts also hang DDP)."
        )
    h = len(_HEADER)
    a = np.asarray([g[h:] for g in gathered], dtype=np.float64).reshape(len(gathered), counts[0], _F)
    a = a.transpose(1, 0, 2)
    idx = a[:, :, _IDX["batch_idx"]]
    bad = np.flatnonzero((idx != idx[:, :1]).any(axis=1))
    if bad.size:
        raise RuntimeError(
            f"LoadBalanceMonitor: the ranks' batches are out of step: batch indices {idx[bad[0]].tolist()} "
            "(index = rank) were gathered together; every rank must call the training hooks for the same batches."
        )
    return a


def _step_table(
    steps: np.ndarray, peaks_flops: np.ndarray, totals: np.ndarray, max_tokens: float = math.nan
) -> dict[str, np.ndarray]:
    """Statistics across ranks of every step.

    Args:
        steps: float64 (steps, ranks, len(_FIELDS)), the gathered records.
        peaks_flops: float64 (ranks,), dense peak FLOP/s of each rank's device (nan if unknown).
        totals: float64 (ranks,), device memory in bytes (nan without CUDA).

    Returns:
        One float64 array of shape (steps,) per name of ``_STEP_COLUMNS``; nan where a value is unknown.
    """

    def col(name: str) -> np.ndarray:
        return steps[:, :, _IDX[name]]

    world = steps.shape[1]
    flags = col("flags").astype(np.int64)
    t: dict[str, np.ndarray] = {
        "step": col("step")[:, 0],
        "batch_idx": col("batch_idx")[:, 0],
        "counted": ((flags & _FLAG_COUNTED) > 0).any(axis=1).astype(np.float64),
        "hook_timed": ((flags & _FLAG_HOOK) > 0).all(axis=1).astype(np.float64),
    }
    t["compute_cv"], t["compute_imbalance"], _ = stats.balance_rows(col("cost"))
    t["token_cv"], _, _ = stats.balance_rows(col("num_tokens"))
    t["step_time_cv"], t["imbalance"], t["straggler_wait"] = stats.balance_rows(col("compute_time_s"))
    t["compute_time_max_s"] = col("compute_time_s").max(axis=1)
    t["step_time_s"] = col("step_time_s").max(axis=1)
    wall = col("iter_time_s").max(axis=1)  # a synchronous step ends for everyone with the slowest rank
    t["iter_time_s"] = wall
    with np.errstate(divide="ignore", invalid="ignore"):
        share = col("data_time_s") / col("iter_time_s")
        n = (~np.isnan(share)).sum(axis=1)
        t["data_share"] = np.where(n > 0, np.nansum(share, axis=1) / np.maximum(n, 1), np.nan)
        t["tokens"] = col("num_tokens").sum(axis=1)
        t["samples"] = col("batch_size").sum(axis=1)
        t["flops"] = col("flops").sum(axis=1)
        t["tokens_per_s"] = t["tokens"] / wall
        t["samples_per_s"] = t["samples"] / wall
        t["tflops_per_device"] = t["flops"] / wall / world / 1e12
        t["mfu"] = t["flops"] / wall / peaks_flops.sum()
        eff = col("peak_allocated_bytes") / totals[None, :]
    t["vram_efficiency_mean"] = eff.mean(axis=1)
    t["vram_efficiency_min"] = eff.min(axis=1)
    t["peak_allocated_gib"] = col("peak_allocated_bytes").max(axis=1) / _GIB
    t["peak_reserved_gib"] = col("peak_reserved_bytes").max(axis=1) / _GIB
    t["fill"] = col("num_tokens").mean(axis=1) / max_tokens
    return t


def _balance_figures(table: dict[str, np.ndarray]) -> dict[str, float]:
    """:data:`stats.BALANCE_FIGURES` of the compute times over the table's timed steps (FLOP-counting steps
    left out): the names and definitions the simulator reports, so measured and simulated runs compare."""
    timed = table["counted"] == 0
    return stats.summarize_steps(
        table["step_time_cv"][timed],
        table["imbalance"][timed],
        table["straggler_wait"][timed],
        table["compute_time_max_s"][timed],
    )


def _throughput(table: dict[str, np.ndarray], world: int, peaks_flops: np.ndarray | None) -> dict[str, float]:
    """Job throughput over the steps of ``table``, summed over ranks, FLOP-counting steps included.

    Those steps are the job's real time, the monitor's cost with it; leaving them out would flatter it.
    """
    wall = float(table["iter_time_s"].sum())
    flops = float(table["flops"].sum())
    peak = float(peaks_flops.sum()) if peaks_flops is not None else math.nan
    return {
        "tokens_per_s": stats.achieved_flops_per_s(float(table["tokens"].sum()), wall),
        "samples_per_s": stats.achieved_flops_per_s(float(table["samples"].sum()), wall),
        "tflops_per_device": stats.achieved_flops_per_s(flops, wall) / world / 1e12,
        "mfu": stats.mfu(flops, wall, peak),
    }


def _csv_cell(value: float, name: str) -> str | int | float:
    if math.isnan(value):
        return ""
    if name in (
        "batch_idx",
        "step",
        "num_tokens",
        "batch_size",
        "seq_len",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "alloc_retries",
        "ooms",
        "counted",
        "hook_timed",
        "tokens",
        "samples",
    ):
        return int(value)
    return repr(float(value))


def _jsonable(value: Any) -> Any:
    if isinstance(value, float):
        return value if _finite(value) else None
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _fmt(value: float) -> str:
    if not _finite(value):
        return "-"
    a = abs(value)
    if a != 0 and (a >= 1e5 or a < 1e-3):
        return f"{value:.3e}"
    return f"{value:.4f}"


# ---------------------------------------------------------------------- plots (rank 0, end of fit)


def _rolling_mean(values: np.ndarray, width: int) -> np.ndarray:
    out = np.empty(len(values))
    for i in range(len(values)):
        out[i] = _nanmean(values[max(0, i - width + 1) : i + 1])
    return out


def _write_plots(
    outdir: str,
    table: dict[str, np.ndarray],
    rank_compute: np.ndarray,
    rank_peak: np.ndarray,
    totals: np.ndarray,
    banded: bool = False,
) -> list[str]:
    """Write the PNG plots and return their paths.

    Args:
        outdir: directory to write into.
        table: the per-step table (``_STEP_COLUMNS`` -> float array (steps,)).
        rank_compute: compute time in seconds, (steps, ranks), or (steps, 3) min/mean/max when ``banded``.
        rank_peak: peak allocated bytes, same layout; all nan without CUDA (no memory plot then).
        totals: (ranks,) device memory in bytes.
        banded: the per-rank arrays hold min/mean/max over ranks instead of every rank.

    Uses matplotlib's object API (``Figure``, Agg canvas): no pyplot state, no global backend switch.
    """
    from matplotlib.figure import Figure

    written = []
    n = len(table["step"])
    x = table["batch_idx"] + 1
    counted = table["counted"] > 0
    width = max(1, min(50, n // 10))  # rolling-mean window of the throughput plot
    world = rank_compute.shape[1] if not banded else None

    def save(fig: Figure, name: str) -> None:
        written.append(os.path.join(outdir, name))
        fig.savefig(written[-1], dpi=110)

    # 1. distribution of the per-step CVs across ranks
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    for ax, key, label in zip(
        fig.subplots(1, 3),
        ("compute_cv", "token_cv", "step_time_cv"),
        ("compute CV (cost-model estimate)", "token CV", "step-time CV (measured compute)"),
    ):
        vals = 100 * table[key][~counted] if key == "step_time_cv" else 100 * table[key]
        vals = vals[~np.isnan(vals)]
        if vals.size:
            d = stats.describe(vals.tolist())
            ax.hist(vals, bins=min(50, max(5, vals.size // 3)), color="tab:blue", alpha=0.8)
            ax.axvline(d["mean"], color="k", linestyle="--", label=f"mean {d['mean']:.1f}%")
            ax.axvline(d["p95"], color="tab:red", linestyle=":", label=f"p95 {d['p95']:.1f}%")
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("CV across ranks per step (%)")
        ax.set_ylabel("steps")
    ranks = f"{world} ranks" if world is not None else "ranks"
    fig.suptitle(f"Balance across {ranks}, {n} steps")
    save(fig, "load_balance_cv.png")

    # 2. job throughput over steps
    fig = Figure(figsize=(10, 5.5), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    for ax, key, label in zip(axes, ("tokens_per_s", "samples_per_s"), ("tokens/s", "samples/s")):
        ax.plot(x, table[key], color="tab:blue", alpha=0.35, linewidth=0.8, label="per step")
        ax.plot(
            x, _rolling_mean(table[key], width), color="tab:blue", linewidth=1.8, label=f"mean of {width}"
        )
        ax.set_ylabel(f"{label} (all ranks)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[-1].set_xlabel("training batch")
    fig.suptitle("Job throughput, summed over ranks")
    save(fig, "load_balance_throughput.png")

    # 3. per-rank compute time over steps
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.subplots()
    ms = 1e3 * rank_compute
    if banded:
        ax.fill_between(x, ms[:, 0], ms[:, 2], color="tab:blue", alpha=0.3, label="min to max over ranks")
        ax.plot(x, ms[:, 1], color="tab:blue", linewidth=0.9, label="mean over ranks")
    else:
        for r in range(ms.shape[1]):
            ax.plot(x, ms[:, r], linewidth=0.9, label=f"rank {r}")
    ax.plot(
        x,
        1e3 * table["step_time_s"],
        color="k",
        linestyle="--",
        linewidth=0.9,
        label="step wall time (slowest)",
    )
    ax.set_xlabel("training batch")
    ax.set_ylabel("ms")
    ax.set_title("Each rank's own compute time (waiting for other ranks excluded)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=4)
    save(fig, "load_balance_compute_time.png")

    # 4. memory over steps (CUDA only)
    if not np.isnan(rank_peak).all():
        fig = Figure(figsize=(10, 4.5), layout="constrained")
        ax = fig.subplots()
        gib = rank_peak / _GIB
        if banded:
            ax.fill_between(
                x, gib[:, 0], gib[:, 2], color="tab:blue", alpha=0.3, label="min to max over ranks"
            )
            ax.plot(x, gib[:, 1], color="tab:blue", linewidth=0.9, label="mean over ranks")
        else:
            for r in range(gib.shape[1]):
                ax.plot(x, gib[:, r], linewidth=0.9, label=f"rank {r}")
        ax.axhline(float(np.nanmax(gib)), color="k", linestyle=":", label="high-water mark")
        if not np.isnan(totals).all():
            ax.axhline(
                float(np.nanmin(totals)) / _GIB, color="tab:red", linestyle="--", label="device memory"
            )
        ax.set_ylim(bottom=0)
        ax.set_xlabel("training batch")
        ax.set_ylabel("peak allocated (GiB)")
        ax.set_title("Peak allocated memory per step and rank")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, ncol=4, loc="lower right")
        save(fig, "load_balance_memory.png")
    return written
