"""The planned loader: a per-rank ``IterableDataset`` that streams its plan, and the DataLoader that plans it.

Pure PyTorch (no Lightning): :class:`PlannedShardDataset` plans an epoch (in the main process) and, in
each worker, streams that worker's batches (:func:`~lightning_adaptiveload.loading.stream.stream_batches`);
:class:`PlannedDataLoader` plans the epoch before its workers start and counts the batches it yields.
"""

from __future__ import annotations

import copy
import functools
import multiprocessing
import pickle
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_adaptiveload import _dist
from lightning_adaptiveload.loading.stream import stream_batches
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.inputs import distinct_shapes, index_fingerprint
from lightning_adaptiveload.planning.plan import EpochPlan
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.shards.protocol import ShardIndexLike

__all__ = [
    "PlanProgressBar",
    "PlannedDataLoader",
    "PlannedShardDataset",
    "check_picklable",
    "check_reload_every_epoch",
    "loader_context",
    "worker_start_method",
    "workers_context",
]

# Loaded in the fork server before it forks a worker, those the parent has loaded, so that a worker does not
# import them again when it imports the parent's main module (torch alone takes seconds).
_FORKSERVER_PRELOAD = (
    "torch",
    "lightning.pytorch",
    "lightning_adaptiveload.loading.loader",
    "lightning_adaptiveload.datamodule",
    "lightning_adaptiveload.cli",
)
_preload_set = False


def _identity(batch: Any) -> Any:
    return batch


def _checked_placement(placement: tuple[int, int]) -> tuple[int, int]:
    """``(rank, world size)``, or ValueError naming the bad one."""
    rank, world_size = placement
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"PlannedShardDataset: placement {placement!r}: world size must be an integer >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(
            f"PlannedShardDataset: placement {placement!r}: rank must be an integer in [0, {world_size})"
        )
    return rank, world_size


class PlannedShardDataset(IterableDataset):
    """The per-rank streaming dataset: yields the batches the plan gives this rank's worker streams.

    The plan is made in the main process by :meth:`begin_epoch` (the :class:`PlannedDataLoader` calls
    it in ``__iter__``, before it starts workers); ``__iter__`` then runs in each worker (or the main
    process with 0 workers) and streams that worker's reads.

    Args:
        index: the ``ShardIndex`` of the shards.
        batcher: batch sizes (its ``"auto"`` cap is resolved from the index here).
        settings: how each epoch is planned (:class:`~lightning_adaptiveload.planning.settings.PlanSettings`:
            schedule, lockstep tolerance and tail, buffer bound, ``underfull``, ``chunk_samples`` (part of
            the saved plan settings, so a resume re-plans alike), ``plan_processes``); None: the defaults.
        seed: shard-order seed.
        num_workers: DataLoader workers per rank the plan is made for.
        on_error: ``"raise"`` or ``"skip"`` for samples that fail when read (see ``iter_shard``).
        fixed_epoch: plan this epoch number every time (validation), or None.
        max_member_bytes: the largest shard member read (see ``iter_shard``); None: the default.
        sample_transform: ``f(sample) -> sample`` run on every decoded sample in the loader worker before
            collation (see :func:`apply_sample_transform`); None: none.
        text_pad_to: pad text to this many states in every batch (see :func:`~.collate.collate`).
        placement: ``(rank, world size)`` the plans are made for; fixed for the dataset's life
            (:meth:`on_ranks` gives the dataset of another placement). Under sequence parallelism the data
            rank and the number of groups (:func:`~lightning_adaptiveload.planning.groups.data_placement`):
            the loader (and each of its workers) of every rank of a group streams the group's batches.
    """

    def __init__(
        self,
        index: ShardIndexLike,
        batcher: DualConstraintBatcher,
        settings: PlanSettings | None = None,
        *,
        seed: int = 0,
        num_workers: int = 0,
        on_error: str = "raise",
        fixed_epoch: int | None = None,
        max_member_bytes: int | None = None,
        sample_transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        text_pad_to: int | None = None,
        placement: tuple[int, int] = (0, 1),
        remote: Any = None,
    ) -> None:
        super().__init__()
        self.remote = remote  # RemoteSettings of ranged reads (see stream_batches); None: the defaults
        self.settings = PlanSettings() if settings is None else settings
        self.max_member_bytes = max_member_bytes
        self.index = index
        self.batcher = batcher
        self.seed = int(seed)
        self.num_workers = int(num_workers)
        self.on_error = on_error
        self.fixed_epoch = fixed_epoch
        self.sample_transform = sample_transform
        self.text_pad_to = text_pad_to
        # Called with (segments planned, segments) while a chunked epoch is planned (the DataModule shows a
        # bar on rank 0); None: quiet.
        self.plan_progress: Callable[[int, int], None] | None = None
        self._rank, self._world_size = _checked_placement(placement)
        self.plan: EpochPlan | None = None
        self.epoch: int | None = None
        self.report: dict[str, Any] = {}
        self.fingerprint = index_fingerprint(index)
        batcher.resolve_max_compute(distinct_shapes(index))

    @property
    def rank(self) -> int:
        """The rank the plans are made for."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks the plans are made for."""
        return self._world_size

    def on_ranks(self, rank: int, world_size: int) -> PlannedShardDataset:
        """This dataset placed on ``rank`` of ``world_size``: itself where it is already so placed, else a
        new dataset with the same index, batcher and settings and no plan yet."""
        if (rank, world_size) == (self._rank, self._world_size):
            return self
        # A shallow copy: the index, batcher, settings, fingerprint and resolved cap do not depend on the
        # placement; only what was planned for the old one starts afresh.
        placed = copy.copy(self)
        placed._rank, placed._world_size = _checked_placement((rank, world_size))
        placed.plan, placed.epoch, placed.report = None, None, {}
        return placed

    @property
    def schedule(self) -> str:
        """The schedule of :attr:`settings`."""
        return self.settings.schedule

    @property
    def batches_yielded(self) -> int:
        """Batches of the current epoch's plan handed out so far by the loader's counting iterator (in the
        main process; 0 when the epoch begins): the resume position the DataModule saves."""
        return int(self.report.get("batches_yielded", 0))

    # -- planning (main process) -----------------------------------------------------------------------

    def plan_settings(self) -> dict[str, Any]:
        """What a fresh plan of an epoch depends on besides the index, as saved with resume state (a
        segment of :data:`~.resume.STATE_VERSION`'s layout, without its kind and counts)."""
        return {
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "seed": self.seed,
            "schedule": self.settings.schedule,
            "batcher": self.batcher.config(),
            "max_buffered_samples": self.settings.max_buffered_samples,
            "lockstep_tolerance": self.settings.lockstep_tolerance,
            "lockstep_tail": self.settings.lockstep_tail,
            "chunk_samples": self.settings.chunk_samples,
        }

    def make_plan(
        self,
        epoch: int,
        settings: Mapping[str, Any] | None = None,
        exclude: Any = None,
        local: bool = False,
        rank: int | None = None,
    ) -> EpochPlan:
        """Plan ``epoch`` with ``settings`` (a dict saved by :meth:`plan_settings`, read back by
        :meth:`PlanSettings.from_saved`; default: the current ones) leaving out ``exclude``; ``local``:
        only this rank's streams (what training needs); ``rank``: only that rank's streams (a resume's
        replay of another world size plans each old rank in turn)."""
        s = self.plan_settings() if settings is None else settings
        batcher = self.batcher if settings is None else DualConstraintBatcher.from_config(s["batcher"])
        plan = PlanSettings.from_saved(
            s,
            # The rest of a resumed epoch may hold fewer samples than ranks: pad it rather than fail.
            underfull="pad" if exclude else self.settings.underfull,
            plan_processes=self.settings.plan_processes,
        )
        return plan_epoch(
            self.index,
            s["world_size"],
            s["num_workers"],
            batcher,
            s["seed"],
            epoch,
            plan,
            exclude=exclude,
            rank=rank if rank is not None else (self.rank if local else None),
            progress=self.plan_progress,
        )

    def planned_for(self, epoch: int) -> bool:
        """Whether this dataset holds a plan of ``epoch`` made for its rank, world size and worker count."""
        plan = self.plan
        return (
            plan is not None
            and self.epoch == epoch
            and plan.world_size == self.world_size
            and max(1, plan.num_workers) == max(1, self.num_workers)
            and plan.rank in (None, self.rank)
        )

    def begin_epoch(self, epoch: int, plan: EpochPlan | None = None) -> EpochPlan:
        """Plan ``epoch`` (or take ``plan``) for this rank; must run before the workers start."""
        epoch = int(self.fixed_epoch if self.fixed_epoch is not None else epoch)
        if plan is None:
            if self.plan is not None and self.epoch == epoch and self.fixed_epoch is not None:
                return self.plan
            plan = self.make_plan(epoch, local=True)
        if plan.rank is not None and plan.rank != self.rank:
            raise ValueError(
                f"a plan of rank {plan.rank}'s streams was given to the loader of rank {self.rank}"
            )
        if plan.world_size != self.world_size or max(1, plan.num_workers) != max(1, self.num_workers):
            raise ValueError(
                f"plan for world size {plan.world_size} and {plan.num_workers} workers, but this loader runs "
                f"world size {self.world_size} with {self.num_workers} workers"
            )
        self.plan = plan
        self.epoch = epoch
        self.report = dict(plan.report)
        self.report.update(
            rank=self.rank,
            runtime_skipped={},
            runtime_ignored_members={},
            runtime_fetched={},
            batches_yielded=0,
        )
        return plan

    # -- streaming (worker) ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        plan = self.plan
        if plan is None:
            # Used without PlannedDataLoader: plan here (each worker computes the same plan).
            plan = self.begin_epoch(0 if self.epoch is None else self.epoch)
        info = get_worker_info()
        worker = info.id if info is not None else 0
        n_workers = info.num_workers if info is not None else 0
        if max(1, n_workers) != plan.workers_per_rank:
            raise RuntimeError(
                f"the epoch was planned for {plan.num_workers} DataLoader workers per rank but this loader has "
                f"{n_workers}; build the loader with num_workers={plan.num_workers} (the DataModule does)"
            )
        yield from self._stream(plan, (self.rank, worker))

    def _stream(self, plan: EpochPlan, stream: tuple[int, int]) -> Iterator[dict[str, Any]]:
        return stream_batches(
            plan,
            stream,
            self.index,
            self.batcher,
            on_error=self.on_error,
            max_member_bytes=self.max_member_bytes,
            sample_transform=self.sample_transform,
            text_pad_to=self.text_pad_to,
            remote=self.remote,
        )


class _CountingIterator:
    """Main-process wrapper of the DataLoader iterator: counts batches and runtime skips.

    The DataLoader's own iterator, and with it the workers and their read-ahead, starts at the first
    ``next()`` (or attribute asked of it), not at ``iter()``. Why: Lightning's fit loop calls ``iter()`` on
    a reloaded loader twice per epoch (``setup_data``, then the epoch loop's start) and advances only the
    second; started at once, the first one's workers read ahead (with ranged reads: fetched from the
    server) an epoch's worth of batches that nobody takes.
    """

    def __init__(
        self,
        start: Callable[[], Iterator[dict[str, Any]]],
        dataset: PlannedShardDataset,
        on_end: Callable[[], None] | None,
    ) -> None:
        self._start: Callable[[], Iterator[dict[str, Any]]] | None = start
        self._it: Iterator[dict[str, Any]] | None = None
        self._dataset = dataset
        self._on_end = on_end
        self.yielded = 0

    def __iter__(self) -> _CountingIterator:
        return self

    def _started(self) -> Iterator[dict[str, Any]]:
        if self._it is None:
            assert self._start is not None
            self._it, self._start = self._start(), None
        return self._it

    def __next__(self) -> dict[str, Any]:
        try:
            batch = next(self._started())
        except StopIteration:
            if self._on_end is not None:
                self._on_end()
            raise
        except (ConnectionError, EOFError) as err:
            # A worker that dies while a batch's shared memory is handed over breaks that transfer's
            # socket: say that a worker died rather than leave a bare reset.
            dead = [w for w in getattr(self._it, "_workers", ()) if not w.is_alive()]
            if not dead:
                raise
            raise RuntimeError(
                "DataLoader worker "
                + ", ".join(f"(pid {w.pid}, exit code {w.exitcode})" for w in dead)
                + f" exited unexpectedly while handing over a batch ({type(err).__name__}: {err}); "
                "a worker killed for memory (exit code -9) needs fewer samples in flight: lower the "
                "loader's prefetch_factor or the batch size"
            ) from err
        self.yielded += 1
        report = self._dataset.report
        report["batches_yielded"] = self.yielded
        for key, total in (
            ("skipped", "runtime_skipped"),
            ("ignored_members", "runtime_ignored_members"),
            ("fetched", "runtime_fetched"),  # ranged reads: bytes, requests, retries, cache hits
        ):
            counted = batch.get(key) if isinstance(batch, dict) else None
            if counted:
                runtime = report.setdefault(total, {})
                for reason, n in counted.items():
                    runtime[reason] = runtime.get(reason, 0) + int(n)
        return batch

    def switch_to(self, it: Iterator[dict[str, Any]]) -> None:
        """Continue from ``it`` (an iterator of a new plan of the rest of the epoch); the old iterator's
        workers are shut down and the batches they had read ahead are dropped. The count starts again."""
        old, self._it, self._start = self._it, it, None
        shutdown = getattr(old, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.yielded = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_it", "_start"):
            raise AttributeError(name)
        return getattr(self._started(), name)


def worker_start_method(start_method: str | None, num_workers: int) -> str | None:
    """How the loader's workers start: ``start_method`` if given; else ``"forkserver"`` under a gloo process
    group (CPU DDP), else None (the platform's default). None as well without workers.

    Why gloo: a gloo worker thread frees the tensors of a finished collective after waking the caller, and
    takes the GIL to do so, creating a Python thread state. On Python 3.11 a fork in that instant copies the
    interpreter's thread-list lock held, and the new worker blocks on it forever in ``os.fork`` (a CPU DDP
    test hung at an epoch start this way: ``docs/data_path.md``, "Loader workers"). A fork server forks from
    a process without such threads.
    """
    if num_workers == 0:
        return None
    if start_method is not None:
        if start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"Loader.start_method={start_method!r} is not available on this platform; it has "
                f"{', '.join(map(repr, multiprocessing.get_all_start_methods()))}"
            )
        return start_method
    if _dist.is_gloo() and "forkserver" in multiprocessing.get_all_start_methods():
        return "forkserver"
    return None


def workers_context(method: str | None, notify: Callable[[str], Any] | None = None) -> Any:
    """The ``multiprocessing`` context of :func:`worker_start_method`'s answer (None: DataLoader's default).

    A fork server is told to load torch, Lightning and this package's loader, data module and CLI (those the
    parent has loaded) before it forks, once per process; a worker then starts in about as long as a forked
    one. It never loads the parent's ``__main__``: a script's top level would run in the server. ``notify``
    (e.g. a rank-zero logger) hears once per process that workers start from a fork server.
    """
    global _preload_set
    if method is None:
        return None
    context = multiprocessing.get_context(method)
    if method == "forkserver" and not _preload_set:
        context.set_forkserver_preload([m for m in _FORKSERVER_PRELOAD if m in sys.modules])
        _preload_set = True
        if notify is not None:
            notify(
                "[adaptiveload] loader workers start from a fork server (Loader.start_method; under a gloo "
                "process group by default, where a fork beside gloo's threads can hang a worker)"
            )
    return context


def loader_context(
    start_method: str | None,
    num_workers: int,
    sample_transform: Any = None,
    notify: Callable[[str], Any] | None = None,
) -> Any:
    """What a :class:`PlannedDataLoader` takes as ``multiprocessing_context``: the start method chosen by
    :func:`worker_start_method`, ``sample_transform`` checked for it (:func:`check_picklable`), and its
    context (:func:`workers_context`)."""
    method = worker_start_method(start_method, num_workers)
    check_picklable(sample_transform, "sample_transform", method)
    return workers_context(method, notify)


def check_picklable(value: Any, name: str, method: str | None) -> None:
    """Workers not forked get the dataset pickled: refuse a value of it that cannot be, naming it.

    ``method`` None is the platform's default start method (fork on Linux, spawn on macOS and Windows).
    """
    if method is None:  # without fixing the default, as get_start_method() would
        method = (
            multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
        )
    if method == "fork" or value is None:
        return
    try:
        pickle.dumps(value)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the same refusal
        raise ValueError(
            f"{name} ({value!r}) cannot be pickled, and loader workers started by {method!r} receive it "
            f"pickled ({type(e).__name__}: {e}); pass a module-level function or a picklable object, or set "
            "Loader(start_method='fork')"
        ) from None


class PlannedDataLoader(DataLoader):
    """A DataLoader over a :class:`PlannedShardDataset` that plans each epoch before its workers start.

    ``__iter__`` asks ``epoch_fn`` for the epoch number (the trainer's current epoch in the DataModule),
    lets ``before_epoch`` plan it in the main process, then starts the workers, which inherit the plan.
    ``persistent_workers`` is refused: persistent workers keep the dataset copy of the first epoch and
    would never see a new plan.

    ``len(loader)`` is ``length_fn()`` when given (else the loader is unsized): the DataModule gives the
    step count of the epoch the trainer is about to run, planning that epoch early if need be (the plan is
    kept and iterated). Lightning reads a sized loader's length when it (re)loads the loader and ends
    every epoch after that many batches, while the step count is planned per epoch and differs slightly
    between epochs; a stale length would cut an epoch short or skip its validation. The DataModule
    therefore needs Lightning to reload its loaders every epoch (``reload_dataloaders_every_n_epochs=1``;
    a rebuilt loader costs nothing, its plan is made once either way), so the length is always the
    iterated epoch's own: the CLI sets it, and :func:`check_reload_every_epoch` refuses a trainer without
    it.

    ``sampler`` and ``batch_sampler`` are accepted only as None, so that Lightning can rebuild the loader
    (it does in the predict loop, to inject its own samplers, which an iterable dataset does not use).
    """

    def __init__(
        self,
        dataset: PlannedShardDataset,
        num_workers: int = 0,
        before_epoch: Callable[[], Any] | None = None,
        on_end: Callable[[], None] | None = None,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        multiprocessing_context: Any = None,
        length_fn: Callable[[], int] | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
    ) -> None:
        if sampler is not None or batch_sampler is not None:
            raise ValueError(
                "PlannedDataLoader takes no sampler or batch_sampler: the epoch plan orders and batches the "
                "samples; leave them None"
            )
        if persistent_workers:
            raise ValueError(
                "persistent_workers=True is not supported: each epoch is planned in the main process before the "
                "workers start, and persistent workers would keep the first epoch's plan; leave it False"
            )
        super().__init__(
            dataset,
            batch_size=None,
            num_workers=num_workers,
            collate_fn=_identity,
            pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            persistent_workers=False,
            multiprocessing_context=multiprocessing_context,
        )
        self._before_epoch = before_epoch
        self._on_end = on_end
        self._length_fn = length_fn
        self._live: Callable[[], _CountingIterator | None] = lambda: None  # weak: see restart

    def __len__(self) -> int:
        if self._length_fn is None:
            # An unsized loader, as a loader of an iterable dataset without a length is.
            raise TypeError("this PlannedDataLoader has no length (built without length_fn)")
        return int(self._length_fn())

    def __iter__(self) -> _CountingIterator:  # type: ignore[override]
        if self._before_epoch is not None:
            self._before_epoch()
        elif self.dataset.plan is None:  # type: ignore[attr-defined]
            self.dataset.begin_epoch(0)  # type: ignore[attr-defined]
        # No strong reference is kept: an abandoned iterator must be freed so that its workers shut down.
        it = _CountingIterator(functools.partial(DataLoader.__iter__, self), self.dataset, self._on_end)  # type: ignore[arg-type]
        self._live = weakref.ref(it)
        return it

    def restart(self) -> bool:
        """Make the running epoch's iterator continue with the dataset's current plan (a mid-epoch replan
        has replaced it, ``loading/replan.py``): its next batch is the new plan's first.

        With workers (``num_workers > 0``) the old workers hold the old plan and have read ahead: they are shut
        down, their read-ahead batches dropped (their samples are in the new plan), and new workers start
        with the new plan, as at an epoch start.

        Returns:
            False when no iterator of this loader is running (nothing to restart).
        """
        it = self._live()
        if it is None:
            return False
        it.switch_to(super().__iter__())
        return True


def check_reload_every_epoch(trainer: Any) -> None:
    """Refuse a trainer that would keep the first epoch's loader length for every epoch.

    A planned loader's length is its epoch's planned step count, which differs between epochs, and
    Lightning reads a loader's length only when it (re)loads the loader. The DataModule never changes the
    trainer's settings: the trainer must be built with ``reload_dataloaders_every_n_epochs=1`` (the
    ``lightning-adaptiveload`` CLI sets it). A run of one epoch (``max_epochs=1``) does not need it.

    Args:
        trainer: the Lightning ``Trainer`` (read only), or None (plain PyTorch use: nothing to check).

    Raises:
        ValueError: the trainer may run more than one epoch and reloads its loaders less often than every
            epoch; the message names the setting and the value to pass.
    """
    if trainer is None:
        return
    every = getattr(trainer, "reload_dataloaders_every_n_epochs", 1)
    if every == 1 or getattr(trainer, "max_epochs", None) == 1:
        return
    raise ValueError(
        f"AdaptiveLoadDataModule needs Trainer(reload_dataloaders_every_n_epochs=1), got "
        f"reload_dataloaders_every_n_epochs={every!r}: every training epoch is planned with its own step "
        "count, and Lightning reads a loader's length only when it reloads the loader, so a stale length would "
        "cut an epoch short or skip its validation. Build the trainer with "
        "Trainer(reload_dataloaders_every_n_epochs=1) (in a recipe: trainer.reload_dataloaders_every_n_epochs: "
        "1; the lightning-adaptiveload CLI sets it by default), or train for one epoch (max_epochs=1)"
    )


class PlanProgressBar:
    """A progress bar (rank 0) over the segments of a chunked epoch plan, opened at the first segment."""

    def __init__(self) -> None:
        self._bar: Any = None

    def __call__(self, done: int, total: int) -> None:
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc="[adaptiveload] planning the epoch", unit="segment")
        self._bar.update(done - self._bar.n)
        if done >= total:
            self._bar.close()
            self._bar = None
