"""``AdaptiveLoadDataModule``: planned, load-balanced streaming of WebDataset shards for Lightning.

Every epoch is planned from the shard index alone (:func:`~lightning_adaptiveload.planning.planner.plan_epoch`),
identically on every rank, in the main process when the epoch's DataLoader iterator is created (so
DataLoader workers, forked after it, inherit the plan). Each worker then streams only the shards its
stream needs (``iter_shard(select=...)``) and yields its planned batches in order. Every sample is yielded
exactly once per epoch across all ranks and workers, and every rank yields the same number of batches.

Resume: :meth:`AdaptiveLoadDataModule.state_dict` records the epoch's plan settings and how many batches
every rank consumed (the fit loop's processed-batch count, gathered from all ranks); after
:meth:`~AdaptiveLoadDataModule.load_state_dict` the epoch continues with the batches not consumed, with
the same or another number of workers (and, re-planning the remaining samples, another world size).
See ``docs/data_path.md`` and ``docs/reliability.md``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_adaptiveload import _dist
from lightning_adaptiveload.data.shards import MEMBER_REASONS
from lightning_adaptiveload.planning.batching import DualConstraintBatcher, collate, tokens_per_sample
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.packed_collate import collate_packed
from lightning_adaptiveload.planning.planner import (
    SCHEDULES,
    EpochPlan,
    consumed_refs,
    continue_plan,
    index_fingerprint,
    plan_epoch,
)

__all__ = ["AdaptiveLoadDataModule", "PlannedShardDataset", "PlannedDataLoader", "apply_sample_transform"]

log = logging.getLogger(__name__)

_STATE_VERSION = 1
# iter_shard's counts of members ignored or refused (not samples skipped).
_NOT_SKIPS = MEMBER_REASONS


def _identity(batch: Any) -> Any:
    return batch


def _empty_batch(
    shape: Sequence[int], seq_len: int, cost_model: CostModel, global_tokens: int
) -> dict[str, Any]:
    """A batch of 0 samples of ``shape``: every planned member was skipped at read time (on_error='skip')."""
    return {
        "latents": torch.zeros((0, *shape), dtype=torch.float32),
        "text": None,
        "text_mask": None,
        "keys": [],
        "meta": [],
        "seq_len": int(seq_len),
        "batch_size": 0,
        "num_tokens": 0,
        "cost": 0.0 * cost_model.cost(seq_len),
        "global_tokens": int(global_tokens),
    }


_SYNTHETIC_EXTRA = ("val_num_samples",)
# write_synthetic_shards arguments the DataModule sets itself.
_SYNTHETIC_FIXED = ("directory", "progress")


def _check_synthetic(synthetic: Mapping[str, Any]) -> dict[str, Any]:
    """The ``synthetic`` settings, with unknown keys refused now (not when ``prepare_data`` runs)."""
    import difflib
    import inspect

    from lightning_adaptiveload.data.shards import write_synthetic_shards

    params = inspect.signature(write_synthetic_shards).parameters
    valid = [n for n in params if n not in _SYNTHETIC_FIXED] + list(_SYNTHETIC_EXTRA)
    for key in synthetic:
        if key not in valid:
            near = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(
                f"data.synthetic has no setting {key!r}: {hint}valid keys are {', '.join(valid)}"
            )
    return dict(synthetic)


def _check_oversize(index: Any, batcher: DualConstraintBatcher) -> None:
    """Raise the batcher's oversize error for the first sample over ``max_tokens`` (``oversize="raise"``)."""
    if batcher.oversize != "raise":
        return
    fits: set[tuple[int, ...]] = set()
    for shard in index.shards:
        for key, shape in zip(shard.keys, shard.latent_shapes):
            if tuple(shape) in fits:
                continue
            s = tokens_per_sample(shape, batcher.patch_size)
            if s <= batcher.max_tokens:
                fits.add(tuple(shape))
            else:
                raise ValueError(
                    batcher._oversize_message(shape, s, where=f"shard {shard.path}, key {key!r}: ")
                )


def _index_folder(shards: str | list[str]) -> str | None:
    """The one local folder holding these shards, or None (URLs, several folders, index.json given)."""
    from lightning_adaptiveload.data.shards import expand_paths

    if isinstance(shards, str) and shards.endswith(".json"):
        return None
    try:
        paths = expand_paths(shards)
    except FileNotFoundError:
        return None
    folders = {os.path.dirname(p) for p in paths}
    if len(folders) != 1 or any("://" in p or p.startswith("pipe:") for p in paths):
        return None
    return folders.pop()


def apply_sample_transform(
    transform: Callable[[dict[str, Any]], dict[str, Any]],
    sample: Mapping[str, Any],
    patch_size: Sequence[int] = (1, 2, 2),
) -> dict[str, Any]:
    """Run a user's per-sample transform and check that it kept the planned shape.

    The plan fixed every batch's latent shape and token count from the index before any sample was read,
    so a transform may change values (flip, crop-and-resize back, drop the caption) but not the latent's
    shape.

    Args:
        transform: ``f(sample) -> sample``; it gets ``{"__key__": str, "latent": Tensor (C, T, H, W),
            "text": Tensor (L, D) | None, "meta": dict | None}`` (a copy of the dict; the tensors are the
            sample's own, so clone before changing them in place) and returns a dict of the same form. The
            text may change length (e.g. ``None`` for caption dropout).
        sample: a decoded sample (``iter_shard``'s dict).
        patch_size: (pt, ph, pw), for the token count named in the error.

    Returns:
        The transformed sample, with the reader's bookkeeping keys kept.

    Raises:
        ValueError: the transform returned no dict, or a latent of another shape (names the key).
    """
    from lightning_adaptiveload.planning.batching import _sample_fields, tokens_per_sample

    key, latent, text, meta, ref = _sample_fields(sample)
    out = transform({"__key__": key, "latent": latent, "text": text, "meta": meta})
    name = getattr(transform, "__qualname__", type(transform).__name__)
    if not isinstance(out, Mapping) or "latent" not in out:
        raise ValueError(
            f"sample_transform {name} returned {type(out).__name__} for sample {key!r}; it must return the "
            "sample dict with 'latent' (and 'text', 'meta') set"
        )
    new = out["latent"]
    if not torch.is_tensor(new) or tuple(new.shape) != tuple(latent.shape):
        shape = list(new.shape) if hasattr(new, "shape") else type(new).__name__
        before = tokens_per_sample(tuple(latent.shape), patch_size)
        raise ValueError(
            f"sample_transform {name} changed sample {key!r}'s latent from {list(latent.shape)} "
            f"({before} tokens) to {shape}; the batch plan fixed the shape from the index: keep the latent's "
            "shape (crop and resize back, or write shards of the new size and re-index)"
        )
    result = dict(out)
    result["__key__"] = key
    if ref is not None:
        result["__ref__"] = ref
    return result


class PlannedShardDataset(IterableDataset):
    """The per-rank streaming dataset: yields the batches the plan gives this rank's worker streams.

    The plan is made in the main process by :meth:`begin_epoch` (the :class:`PlannedDataLoader` calls
    it in ``__iter__``, before it starts workers); ``__iter__`` then runs in each worker (or the main
    process with 0 workers) and streams that worker's reads.

    Args:
        index: the ``ShardIndex`` of the shards.
        batcher: batch sizes (its ``"auto"`` cap is resolved from the index here).
        schedule: ``"independent"``, ``"lockstep"`` or ``"packed"`` (batches of the packed contract).
        seed: shard-order seed.
        num_workers: DataLoader workers per rank the plan is made for.
        on_error: ``"raise"`` or ``"skip"`` for samples that fail when read (see ``iter_shard``).
        max_buffered_samples: see :func:`plan_epoch`.
        lockstep_tolerance: see :func:`plan_epoch`.
        fixed_epoch: plan this epoch number every time (validation), or None.
        max_member_bytes: the largest shard member read (see ``iter_shard``); None: the default.
        underfull: ``"error"`` or ``"pad"``: when some rank can get no sample (see :func:`plan_epoch`).
        sample_transform: ``f(sample) -> sample`` run on every decoded sample in the loader worker before
            collation (see :func:`apply_sample_transform`); None: none.
        text_pad_to: pad text to this many states in every batch (see :func:`~.batching.collate`).
    """

    def __init__(
        self,
        index: Any,
        batcher: DualConstraintBatcher,
        schedule: str = "independent",
        seed: int = 0,
        num_workers: int = 0,
        on_error: str = "raise",
        max_buffered_samples: int | None = None,
        lockstep_tolerance: float = 0.05,
        fixed_epoch: int | None = None,
        max_member_bytes: int | None = None,
        underfull: str = "error",
        sample_transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        text_pad_to: int | None = None,
    ) -> None:
        super().__init__()
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.max_member_bytes = max_member_bytes
        self.index = index
        self.batcher = batcher
        self.schedule = schedule
        self.seed = int(seed)
        self.num_workers = int(num_workers)
        self.on_error = on_error
        self.max_buffered_samples = max_buffered_samples
        self.lockstep_tolerance = float(lockstep_tolerance)
        self.fixed_epoch = fixed_epoch
        self.underfull = underfull
        self.sample_transform = sample_transform
        self.text_pad_to = text_pad_to
        self.rank, self.world_size = 0, 1
        self.plan: EpochPlan | None = None
        self.epoch: int | None = None
        self.report: dict[str, Any] = {}
        self.fingerprint = index_fingerprint(index)
        batcher.resolve_max_compute(s for shard in index.shards for s in shard.latent_shapes)

    # -- planning (main process) -----------------------------------------------------------------------

    def plan_settings(self) -> dict[str, Any]:
        """What a fresh plan of an epoch depends on besides the index (saved with resume state)."""
        return {
            "world_size": self.world_size,
            "num_workers": self.num_workers,
            "seed": self.seed,
            "mode": self.schedule,
            "batcher": self.batcher.config(),
            "max_buffered_samples": self.max_buffered_samples,
            "lockstep_tolerance": self.lockstep_tolerance,
        }

    def make_plan(
        self, epoch: int, settings: Mapping[str, Any] | None = None, exclude: Any = None
    ) -> EpochPlan:
        """Plan ``epoch`` with ``settings`` (default: the current ones) leaving out ``exclude``."""
        s = dict(self.plan_settings() if settings is None else settings)
        batcher = self.batcher if settings is None else DualConstraintBatcher.from_config(s["batcher"])
        return plan_epoch(
            self.index,
            s["world_size"],
            s["num_workers"],
            batcher,
            s["seed"],
            epoch,
            mode=s["mode"],
            exclude=exclude,
            max_buffered_samples=s["max_buffered_samples"],
            lockstep_tolerance=s["lockstep_tolerance"],
            # The rest of a resumed epoch may hold fewer samples than ranks: pad it rather than fail.
            underfull="pad" if exclude else self.underfull,
        )

    def begin_epoch(self, epoch: int, plan: EpochPlan | None = None) -> EpochPlan:
        """Plan ``epoch`` (or take ``plan``) for this rank; must run before the workers start."""
        epoch = int(self.fixed_epoch if self.fixed_epoch is not None else epoch)
        if plan is None:
            if self.plan is not None and self.epoch == epoch and self.fixed_epoch is not None:
                return self.plan
            plan = self.make_plan(epoch)
        if plan.world_size != self.world_size or max(1, plan.num_workers) != max(1, self.num_workers):
            raise ValueError(
                f"plan for world size {plan.world_size} and {plan.num_workers} workers, but this loader runs "
                f"world size {self.world_size} with {self.num_workers} workers"
            )
        self.plan = plan
        self.epoch = epoch
        self.report = dict(plan.report)
        self.report.update(rank=self.rank, runtime_skipped={}, runtime_ignored_members={}, batches_yielded=0)
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
        from lightning_adaptiveload.data.shards import iter_shard

        batches = plan.streams[stream]
        buckets = plan.batch_buckets[stream]
        steps = plan.batch_steps[stream]
        reads = plan.reads[stream]
        read_of: dict[tuple[int, int], int] = {}
        left: list[int] = []
        for k, (shard, ids) in enumerate(reads):
            for i in ids:
                read_of[(shard, i)] = k
            left.append(len(ids))
        open_reads: dict[int, Iterator[dict[str, Any]]] = {}
        got: dict[tuple[int, int], dict[str, Any]] = {}
        missing: set[tuple[int, int]] = set()
        pulled: set[tuple[int, int]] = set()
        stats: dict[str, int] = {}
        seen: dict[str, int] = {}
        lost = reported_missing = 0
        patch = self.batcher.patch_size

        def close(k: int) -> None:
            it = open_reads.pop(k, None)
            if it is not None:
                it.close()  # type: ignore[attr-defined]

        def ensure(ref: tuple[int, int]) -> None:
            if ref in got or ref in missing:
                return
            k = read_of[ref]
            it = open_reads.get(k)
            if it is None:
                shard, ids = reads[k]
                it = open_reads[k] = iter_shard(
                    self.index.shards[shard],
                    shard_id=shard,
                    select=ids,
                    on_error=self.on_error,
                    stats=stats,
                    patch_size=patch,
                    max_member_bytes=self.max_member_bytes,
                )
            for sample in it:
                r2 = (int(sample["__ref__"][0]), int(sample["__ref__"][1]))
                got[r2] = sample
                pulled.add(r2)
                left[k] -= 1
                if r2 == ref or r2[1] > ref[1]:
                    if r2 != ref:  # file order passed it: the reader skipped it (counted in stats)
                        missing.add(ref)
                    if left[k] == 0:
                        close(k)
                    return
            close(k)
            shard = reads[k][0]
            missing.update((shard, i) for i in reads[k][1] if (shard, i) not in pulled)

        try:
            for j, refs in enumerate(batches):
                for ref in refs:
                    ensure(ref)
                members = [got.pop(ref) for ref in refs if ref in got]
                if self.sample_transform is not None:
                    members = [apply_sample_transform(self.sample_transform, m, patch) for m in members]
                gone = len(refs) - len(members)
                step = steps[j]
                if members:
                    batch = (collate_packed if plan.mode == "packed" else collate)(
                        members,
                        patch,
                        self.batcher.cost_model,
                        plan.global_tokens[step],
                        text_pad_to=self.text_pad_to,
                    )
                else:
                    spec = plan.buckets[buckets[j]]
                    batch = _empty_batch(
                        spec["shape"], spec["seq_len"], self.batcher.cost_model, plan.global_tokens[step]
                    )
                delta = {r: n - seen.get(r, 0) for r, n in stats.items() if n != seen.get(r, 0)}
                seen = dict(stats)
                # A sample the reader did not deliver without counting a reason (e.g. a shard shorter than
                # its index): report it as "missing", once.
                lost += gone
                explained = sum(n for r, n in stats.items() if r not in _NOT_SKIPS)
                if lost > explained + reported_missing:
                    delta["missing"] = lost - explained - reported_missing
                    reported_missing = lost - explained
                batch["step"] = step
                batch["skipped"] = {r: n for r, n in delta.items() if r not in _NOT_SKIPS}
                batch["ignored_members"] = {r: n for r, n in delta.items() if r in _NOT_SKIPS}
                yield batch
        finally:
            for k in list(open_reads):
                close(k)


class _CountingIterator:
    """Main-process wrapper of the DataLoader iterator: counts batches and runtime skips."""

    def __init__(
        self, it: Iterator[dict[str, Any]], dataset: PlannedShardDataset, on_end: Callable[[], None] | None
    ) -> None:
        self._it = it
        self._dataset = dataset
        self._on_end = on_end
        self.yielded = 0

    def __iter__(self) -> _CountingIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        try:
            batch = next(self._it)
        except StopIteration:
            if self._on_end is not None:
                self._on_end()
            raise
        self.yielded += 1
        report = self._dataset.report
        report["batches_yielded"] = self.yielded
        for key, total in (("skipped", "runtime_skipped"), ("ignored_members", "runtime_ignored_members")):
            counted = batch.get(key) if isinstance(batch, dict) else None
            if counted:
                runtime = report.setdefault(total, {})
                for reason, n in counted.items():
                    runtime[reason] = runtime.get(reason, 0) + int(n)
        return batch

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_it":
            raise AttributeError(name)
        return getattr(self._it, name)


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
    therefore has Lightning reload its loaders every epoch (``reload_dataloaders_every_n_epochs=1``; a
    rebuilt loader costs nothing, its plan is made once either way), so the length is always the
    iterated epoch's own.

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
        # No reference is kept: an abandoned iterator must be freed so that its workers shut down.
        return _CountingIterator(super().__iter__(), self.dataset, self._on_end)  # type: ignore[arg-type]


_INDEX_FIELDS = ("shards", "samples", "fingerprint")


def _index_summary(index: Any) -> list[float]:
    """Shard count, sample count and the two 32-bit halves of the index fingerprint, exact as floats."""
    fp = index_fingerprint(index)
    samples = sum(len(s.keys) for s in index.shards)
    return [float(len(index.shards)), float(samples), float(int(fp[:8], 16)), float(int(fp[8:], 16))]


def _index_disagreement(names: Sequence[str], gathered: Sequence[Sequence[float]]) -> str | None:
    """What differs between the ranks' indexes, in words; None when every rank has the same.

    Args:
        names: the indexes compared (e.g. ``["train", "validation"]``).
        gathered: per rank, :func:`_index_summary` of each index in ``names`` order, concatenated.
    """
    lines = []
    for j, name in enumerate(names):
        rows = [tuple(g[4 * j : 4 * j + 4]) for g in gathered]
        if len(set(rows)) == 1:
            continue
        # Other counts imply another fingerprint; name the fingerprint alone only when the counts agree.
        differ = [f for f, k in zip(_INDEX_FIELDS, (0, 1)) if len({r[k] for r in rows}) > 1]
        differ = differ or ["fingerprint"]
        per_rank = "; ".join(
            f"rank {r}: {int(row[0])} shards, {int(row[1])} samples, fingerprint "
            f"{int(row[2]):08x}{int(row[3]):08x}"
            for r, row in enumerate(rows)
        )
        lines.append(f"the {name} index differs between ranks ({', '.join(differ)}): {per_rank}")
    return "\n".join(lines) or None


def _check_indexes_agree(loaded: list[tuple[str, Any, Any]]) -> None:
    """One all-gather of a few numbers per index: ranks that would plan different epochs fail here, each
    with the same message, instead of hanging at the first collective of the epoch."""
    local = [v for _, _, index in loaded for v in _index_summary(index)]
    message = _index_disagreement([name for name, _, _ in loaded], _dist.all_gather_floats(local))
    if message is not None:
        sources = "; ".join(f"{name} shards {shards!r}" for name, shards, _ in loaded)
        raise RuntimeError(
            f"{message}. Every rank must index the same samples ({sources}): check that the paths or URL "
            "patterns resolve to the same shards on every node (a shard written while the job started, a "
            "different mount), or build the index once (`lightning-adaptiveload index ...`) and give every "
            "rank the same index.json"
        )
def _fit_over(trainer: Any) -> bool:
    """Whether the fit loop will start no further training epoch (max_epochs, max_steps or a stop)."""
    max_epochs = trainer.max_epochs
    if max_epochs is not None and max_epochs >= 0 and int(trainer.current_epoch) >= max_epochs:
        return True
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return True
    return bool(trainer.should_stop)


class AdaptiveLoadDataModule(pl.LightningDataModule):
    """Load-balanced batches from WebDataset shards of VAE latents, planned per epoch from the index.

    Args:
        train_shards: shard paths, brace pattern (``data/shard-{000000..000099}.tar``), directory, or
            ``index.json``; or a list of these.
        val_shards: the same for validation, or None.
        max_tokens: token cap per batch (B * S); also the largest sample allowed.
        max_compute: compute cap per batch in the cost model's unit; ``"auto"`` or None: the cheapest
            full bucket's compute (see ``batching.py``); ignored with ``mode="equal_tokens"``.
        cost_model: a :class:`CostModel` dict (``{"kind": "quadratic", "alpha": ..., "beta": ...}`` or
            ``{"kind": "power", "p": 1.5}``); None: :meth:`CostModel.default`.
        mode: ``"dual"`` (token and compute caps) or ``"equal_tokens"`` (token cap only).
        schedule: ``"independent"`` (each rank batches its own samples) or ``"lockstep"`` (all ranks
            take the same bucket class and batch size at every step) or ``"packed"`` (one pack of samples of
            any shapes per rank and step, equal pack costs; batches of the packed contract, see
            ``docs/data_path.md``).
        patch_size: the model's (pt, ph, pw).
        num_workers: DataLoader workers per rank.
        seed: seeds the shard order of every epoch (with the epoch number).
        on_error: ``"raise"`` or ``"skip"`` for bad shards and samples (index build and reading).
        oversize: ``"raise"`` or ``"skip"`` for samples with more than ``max_tokens`` tokens.
        synthetic: generate shards in ``prepare_data`` when set: keyword arguments of
            ``write_synthetic_shards`` (e.g. ``{"mix": "tiny", "num_samples": 512, "samples_per_shard": 32}``),
            plus optional ``val_num_samples``; ``train_shards`` (and ``val_shards``) must then be directories.
        max_buffered_samples: samples a worker may hold decoded (independent mode); None: automatic.
        lockstep_tolerance: relative cost tolerance that groups buckets into one lockstep class.
        pin_memory: DataLoader ``pin_memory``.
        max_member_bytes: the largest shard member read, in bytes; a larger claim is refused
            (``member_too_large``) before anything is allocated. None: ``shards.MAX_MEMBER_BYTES`` (1 GiB).
        index_allow_schemes: URL schemes the shard paths in an ``index.json`` may name (e.g.
            ``["https"]``); by default an index names files in its own folder only, never ``pipe:``
            (a ``pipe:`` source is taken only from ``train_shards``/``val_shards`` themselves).
        index_allow_outside: let an ``index.json`` name local shards outside its folder.
        val_underfull: a validation set with fewer samples than ranks: ``"pad"`` (default) gives the ranks
            without a sample one empty batch (``batch_size == 0``, zero tokens), a zero-weight step that
            keeps the collectives in step and adds nothing to a token-weighted metric; ``"error"`` raises
            :class:`~lightning_adaptiveload.planning.planner.PlanError` when validation starts. See
            ``docs/data_path.md``.
        test_shards: shards for ``trainer.test`` (the same forms as ``train_shards``), or None.
        predict_shards: shards for ``trainer.predict``, or None. Test and predict data are planned like
            validation data (independent schedule, one fixed plan): every sample once across all ranks.
        sample_transform: ``f(sample) -> sample`` run on every sample in the loader workers before it is
            batched (augmentation, caption dropout); it must keep the latent's shape (checked: the plan
            fixed it). An import path in a YAML recipe. See :func:`apply_sample_transform`. Applies to
            training data only; evaluation data is read as stored.
        text_pad_to: pad every batch's text states to this length L (``text`` (B, L, D), ``text_mask``
            (B, L)), for models without a text mask or for one shape under ``torch.compile``; a longer text
            is an error naming the sample. None: pad to the batch's longest text.

    Attributes:
        epoch_report: the current training epoch's report (plan counts, runtime skips; see
            ``docs/data_path.md``).

    The batches are dicts (``docs/architecture.md``): latents (B, C, T, H, W), text (B, L, D) | None,
    text_mask, keys, meta, seq_len, batch_size, num_tokens, cost, global_tokens, plus ``step`` (the plan
    step within the epoch), ``skipped`` (samples of this batch that failed at read time, by reason) and
    ``ignored_members`` (members passed over while reading them, such as a refused pickle beside a good
    latent: counted apart, the sample itself was read).
    """

    def __init__(
        self,
        train_shards: str | list[str],
        val_shards: str | list[str] | None = None,
        max_tokens: int = 4096,
        max_compute: float | str | None = None,
        cost_model: dict[str, Any] | None = None,
        mode: str = "dual",
        schedule: str = "independent",
        patch_size: tuple[int, int, int] = (1, 2, 2),
        num_workers: int = 2,
        seed: int = 0,
        on_error: str = "raise",
        oversize: str = "raise",
        synthetic: dict[str, Any] | None = None,
        max_buffered_samples: int | None = None,
        lockstep_tolerance: float = 0.05,
        pin_memory: bool = False,
        max_member_bytes: int | None = None,
        index_allow_schemes: list[str] | None = None,
        index_allow_outside: bool = False,
        val_underfull: str = "pad",
        test_shards: str | list[str] | None = None,
        predict_shards: str | list[str] | None = None,
        sample_transform: Callable[[dict], dict] | None = None,
        text_pad_to: int | None = None,
    ) -> None:
        super().__init__()
        if val_underfull not in ("pad", "error"):
            raise ValueError(f"val_underfull must be 'pad' or 'error', got {val_underfull!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if sample_transform is not None and not callable(sample_transform):
            raise ValueError(f"sample_transform must be callable(sample) -> sample, got {sample_transform!r}")
        if text_pad_to is not None and int(text_pad_to) < 1:
            raise ValueError(f"text_pad_to must be a positive number of text states or None, got {text_pad_to!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if int(num_workers) < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters(ignore=["sample_transform"])
        self.train_shards = train_shards
        self.val_shards = val_shards
        self.test_shards = test_shards
        self.predict_shards = predict_shards
        self.sample_transform = sample_transform
        self.text_pad_to = None if text_pad_to is None else int(text_pad_to)
        self.num_workers = int(num_workers)
        self.seed = int(seed)
        self.schedule = schedule
        self.on_error = on_error
        self.synthetic = _check_synthetic(synthetic) if synthetic else None
        self.max_buffered_samples = max_buffered_samples
        self.lockstep_tolerance = float(lockstep_tolerance)
        self.pin_memory = bool(pin_memory)
        self.max_member_bytes = max_member_bytes
        # What a loaded index may name (ShardIndex.load); the shard lists given here are trusted as written.
        self._index_trust = {
            "allow_schemes": tuple(index_allow_schemes or ()),
            "allow_outside": bool(index_allow_outside),
            "max_member_bytes": max_member_bytes,
        }
        self.val_underfull = val_underfull
        self.patch_size = tuple(int(x) for x in patch_size)
        # Validates the batcher settings now, before any data is touched.
        self.batcher = DualConstraintBatcher(
            max_tokens=max_tokens,
            max_compute=max_compute,
            cost_model=cost_model,
            mode=mode,
            patch_size=self.patch_size,
            oversize=oversize,
        )
        self.train_index: Any = None
        self.val_index: Any = None
        self.train_dataset: PlannedShardDataset | None = None
        self.val_dataset: PlannedShardDataset | None = None
        self.test_dataset: PlannedShardDataset | None = None
        self.predict_dataset: PlannedShardDataset | None = None
        self._prepared_epoch: int | None = None  # the training epoch planned ahead of its iterator (by len)
        self._iterating = False  # a training epoch's iterator has started and not ended
        self._epoch_counter = -1
        self._segments: list[dict[str, Any]] = []  # the current epoch's plan segments (resume history)
        self._segment_base = 0  # batches consumed before the current segment, in the current epoch
        self._resume: dict[str, Any] | None = None
        self._train_loader: PlannedDataLoader | None = None
        if val_shards is None:
            # No validation data: no validation loader at all. Lightning runs a validation loop when
            # ``val_dataloader`` is overridden, and an empty one warns that its length is zero on every
            # run; the base class's hook on the instance reads as "not overridden".
            self.val_dataloader = pl.LightningDataModule.val_dataloader.__get__(self)  # type: ignore[method-assign]

    # -- data preparation ------------------------------------------------------------------------------

    def _synthetic_dir(self, shards: str | list[str]) -> str:
        if (
            not isinstance(shards, str)
            or any(ch in shards for ch in "{*?[")
            or shards.endswith((".tar", ".json"))
        ):
            raise ValueError(
                f"synthetic data needs the shard location as one directory, got {shards!r}; "
                "pass e.g. train_shards='data/train' (the shards and index.json are written there)"
            )
        return shards

    def prepare_data(self) -> None:
        """Generate synthetic shards when ``synthetic`` is set, and write ``index.json`` if missing.

        Runs on one process per node (Lightning). Reuses shards already written with the same settings.
        """
        from lightning_adaptiveload.data.shards import INDEX_NAME, ShardIndex, write_synthetic_shards

        if self.synthetic is not None:
            settings = dict(self.synthetic)
            val_n = settings.pop("val_num_samples", None)
            settings.setdefault("progress", False)
            write_synthetic_shards(self._synthetic_dir(self.train_shards), **settings)
            if self.val_shards is not None:
                n = int(val_n) if val_n is not None else max(8, int(settings.get("num_samples", 256)) // 8)
                val_settings = {**settings, "num_samples": n, "seed": int(settings.get("seed", 0)) + 1}
                if isinstance(val_settings.get("samples_per_shard"), list):
                    val_settings["samples_per_shard"] = max(1, n // 4)
                write_synthetic_shards(self._synthetic_dir(self.val_shards), **val_settings)
        stage = getattr(getattr(self.trainer, "state", None), "fn", None)
        extra = {"test": self.test_shards, "predict": self.predict_shards}
        # Test and predict data are indexed only for their own stage (they may not exist while training).
        # Unknown stage (no trainer yet, or the CLI's check before fit): training data only.
        wanted = [v for k, v in extra.items() if stage is not None and getattr(stage, "value", stage) == k]
        for shards in (self.train_shards, self.val_shards, *wanted):
            folder = _index_folder(shards) if shards is not None else None
            if folder is not None and not os.path.exists(os.path.join(folder, INDEX_NAME)):
                # One index pass here, so that the ranks load it in setup instead of each rebuilding it.
                ShardIndex.for_paths(
                    shards,
                    patch_size=self.patch_size,
                    on_error=self.on_error,
                    save=os.path.join(folder, INDEX_NAME),
                    **self._index_trust,
                )

    def setup(self, stage: str | None = None) -> None:
        """Load the indexes and build the datasets; rank and world size come from the trainer."""
        rank, world = _dist.rank_and_world(self.trainer)
        loaded: list[tuple[str, Any, Any]] = []  # (name, shards, index) of the indexes loaded now
        if self.train_index is None and stage in (None, "fit"):
            self.train_index = self._load_index(self.train_shards, rank)
            self.train_dataset = self._dataset(self.train_index, self.schedule)
            loaded.append(("train", self.train_shards, self.train_index))
        if self.val_shards is not None and self.val_index is None and stage in (None, "fit", "validate"):
            self.val_index = self._load_index(self.val_shards, rank)
            self.val_dataset = self._dataset(self.val_index, "independent", fixed_epoch=0)
            loaded.append(("validation", self.val_shards, self.val_index))
            self.val_dataset.underfull = self.val_underfull
        if self.test_shards is not None and self.test_dataset is None and stage in (None, "test"):
            index = self._load_index(self.test_shards, rank)
            self.test_dataset = self._dataset(index, "independent", fixed_epoch=0)
            self.test_dataset.underfull = self.val_underfull
            loaded.append(("test", self.test_shards, index))
        if self.predict_shards is not None and self.predict_dataset is None and stage in (None, "predict"):
            index = self._load_index(self.predict_shards, rank)
            self.predict_dataset = self._dataset(index, "independent", fixed_epoch=0)
            self.predict_dataset.underfull = self.val_underfull
            loaded.append(("predict", self.predict_shards, index))
        for ds in (self.train_dataset, self.val_dataset, self.test_dataset, self.predict_dataset):
            if ds is not None:
                ds.rank, ds.world_size = rank, world
        if loaded:
            _check_indexes_agree(loaded)
        trainer = self.trainer
        if stage in (None, "fit") and trainer is not None and trainer.reload_dataloaders_every_n_epochs != 1:
            # The loader's length is its epoch's planned step count, which differs between epochs: Lightning
            # must re-read it every epoch (see PlannedDataLoader).
            if trainer.max_epochs != 1:
                rank_zero_info(
                    "[adaptiveload] setting reload_dataloaders_every_n_epochs=1 (was "
                    f"{trainer.reload_dataloaders_every_n_epochs}): every epoch has its own planned length"
                )
            trainer.reload_dataloaders_every_n_epochs = 1

    def _load_index(self, shards: Any, rank: int) -> Any:
        from lightning_adaptiveload.data.shards import ShardIndex

        return ShardIndex.for_paths(
            shards, patch_size=self.patch_size, on_error=self.on_error, progress=rank == 0, **self._index_trust
        )

    def check_data(self) -> None:
        """Check the data before training starts, in the launching process (the CLI calls it before fit).

        Loads (or builds) the index of the training and validation shards and checks every sample
        against the batcher's caps: the same checks :meth:`setup` and the first epoch make, raised here
        before DDP starts its ranks, so that a missing shard or an oversize sample is the last error shown
        rather than buried under other ranks' connection errors. Changes no state of the module.

        Raises:
            ShardError: a shard is missing or bad (under ``on_error="raise"``).
            ValueError: a sample over ``max_tokens`` (under ``oversize="raise"``), or bad settings.
        """
        for shards in (self.train_shards, self.val_shards):
            if shards is not None:
                index = self._load_index(shards, rank=-1)
                batcher = DualConstraintBatcher.from_config(self.batcher.config())
                _check_oversize(index, batcher)
                batcher.resolve_max_compute(s for shard in index.shards for s in shard.latent_shapes)

    def _dataset(self, index: Any, schedule: str, fixed_epoch: int | None = None) -> PlannedShardDataset:
        # In setup, not when the epoch's iterator starts: an error raised there is masked by Lightning's
        # teardown (`Please call iter(combined_loader) first`).
        _check_oversize(index, self.batcher)
        training = fixed_epoch is None
        return PlannedShardDataset(
            index,
            self.batcher,
            schedule=schedule,
            seed=self.seed,
            num_workers=self.num_workers,
            on_error=self.on_error,
            max_buffered_samples=self.max_buffered_samples,
            lockstep_tolerance=self.lockstep_tolerance,
            fixed_epoch=fixed_epoch,
            max_member_bytes=self.max_member_bytes,
            sample_transform=self.sample_transform if training else None,
            text_pad_to=self.text_pad_to,
        )

    # -- loaders ---------------------------------------------------------------------------------------

    def train_dataloader(self) -> PlannedDataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        assert self.train_dataset is not None
        self._train_loader = PlannedDataLoader(
            self.train_dataset,
            num_workers=self.num_workers,
            before_epoch=self._begin_train_epoch,
            on_end=self._end_train_epoch,
            pin_memory=self.pin_memory,
            length_fn=self._train_epoch_steps,
        )
        return self._train_loader

    def val_dataloader(self) -> PlannedDataLoader | list:
        if self.val_shards is None:
            return []
        if self.val_dataset is None:
            self.setup("validate")
        assert self.val_dataset is not None
        return self._eval_loader(self.val_dataset)

    def test_dataloader(self) -> PlannedDataLoader | list:
        if self.test_shards is None:
            return []
        if self.test_dataset is None:
            self.setup("test")
        assert self.test_dataset is not None
        return self._eval_loader(self.test_dataset)

    def predict_dataloader(self) -> PlannedDataLoader | list:
        if self.predict_shards is None:
            return []
        if self.predict_dataset is None:
            self.setup("predict")
        assert self.predict_dataset is not None
        return self._eval_loader(self.predict_dataset)

    def _eval_loader(self, ds: PlannedShardDataset) -> PlannedDataLoader:
        """A loader of one fixed plan (epoch 0, independent schedule): every sample once across ranks."""
        return PlannedDataLoader(
            ds,
            num_workers=self.num_workers,
            before_epoch=lambda: ds.begin_epoch(0),
            pin_memory=self.pin_memory,
            length_fn=lambda: ds.begin_epoch(0).steps,
        )

    def _current_epoch(self, peek: bool = False) -> int:
        trainer = self.trainer
        if trainer is not None:
            return int(trainer.current_epoch)
        if peek:
            return self._epoch_counter + 1
        self._epoch_counter += 1
        return self._epoch_counter

    def _train_epoch_steps(self) -> int:
        """Steps of the training epoch about to run on this rank (whole epoch, a resumed one included).

        Plans the epoch now if its loader has not started yet; the loader then iterates that plan.
        """
        ds = self.train_dataset
        assert ds is not None
        trainer = self.trainer
        if trainer is not None:
            # After the last epoch Lightning still asks for the length (when it tears the loader down):
            # answer with the last plan instead of planning an epoch that will not run.
            running = ds.plan is not None and (ds.epoch == int(trainer.current_epoch) or _fit_over(trainer))
        else:  # no trainer: the epoch whose iterator has started and not ended
            running = self._iterating
        if self._prepared_epoch is None and not running:
            self._prepare_train_epoch()
        assert ds.plan is not None
        return self._segment_base + ds.plan.steps

    def _begin_train_epoch(self) -> None:
        trainer = self.trainer
        prepared, self._prepared_epoch = self._prepared_epoch, None
        self._iterating = True
        if prepared is not None and (trainer is None or prepared == int(trainer.current_epoch)):
            return  # planned ahead by len()
        self._prepare_train_epoch()
        self._prepared_epoch = None

    def _prepare_train_epoch(self) -> None:
        ds = self.train_dataset
        assert ds is not None
        rank, world = _dist.rank_and_world(self.trainer)
        ds.rank, ds.world_size = rank, world
        epoch = self._current_epoch()
        resume, self._resume = self._resume, None
        if resume is not None and int(resume["epoch"]) == epoch:
            plan = self._resume_plan(ds, resume)
            if plan.steps == 0:
                self._finish_restarted_epoch()
        else:
            if resume is not None:
                log.info(
                    "resume state is for epoch %s, training is at epoch %s: starting fresh",
                    resume["epoch"],
                    epoch,
                )
            plan = ds.make_plan(epoch)
            self._segments = [{"kind": "fresh", **ds.plan_settings(), "consumed": None}]
            self._segment_base = 0
        ds.begin_epoch(epoch, plan)
        self._prepared_epoch = epoch
        rep = ds.report
        if rank == 0:
            rank_zero_info(
                f"[adaptiveload] epoch {epoch}: {rep['samples']} samples, {rep['steps']} steps x {world} ranks, "
                f"{rep['batches']} batches, {rep['tokens']} tokens, padding 0, skipped {rep['skipped'] or 0}, "
                f"partial {rep['partial_batches']}, split {rep['split_batches']}, schedule {rep['mode']}, "
                f"mode {self.batcher.mode}"
                + (f", lockstep tail steps {rep['lockstep_tail_steps']}" if rep["mode"] == "lockstep" else "")
                + f", est. compute CV {rep['est_compute_cv']:.3f}, plan {rep['plan_seconds']:.2f}s"
            )

    def _finish_restarted_epoch(self) -> None:
        """The checkpoint was saved after the epoch's last batch: let Lightning end the epoch normally.

        Lightning restarts the checkpoint's epoch; with nothing left in it, its epoch loop would run no
        iteration, keep its "restarting" flag, and then not ask for the next epoch's iterator, silently
        training an empty epoch (Lightning 2.x, iterable loaders). Running the empty epoch as a fresh one
        avoids that; the fit loop's step counters are not touched.
        """
        trainer = self.trainer
        try:
            loop = trainer.fit_loop.epoch_loop  # type: ignore[union-attr]
            if loop.restarting:
                loop.restarting = False
        except AttributeError:  # no trainer, or another loop layout: nothing to fix
            pass

    def _end_train_epoch(self) -> None:
        self._iterating = False
        ds = self.train_dataset
        if ds is not None and ds.report.get("runtime_skipped"):
            log.warning(
                "rank %d, epoch %s: samples skipped while reading: %s",
                ds.rank,
                ds.epoch,
                ds.report["runtime_skipped"],
            )

    @property
    def epoch_report(self) -> dict[str, Any]:
        """The current (or last) training epoch's report; empty before the first epoch."""
        return dict(self.train_dataset.report) if self.train_dataset is not None else {}

    # -- resume ----------------------------------------------------------------------------------------

    def _consumed_now(self) -> int:
        """Batches of the current training epoch consumed on this rank (whole epoch, all segments)."""
        ds = self.train_dataset
        if ds is None or ds.plan is None:
            return 0
        total = self._segment_base + ds.plan.steps
        trainer = self.trainer
        if trainer is not None:
            try:
                if int(trainer.current_epoch) != ds.epoch:
                    return total
                done = int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)
            except AttributeError:
                done = None
            if done is not None:
                return max(self._segment_base, min(done, total))
        return self._segment_base + int(ds.report.get("batches_yielded", 0))

    def state_dict(self) -> dict[str, Any]:
        """The training epoch's position, for mid-epoch resume (gathers every rank's count: collective).

        Returns:
            ``{"version", "fingerprint", "epoch", "segments": [{"kind", "world_size", "num_workers",
            "seed", "mode", "batcher", "max_buffered_samples", "lockstep_tolerance", "consumed":
            [per rank]}]}``, or ``{}`` before the first training epoch. Every rank must call it (as
            ``Trainer.save_checkpoint`` does).
        """
        ds = self.train_dataset
        if ds is None or ds.plan is None or not self._segments:
            return {}
        mine = self._consumed_now() - self._segment_base
        if _dist.is_distributed() and ds.world_size > 1:
            consumed = [int(r[0]) for r in _dist.all_gather_floats([float(mine)])]
        else:
            consumed = [mine] * ds.world_size
        if len(set(consumed)) > 1:
            log.warning(
                "ranks consumed different numbers of batches this epoch (%s); resume re-plans the rest",
                consumed,
            )
        segments = [dict(s) for s in self._segments]
        segments[-1]["consumed"] = consumed
        return {
            "version": _STATE_VERSION,
            "fingerprint": ds.fingerprint,
            "epoch": ds.epoch,
            "segments": segments,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict`; applied when that epoch's loader starts."""
        if not state_dict:
            return
        if state_dict.get("version") != _STATE_VERSION:
            raise ValueError(
                f"AdaptiveLoadDataModule state version {state_dict.get('version')!r} is not supported "
                f"(expected {_STATE_VERSION}); resume without the datamodule state or from a newer checkpoint"
            )
        self._resume = dict(state_dict)

    def _resume_plan(self, ds: PlannedShardDataset, state: Mapping[str, Any]) -> EpochPlan:
        if state["fingerprint"] != ds.fingerprint:
            raise ValueError(
                "the checkpoint's data position belongs to other shards (index fingerprint "
                f"{state['fingerprint']} vs {ds.fingerprint} now): resume with the same shards, or drop the "
                "datamodule state from the checkpoint to start the epoch afresh"
            )
        epoch = int(state["epoch"])
        segments = [dict(s) for s in state["segments"]]
        # Replay the epoch's segments to find what was consumed and the last plan.
        plan: EpochPlan | None = None
        gone: set[tuple[int, int]] = set()
        previous = 0
        for seg in segments:
            if seg["kind"] == "continue" and plan is not None:
                plan = continue_plan(plan, previous, int(seg["num_workers"]))
            else:
                plan = ds.make_plan(epoch, seg, exclude=gone)
            consumed = [int(x) for x in seg["consumed"]]
            gone |= consumed_refs(plan, consumed)
            previous = consumed[0]
        assert plan is not None
        last = segments[-1]
        same_ranks = plan.world_size == ds.world_size and len(set(last["consumed"])) == 1
        if same_ranks:
            new_plan = continue_plan(plan, int(last["consumed"][0]), ds.num_workers)
            kind = "continue"
        else:
            new_plan = ds.make_plan(epoch, exclude=gone)
            kind = "replan"
        self._segments = segments + [{"kind": kind, **ds.plan_settings(), "consumed": None}]
        # Lightning restores its processed-batch count to the total consumed so far (equal on all ranks).
        self._segment_base = sum(max(int(x) for x in s["consumed"]) for s in segments)
        rank_zero_info(
            f"[adaptiveload] resuming epoch {epoch} after {len(gone)} consumed samples ({kind}: world size "
            f"{ds.world_size}, {ds.num_workers} workers, {new_plan.steps} steps left)"
        )
        return new_plan
