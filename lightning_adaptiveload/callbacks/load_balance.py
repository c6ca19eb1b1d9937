"""LoadBalanceMonitor
==================

Balance, memory and throughput of every rank, every training step.

Lightning's :class:`~lightning.pytorch.callbacks.ThroughputMonitor` times rank 0 and scales by the world size,
and :class:`~lightning.pytorch.callbacks.DeviceStatsMonitor` reads rank 0's memory: on a job whose ranks get
different work, both report the average rank and hide the straggler that everyone waits for. This callback
measures every rank, gathers the measurements in one small collective per logged step, and logs the
balance statistics of :mod:`lightning_adaptiveload.stats`. See ``docs/monitor.md``.

This module holds the Lightning hooks only: the clocks and the DDP hook are in
:mod:`~lightning_adaptiveload.monitor.timing`, the per-step table in :mod:`~lightning_adaptiveload.monitor.steps`,
the files and plots in :mod:`~lightning_adaptiveload.monitor.report`. The monitor only measures: the closed loop
that plans with its measurements is :class:`~lightning_adaptiveload.callbacks.closed_loop.ClosedLoop`.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch.callbacks.callback import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_adaptiveload import _dist, _lightning_compat
from lightning_adaptiveload.monitor import loop_state, report
from lightning_adaptiveload.monitor import steps as step_table
from lightning_adaptiveload.monitor.fetched import FetchTally, merge_tallies
from lightning_adaptiveload.monitor.flops import BatchFlops, resolve_peak
from lightning_adaptiveload.monitor.timing import (
    BackwardTimer,
    CudaClock,
    HostClock,
    ManualClock,
    PendingStep,
    StallStacks,
    StepCompiles,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["LoadBalanceMonitor"]

_log = logging.getLogger(__name__)

_WORK_KEYS = ("cost", "num_tokens", "batch_size", "seq_len")

#: ``listener(steps, table)``: a gathered block ``(K steps, world, FIELDS)`` and its step table.
GatherListener = Callable[[np.ndarray, dict[str, np.ndarray]], None]


class LoadBalanceMonitor(Callback):
    r"""Measure the work, time and memory of every rank at every training step and log their balance.

    **Measured on every rank, every step** (buffered locally, never synchronised per step):

    - work: ``batch["cost"]`` (the cost model's estimate), ``batch["num_tokens"]``, ``batch["batch_size"]``,
      ``batch["seq_len"]`` (the batch contract of ``docs/architecture.md``) and the step's model FLOPs;
    - time: the rank's own *compute* time, from the step start to the end of its own backward (an
      autograd-engine callback queued ahead of the strategy's gradient synchronisation; CUDA events on GPU,
      the host clock on CPU), so waiting for slower ranks is excluded; the *measured* synchronisation wait,
      from the end of the backward to the end of the gradient collective; the step's wall time; the
      iteration time (step end to step end, data loading included);
    - memory (CUDA only): peak allocated and reserved bytes within the step (peaks reset at each step start),
      the device's total, allocation retries and OOMs.

    The buffered steps of all ranks are gathered in **one** ``all_gather`` of a few floats per step at each
    logging step (``Trainer(log_every_n_steps=...)``), so per-step files cover every step while the
    collectives stay one per logged step.

    **Logged** (through ``pl_module.log``, so any logger or none; the mean over the window's steps):
    ``compute_cv``, ``compute_imbalance`` (of the cost estimates), ``token_cv``, ``step_time_cv`` (of the
    ranks' compute times), ``imbalance`` (``max / mean - 1`` of compute times), ``straggler_wait``
    (the share of the window's compute time spent waiting for the slowest rank: ``sum(max - mean) /
    sum(max)`` over its steps, :func:`lightning_adaptiveload.stats.straggler_wait`),
    ``measured_straggler_wait`` (the same share from each rank's measured wait,
    :func:`~lightning_adaptiveload.stats.measured_wait_rows`: a check of the first), ``step_wait_mean``
    (the per-step ``1 - mean / max``, averaged over steps unweighted), ``tokens_per_s`` and
    ``samples_per_s`` (summed over ranks), ``tflops_per_device``, ``mfu``,
    ``vram_efficiency_mean``/``_min``, ``peak_vram_util_eff``, ``peak_allocated_gib``, ``peak_reserved_gib``, ``data_share``; each under ``prefix``.

    **End of fit** (rank 0): ``load_balance_ranks.csv`` (one row per rank and step), ``load_balance_steps.csv``
    and ``load_balance.json`` (one row per step, summary, metadata) and PNG plots are written to ``dirpath``
    (default: ``trainer.log_dir``; nothing under ``fast_dev_run`` unless ``dirpath`` is given), then a short
    summary table is printed (:func:`~lightning_adaptiveload.monitor.report.format_summary`: the planned compute
    CV beside the measured step-time CV, the steps used and left out, each epoch's last step where it stands
    out), ending with where the files are (an INFO log line with ``print_summary=False``). A file that cannot be
    written after the start is reported once, naming it, and training goes on.

    **Warm-up steps**: a step in which ``torch.compile`` compiled (:func:`~.timing.compile_count`) or
    before which FLOPs were counted is marked (``counted`` in the step table, ``flops_counted`` in the rank
    table) and left out of the time-balance statistics (``step_time_cv``, ``imbalance``,
    ``straggler_wait``, ``data_share``): a compiling rank holds the others for many seconds, which is not
    load imbalance. The summary's ``meta`` gives ``steps_with_flop_counting`` (all warm-up steps),
    ``steps_compiling`` and ``compiles_rank0`` (rank 0's ``[step, seconds compiling]``: a slow step not
    listed did not compile on rank 0).

    **It only measures.** The plan is changed by :class:`~lightning_adaptiveload.callbacks.closed_loop.ClosedLoop`
    (after the monitor in ``callbacks``; ``docs/closed_loop.md``), which the monitor feeds through
    :meth:`add_listener` (every gathered block and its step table, on every rank), :meth:`flush`,
    :attr:`gathered_through`, :attr:`timing_exact` and :attr:`outdir`. The monitor keeps nothing in a
    checkpoint.

    Args:
        dirpath: where to write the files; ``None`` for ``trainer.log_dir`` (the logger's directory, or
            ``default_root_dir`` without a logger).
        prefix: prepended to every logged key.
        flops_fn: ``flops_fn(batch) -> float``, the training FLOPs (forward + backward) of one batch on this
            rank (under sequence parallelism: of the group's batch, which every rank of the group gets; the
            monitor counts each group's tokens, samples and FLOPs once). Default:
            ``pl_module.flops_per_batch(batch)`` (or the attribute's value), else
            ``3 * model.flops(batch_size, seq_len, text_len)`` of the first submodule that has an analytic
            forward ``flops`` method, else ``FlopCounterMode`` counting
            ``training_step`` on a meta-device copy of the module once per distinct batch shape (times 3;
            :func:`~lightning_adaptiveload.monitor.flops.meta_training_flops`). The module that trains is never run
            under a FLOP counter (that would stop ``torch.compile`` from compiling it). When no way works,
            a warning says so once and TFLOP/s and MFU are not logged.
        count_flops: set ``False`` to disable the meta-copy count (no TFLOP/s or MFU then, unless one of
            the analytic ways applies).
        peak_flops: dense peak FLOP/s of one device; default: :func:`lightning_adaptiveload.stats.peak_flops`
            from the device name and the trainer's precision (``None`` on CPU: no MFU).
        write_files: write the CSV and JSON files.
        plots: write the PNG plots (matplotlib, Agg).
        print_summary: print the summary table on rank 0 at the end of fit.
        max_buffered_steps: flush (gather) at least every this many batches even when nothing is logged
            (``log_every_n_steps=0``), to bound the buffer.
        clock: the clock the steps are timed with; None: CUDA events on GPU, the host clock on CPU. A
            :class:`~lightning_adaptiveload.monitor.timing.ManualClock` replaces the measured time by a known
            one (tests, simulations).
        stall_stacks_s: when a step runs longer than this many seconds, write every thread's Python stack
            to ``stall_stacks_rank<r>.txt`` in ``dirpath``, again every as many seconds until it ends
            (:class:`~lightning_adaptiveload.monitor.timing.StallStacks`: is a slow step compiling, collecting
            garbage, waiting?). None: off.

    Raises:
        ValueError: on a bad argument.
        RuntimeError: if the ranks' buffered steps do not line up (ranks running different batch counts).

    Example::

        from lightning import Trainer
        from lightning_adaptiveload import LoadBalanceMonitor

        trainer = Trainer(strategy="ddp", devices=8, log_every_n_steps=20, callbacks=[LoadBalanceMonitor()])
        # and to plan the next epochs with the measured costs: callbacks=[LoadBalanceMonitor(), ClosedLoop()]
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
        clock: HostClock | ManualClock | None = None,
        stall_stacks_s: float | None = None,
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
        # Outside _reset: a ClosedLoop subscribes in setup, before on_train_start.
        self._listeners: list[GatherListener] = []
        self._fixed_clock = clock
        self._stacks = StallStacks(stall_stacks_s) if stall_stacks_s is not None else None
        self.stall_stacks_s = stall_stacks_s
        self._trainer: Any = None  # set in setup
        self.summary: dict[str, Any] = {}
        self._fetch = FetchTally()  # bytes and requests of ranged reads, per epoch (batch["fetched"])
        self._reset()

    # ------------------------------------------------------------------ state

    def _reset(self) -> None:
        self._rank, self._world = 0, 1
        self._sequence_degree = 1  # G: the ranks of a sequence-parallel group share a batch (counted once)
        self._device = torch.device("cpu")
        self._clock: HostClock | CudaClock = HostClock()
        self._max_tokens = math.nan  # the batcher's cap, read at train start (for the per-step fill)
        self._timer: BackwardTimer | None = None
        self._fsdp_timer: Any = None  # FSDP2: FsdpStepTimer, whose all-gather waits come off the compute time
        self._timing_method = "step"
        self._timing_exact = True  # False where compute times include waits the monitor cannot bracket
        self._gathered_through = -1  # total batch index of the last gathered step
        self._flops: BatchFlops | None = None
        self._counted_step = False  # FLOPs were counted before this step
        self._compiling = StepCompiles()  # did torch.compile compile in this step (this rank's log)
        self._compile_steps = 0  # steps in which some rank compiled (rank 0's count)
        self._device_name = "cpu"
        self._device_total = math.nan
        self._peak = math.nan
        self._dtype_key: str | None = None
        self._pending: list[PendingStep] = []
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
        self._no_files_because = ""  # why nothing is written (fast_dev_run), for the summary's last line
        self._files = report.FileGuard("LoadBalanceMonitor", _warn_user)
        self._started_at = 0.0  # wall clock at train start: files of this fit are those written since
        self._plots_written: list[str] = []

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=UserWarning)

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The monitor keeps no state; a 0.1.0 monitor kept its closed loop's here, which a ClosedLoop reads.

        Raises:
            LoopStateError: (a ``ValueError``) a state that is neither empty nor a 0.1.0 closed loop's, or one of
                those that breaks its schema (names the checkpoint key, the field and the rule).
        """
        loop_state.check_monitor_state(state_dict, loop_state.state_where(self.state_key))
        if loop_state.holds_loop_state(state_dict) and not self._listeners:
            self._warn_once(
                "loop_state",
                "LoadBalanceMonitor: the checkpoint holds the cost model that a 0.1.0 LoadBalanceMonitor learned "
                "(its refit); the monitor only measures now and leaves it unused. To plan with it, add "
                "lightning_adaptiveload.ClosedLoop after the monitor in the trainer's callbacks.",
            )

    # ------------------------------------------------------------------ for the closed loop

    def add_listener(self, listener: GatherListener) -> None:
        """Call ``listener(steps, table)`` after every gather, on every rank: ``steps`` is the gathered block
        ``(K steps, world, FIELDS)`` of :mod:`~lightning_adaptiveload.monitor.steps` (the same array on every
        rank), ``table`` its step table (one entry per step). Adding the same listener again does nothing."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    @property
    def pending_steps(self) -> int:
        """Steps recorded on this rank and not gathered yet."""
        return len(self._pending)

    @property
    def gathered_through(self) -> int:
        """The total batch index (over the fit) of the last gathered step; -1 before the first gather."""
        return self._gathered_through

    @property
    def timing_exact(self) -> bool:
        """Whether each rank's compute time excludes its waits for the others (DDP, FSDP2, one process)."""
        return self._timing_exact

    @property
    def outdir(self) -> str | None:
        """Where the monitor writes its files: set on rank 0 at train start, None elsewhere or before."""
        return self._outdir

    def flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Gather the buffered steps now, without logging (a collective: every rank calls it at the same
        point; nothing happens where nothing is buffered, which is then the case on every rank)."""
        if self._pending:
            self._flush(trainer, pl_module, log=False)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        # The monitor gathers over gloo on CPU DDP; a user's own module registers no clean-up for its group.
        _dist.destroy_gloo_group_at_exit()  # see _dist.destroy_gloo_group_at_exit
        self._rank, self._world = _dist.rank_and_world(trainer)
        self._sequence_degree = _dist.sequence_degree(trainer) or 1
        self._device = trainer.strategy.root_device
        if self._device.type == "cuda":
            self._clock = CudaClock(self._device)
            self._device_name = torch.cuda.get_device_name(self._device)
            self._device_total = float(torch.cuda.get_device_properties(self._device).total_memory)
        else:
            self._clock = HostClock()
            self._device_name = self._device.type
        if self._fixed_clock is not None:
            self._clock = self._fixed_clock
        self._peak, self._dtype_key = resolve_peak(
            self.peak_flops, self._device, self._device_name, trainer.precision, self._warn_once
        )
        # The memory cap per rank and step, for the per-step fill (packed steps fill it; buckets do not).
        batcher = getattr(getattr(trainer, "datamodule", None), "batcher", None)
        self._max_tokens = float(getattr(batcher, "max_tokens", math.nan) or math.nan)
        self._install_timers(trainer)
        self._flops = BatchFlops(pl_module, self.flops_fn, self.count_flops, self._warn_once)
        # trainer.log_dir broadcasts from rank 0, so every rank must ask (once, here).
        outdir = self.dirpath if self.dirpath is not None else (trainer.log_dir or trainer.default_root_dir)
        self._started_at = time.time()
        if self._stacks is not None:
            os.makedirs(outdir, exist_ok=True)
            self._stacks.open(os.path.join(outdir, f"stall_stacks_rank{self._rank}.txt"))
        if getattr(trainer, "fast_dev_run", False) and self.dirpath is None:
            # Lightning writes no logs or checkpoints under fast_dev_run; files here would land in
            # default_root_dir, where the next run overwrites them. An explicit dirpath is still written.
            self._no_files_because = (
                "none under fast_dev_run (Lightning writes no logs or checkpoints then either; "
                "LoadBalanceMonitor(dirpath=...) keeps them)"
            )
            return
        if self._rank == 0 and self.write_files:
            self._outdir = outdir
            self._ranks_csv = os.path.join(outdir, "load_balance_ranks.csv")
            try:  # before step 1: a folder that cannot be written is an error, naming it
                os.makedirs(outdir, exist_ok=True)
                report.write_ranks_header(self._ranks_csv)
            except OSError as err:
                raise OSError(
                    err.errno,
                    f"LoadBalanceMonitor cannot write its files in {outdir} ({err}); give it a writable folder "
                    "(LoadBalanceMonitor(dirpath=...)) or LoadBalanceMonitor(write_files=False, plots=False)",
                ) from err
            self._files.written.append(self._ranks_csv)
        elif self._rank == 0:
            self._outdir = outdir

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)
        if self._flops is not None:
            self._counted_step = self._flops.before_step(pl_module, batch, batch_idx)
        self._compiling.start()
        if self._stacks is not None:
            self._stacks.start(trainer.global_step + 1)
        if self._timer is not None:
            self._timer.start_step()
        if self._fsdp_timer is not None:
            self._fsdp_timer.start_step()
        self._start = self._clock.mark()

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        if self._timer is not None:
            self._timer.watch(loss)

    @override
    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._timer is not None:
            self._timer.after_backward()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None:  # the batch started before this callback was set up
            return
        end = self._clock.mark()
        self._fetch.add(batch, trainer.current_epoch)
        if self._stacks is not None:
            self._stacks.end()
        flags = step_table.FLAG_COUNTED if self._counted_step else 0
        if self._compiling.end(trainer.global_step):
            flags |= step_table.FLAG_COUNTED | step_table.FLAG_COMPILED
            _log.info("step %d: torch.compile compiled for %.1f s", *self._compiling.log[-1])
        if isinstance(batch, Mapping) and batch.get("packed"):
            flags |= step_table.FLAG_PACKED
        if not getattr(trainer, "fast_dev_run", False) and batch_idx + 1 == trainer.num_training_batches:
            flags |= step_table.FLAG_EPOCH_END  # the epoch's last batch: where its plan's remainder runs
        backward_end = sync_end = fsdp = None
        if self._timer is not None:
            self._timer.active = False
            backward_end, sync_end = self._timer.backward_end, self._timer.sync_end
        if self._fsdp_timer is not None:
            self._fsdp_timer.active = False
            if self._fsdp_timer.buckets > 0:
                fsdp = self._fsdp_timer.mark
        if backward_end is not None or fsdp is not None:
            flags |= step_table.FLAG_HOOK
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
            PendingStep(
                batch_idx=_lightning_compat.total_batch_idx(trainer),
                step=int(trainer.global_step),
                epoch=int(trainer.current_epoch),
                work=self._work(batch),
                flops=self._flops(pl_module, batch) if self._flops is not None else math.nan,
                start=self._start,
                end=end,
                prev_end=self._prev_end,
                backward_end=backward_end,
                sync_end=sync_end,
                fsdp=fsdp,
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
        if self._stacks is not None:
            self._stacks.close()
        if self._pending:
            self._flush(trainer, pl_module, log=False)
        if self._fsdp_timer is not None:  # FSDP2's timing hooks come off the model
            self._fsdp_timer.remove()
        if self._timer is not None:
            self._timer.active = False
        fetched = merge_tallies(_dist.all_gather_object(self._fetch.epochs))  # one collective per fit
        if self._rank != 0:
            return
        self.summary = self._summarize()
        self.summary["fetched"] = fetched
        if self._outdir is not None and self.write_files:
            rows = report.step_rows(step_table.history(self._tables))
            steps_csv = os.path.join(self._outdir, "load_balance_steps.csv")
            self._files.write(steps_csv, report.write_steps_csv, steps_csv, rows)
            payload = {"summary": self.summary, "steps": rows}
            json_path = os.path.join(self._outdir, "load_balance.json")
            self._files.write(json_path, report.write_json, json_path, payload)
        if self._outdir is not None and self.plots and self._tables:
            self._files.write(os.path.join(self._outdir, "load_balance_*.png"), self._write_plots)
        self.summary["files"] = self._files_line()
        if self.print_summary:
            print(report.format_summary(self.summary), file=sys.stdout, flush=True)
        elif self.summary["files"]:
            rank_zero_info(f"LoadBalanceMonitor: files: {self.summary['files']}")

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if self._timer is not None:
            self._timer.active = False
        if self._fsdp_timer is not None:
            self._fsdp_timer.active = False

    # ------------------------------------------------------------------ setup helpers

    def _install_timers(self, trainer: pl.Trainer) -> None:
        """The end of each rank's backward is marked under every strategy (:class:`BackwardTimer`); under FSDP2
        the all-gather waits inside the step are bracketed too and taken off the compute time."""
        from torch.nn.parallel import DistributedDataParallel

        model = trainer.strategy.model
        self._timer = BackwardTimer(self._clock)
        self._timing_method = "backward_end"
        self._timing_exact = True
        if isinstance(model, DistributedDataParallel):
            if getattr(model, "_comm_hooks", None):
                self._timing_exact = False  # a ClosedLoop logs its refit only: the times may hold the wait
                self._warn_once(
                    "python_hook",
                    "LoadBalanceMonitor: a Python DDP communication hook is registered. On GPUs, under Lightning, "
                    "a Python hook that recorded a CUDA event (the monitor's own timing hook in 0.1.0) held the "
                    "fast ranks' backward kernels until the slowest rank's (2 x H200: 2.74 s against 1.58 s "
                    "without it; docs/monitor.md, 'Checked on GPUs'). Compute times then hold that wait. If "
                    "the ranks' compute times look alike although their work differs, compare a run without "
                    "the hook.",
                )
            return
        if self._world == 1:
            return
        from lightning_adaptiveload.monitor import fsdp_timing

        _dist.check_sharded(trainer.strategy, model)
        self._fsdp_timer = fsdp_timing.install_fsdp2_timer(self._clock, model)
        if self._fsdp_timer is not None:
            self._timing_method = "fsdp2_post_backward"
            return
        self._timing_exact = False
        self._warn_once(
            "gathers",
            f"LoadBalanceMonitor: under {type(trainer.strategy).__name__} the ranks may also wait for each other "
            "inside the forward and backward (parameter all-gathers of FSDP v1 or DeepSpeed ZeRO-3), which the "
            "monitor does not bracket: compute time runs to the end of the backward and includes those waits "
            "(step_time_cv and straggler_wait may understate the imbalance). DDP and FSDP2 are timed exactly.",
        )

    # ------------------------------------------------------------------ per-step helpers

    def _work(self, batch: Any) -> tuple[float, ...]:
        if not isinstance(batch, Mapping):
            self._warn_once(
                "work",
                f"LoadBalanceMonitor: the batch is a {type(batch).__name__}, not a dict with keys "
                f"{list(_WORK_KEYS)}; compute_cv, token_cv and tokens/s are not logged. Batches of "
                "AdaptiveLoadDataModule carry them; add them in `on_after_batch_transfer` for other data.",
            )
            return (math.nan,) * 5
        missing = [k for k in _WORK_KEYS if k not in batch]
        if missing:
            self._warn_once(
                "work",
                f"LoadBalanceMonitor: the batch has no key(s) {missing} (keys: {sorted(map(str, batch))}); the "
                "statistics that need them are not logged. Add them in `on_after_batch_transfer`.",
            )
        work = tuple(step_table.as_float(batch.get(k)) for k in _WORK_KEYS)
        # sum S_i^2, for the cost refit: a pack says it; a bucketed batch is B samples of S tokens.
        square = (
            step_table.as_float(batch.get("token_sq_sum"))
            if "token_sq_sum" in batch
            else work[2] * work[3] ** 2
        )
        return (*work, square)

    def _should_log(self, trainer: pl.Trainer) -> bool:
        return _lightning_compat.is_logging_step(trainer)

    # ------------------------------------------------------------------ gather and statistics

    def _flush(self, trainer: pl.Trainer, pl_module: pl.LightningModule, log: bool) -> None:
        pending, self._pending = self._pending, []
        self._clock.wait(pending[-1].end)  # the one host synchronisation per flush (no-op on CPU)
        self._gathered_through = int(pending[-1].batch_idx)
        block: list[float] = [float(len(pending)), self._peak, self._device_total]
        for p in pending:
            block.extend(p.resolve(self._clock))
        gathered = _dist.all_gather_floats(block)
        self._num_collectives += 1
        steps = step_table.split_blocks(gathered)  # (K, world, F)
        if self._peaks_flops is None:
            self._peaks_flops = np.array([g[1] for g in gathered], dtype=np.float64)
            self._totals = np.array([g[2] for g in gathered], dtype=np.float64)
        peaks = steps[:, :, step_table.FIELD_INDEX["peak_allocated_bytes"]]
        if not np.isnan(peaks).all():
            self._high_water = max(self._high_water, float(np.nanmax(peaks)))
        table = step_table.step_table(
            steps, self._peaks_flops, self._totals, self._max_tokens, self._sequence_degree
        )
        for listener in self._listeners:
            listener(steps, table)
        if self._rank == 0:
            self._record(steps, table)
        if log:
            metrics = step_table.window_metrics(steps, table, self._peaks_flops, self._high_water)
            if metrics:
                pl_module.log_dict(
                    {self.prefix + k: v for k, v in metrics.items()},
                    on_step=True,
                    on_epoch=False,
                    batch_size=1,
                )

    def _record(self, steps: np.ndarray, table: dict[str, np.ndarray]) -> None:
        """Rank 0 keeps the per-step table and, for the plots, per-rank compute time and peak memory."""
        self._tables.append(table)
        self._compile_steps += step_table.compiled_steps(steps)
        self._rank_compute.append(step_table.rank_band(steps, "compute_time_s"))
        self._rank_peak.append(step_table.rank_band(steps, "peak_allocated_bytes"))
        if self._ranks_csv is not None:
            self._files.write(self._ranks_csv, report.append_rank_rows, self._ranks_csv, steps)

    # ------------------------------------------------------------------ end of fit (rank 0)

    def _summarize(self) -> dict[str, Any]:
        table = step_table.history(self._tables)
        world = self._world
        peaks_flops = self._peaks_flops if self._peaks_flops is not None else np.full(world, self._peak)
        totals = self._totals if self._totals is not None else np.full(world, self._device_total)
        n = len(table.get("step", ()))
        described, overall = step_table.summarize_table(
            table, world, peaks_flops, self._rank_peak, self._high_water
        )
        return {
            "meta": {
                "world_size": world,
                "sequence_parallel": self._sequence_degree,
                "device": self._device_name,
                "device_total_bytes": totals.tolist(),
                "peak_flops_per_device": peaks_flops.tolist(),
                "peak_flops_dtype": self._dtype_key,
                "timing_method": self._timing_method,
                "flops_source": self._flops.source if self._flops is not None else None,
                "num_steps": n,
                "steps_with_flop_counting": int(table["counted"].sum()) if n else 0,
                "steps_compiling": self._compile_steps,
                "compiles_rank0": list(self._compiling.log),
                "num_collectives": self._num_collectives,
                "norm_modulate_path": _norm_modulate_path(),
                "written": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            },
            "overall": overall,
            "table": described,
            "rows": step_table.step_rows(table),
            "epoch_ends": step_table.epoch_ends(table),
        }

    def _files_line(self) -> str:
        """Where this fit's files are, for the summary's last line: the folder and the names written (a file that
        could not be written said so), or why none is."""
        if self._no_files_because:
            return self._no_files_because
        if self._outdir is None:
            return ""
        names = [os.path.basename(p) for p in self._files.written if "*" not in p and os.path.exists(p)]
        if self._plots_written:
            names.append(f"{len(self._plots_written)} PNG plots (load_balance_*.png)")
        for f in sorted(_listdir(self._outdir)):  # the closed loop's and the stall watchdog's, of this fit
            if f == "cost_refit.jsonl" or (f.startswith("stall_stacks_rank") and f.endswith(".txt")):
                if _mtime(os.path.join(self._outdir, f)) >= self._started_at - 1 and f not in names:
                    names.append(f)
        line = f"{os.path.abspath(self._outdir)}: {', '.join(names) or 'none written'}"
        if self._files.failed:
            failed = "; ".join(f"{os.path.basename(p)} ({e})" for p, e in self._files.failed.items())
            line += f"; not written: {failed}"
        return line

    def _format_summary(self) -> str:
        return report.format_summary(self.summary)

    def _write_plots(self) -> None:
        assert self._outdir is not None
        totals = self._totals if self._totals is not None else np.full(self._world, self._device_total)
        self._plots_written = report.write_monitor_plots(
            self._outdir,
            step_table.history(self._tables),
            np.concatenate(self._rank_compute),
            np.concatenate(self._rank_peak),
            totals,
            banded=self._world > step_table.MAX_PLOTTED_RANKS,
        )


# ---------------------------------------------------------------------- module helpers


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0


def _norm_modulate_path() -> str:
    """How the fused LayerNorm-Modulate op ran on this rank (``"not called"`` when the model never imported it)."""
    # Only where the model imported the op: importing it here would load (or build) the CUDA kernels.
    ops = sys.modules.get("lightning_adaptiveload.ops")
    return ops.fused_op_paths() if ops is not None else "not called"


def _warn_user(message: str) -> None:
    """A UserWarning on rank 0 (a module function: the callback is pickled under ``ddp_spawn``)."""
    rank_zero_warn(message, category=UserWarning)
