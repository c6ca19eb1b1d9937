"""Clocks of the LoadBalanceMonitor: a rank's own compute time, apart from its wait for the others.

Owns the host and CUDA clocks (a *mark* is a reading; CUDA events are resolved at the flush, so a step costs
no host synchronisation), the DDP communication hook that marks the moment a rank's last gradient bucket is
ready (before the all-reduce waits for slower ranks), and the resolution of one step's marks into the
record of :data:`lightning_adaptiveload.monitor.steps.FIELDS`. Torch only, no Lightning.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostClock", "CudaClock", "BucketTimer", "timed_allreduce_hook", "PendingStep", "dynamo_frames"]


class HostClock:
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


class CudaClock:
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


class BucketTimer:
    """State of the DDP communication hook: the time the last gradient bucket of the step became ready."""

    def __init__(self, clock: HostClock | CudaClock, process_group: Any) -> None:
        self.clock = clock
        self.process_group = process_group
        self.active = False
        self.mark: Any = None
        self.buckets = 0

    def start_step(self) -> None:
        self.mark = self.clock.new_bucket_mark()
        self.buckets = 0
        self.active = True


def timed_allreduce_hook(state: BucketTimer, bucket):
    """DDP communication hook: mark the bucket's readiness, then the default all-reduce."""
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
class PendingStep:
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

    def resolve(self, clock: HostClock | CudaClock) -> list[float]:
        """The step's record, in the order of :data:`lightning_adaptiveload.monitor.steps.FIELDS`."""
        step_time = clock.seconds(self.start, self.end)
        if hasattr(self.bucket, "compute_seconds"):  # FSDP2: the backward's end less the all-gather waits
            compute = self.bucket.compute_seconds(clock, self.start)
        elif self.bucket is not None:
            compute = clock.seconds(self.start, self.bucket)
        else:
            compute = step_time
        if self.prev_end is not None:
            iter_time = clock.seconds(self.prev_end, self.end)
            data_time = clock.seconds(self.prev_end, self.start)
        else:
            iter_time, data_time = step_time, math.nan
        return [
            float(self.batch_idx),
            float(self.step),
            *self.work,
            self.flops,
            compute,
            step_time,
            iter_time,
            data_time,
            *self.memory,
            float(self.flags),
        ]


def dynamo_frames() -> int:
    """Frames torch.compile (dynamo) has compiled in this process so far; 0 when dynamo was never loaded."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    return int(sum(utils.counters["frames"].values()))
