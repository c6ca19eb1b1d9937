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

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_adaptiveload import _dist
from lightning_adaptiveload._lightning_compat import end_exhausted_restart
from lightning_adaptiveload.loading.datamodule_inputs import (
    binary_index_of,
    check_oversize,
    check_synthetic,
    index_folder,
    write_synthetic_into,
)
from lightning_adaptiveload.loading.index_agreement import check_indexes_agree
from lightning_adaptiveload.loading.loader import (
    PlannedDataLoader,
    PlannedShardDataset,
    PlanProgressBar,
    check_reload_every_epoch,
    loader_context,
)
from lightning_adaptiveload.loading.replan import Replanned, replan_rest
from lightning_adaptiveload.loading.resume import ResumeStateError, position_state, read_state, resume_plan
from lightning_adaptiveload.loading.settings import DATAMODULE_DEFAULTS, DataModuleGroups, Loader, Source
from lightning_adaptiveload.loading.stream import apply_sample_transform
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.chunked import local_plan
from lightning_adaptiveload.planning.groups import data_placement, group_batching
from lightning_adaptiveload.planning.inputs import distinct_shapes
from lightning_adaptiveload.planning.plan import EpochPlan, batching_label
from lightning_adaptiveload.planning.schedules import SCHEDULE_TYPES
from lightning_adaptiveload.planning.settings import Batching, PlanSettings, Underfull

__all__ = [
    "AdaptiveLoadDataModule",
    "Batching",
    "Loader",
    "PlanSettings",
    "PlannedDataLoader",
    "PlannedShardDataset",
    "Source",
    "apply_sample_transform",
]

log = logging.getLogger(__name__)

_DEFAULTS = DATAMODULE_DEFAULTS


def _fit_over(trainer: Any) -> bool:
    """Whether the fit loop will start no further training epoch (max_epochs, max_steps or a stop)."""
    max_epochs = trainer.max_epochs
    if max_epochs is not None and max_epochs >= 0 and int(trainer.current_epoch) >= max_epochs:
        return True
    if trainer.max_steps is not None and trainer.max_steps >= 0 and trainer.global_step >= trainer.max_steps:
        return True
    return bool(trainer.should_stop)


class _only_with:  # noqa: N801 (a decorator)
    """A data-loader hook that exists only where its split has data: read on an instance whose ``shards``
    attribute is None, it is the base class's hook, which Lightning takes for "not overridden" (no
    validation loop, and no warning that an empty loader has length zero). Decided per instance when the
    hook is looked up; nothing is rebound on the instance."""

    def __init__(self, shards: str) -> None:
        self.shards = shards
        self.fn: Callable[..., Any] | None = None
        self.name = ""

    def __call__(self, fn: Callable[..., Any]) -> _only_with:
        self.fn, self.name = fn, fn.__name__
        self.__doc__ = fn.__doc__
        return self

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self.fn
        if getattr(instance, self.shards, None) is None:
            return getattr(pl.LightningDataModule, self.name).__get__(instance, owner)
        return self.fn.__get__(instance, owner)


class AdaptiveLoadDataModule(pl.LightningDataModule):
    """Load-balanced batches from WebDataset shards of VAE latents, planned per epoch from the index.

    Args:
        train_shards: shard paths, brace pattern (``data/shard-{000000..000099}.tar``), directory, or
            ``index.json``; or a list of these.
        val_shards: the same for validation, or None.
        batching: how batches are sized: :class:`~lightning_adaptiveload.planning.settings.Batching`
            (``max_tokens``, ``max_compute``, ``cost_model``, ``sizing``, ``patch_size``, ``oversize``).
        plan: how every training epoch is planned:
            :class:`~lightning_adaptiveload.planning.settings.PlanSettings` (``schedule``, ``lockstep_tail``,
            ``lockstep_tolerance``, ``max_buffered_samples``, ``chunk_samples``, ``plan_processes``; its
            ``underfull`` is the training split's). Default (also of a recipe's ``plan:`` keys):
            ``PlanSettings(chunk_samples=500_000)``.
            ``schedule``: ``"independent"`` (each rank batches its own samples), ``"lockstep"`` (all ranks
            take the same bucket class and batch size at every step), ``"packed"`` (each rank takes one pack
            of samples of any shapes per step, the packs of a step of equal cost; the module must run packs,
            ``runs_packed_batches = True``), or ``"auto"`` (the epoch line says which and why). Which to use:
            ``docs/schedules.md``. ``lockstep_tail="packed"`` needs a module that runs packs; any other gets
            ``"bucketed"`` with a warning, so that it never receives a pack. ``chunk_samples``: a training
            epoch of more samples is planned in segments of about this many (``docs/data_path.md``,
            "Internet-scale epochs"). ``sequence_parallel`` G > 1 (Ulysses, with a strategy of that degree:
            ``SequenceParallelStrategy``): every split is planned for the ``world_size / G`` groups of G
            consecutive ranks, every rank of a group gets the group's batches (the same samples and order),
            and a group's batch takes G times ``batching.max_tokens`` (one GPU's), costed for one GPU of the
            group with the all-to-all (``sequence_comm``; :mod:`~lightning_adaptiveload.planning.groups`).
            Packs cannot be split over a group: ``schedule="packed"`` is refused then (:meth:`check_module`)
            and lockstep's tail is bucketed.
        loader: how each rank loads its batches: :class:`~lightning_adaptiveload.loading.settings.Loader`
            (``num_workers``, ``pin_memory``, ``seed``, ``text_pad_to``, ``start_method``).
        source: how shards are read and what an index may name:
            :class:`~lightning_adaptiveload.loading.settings.Source` (``on_error``, ``max_member_bytes``,
            ``index_allow_schemes``, ``index_allow_outside``).
        synthetic: generate shards in ``prepare_data`` when set: keyword arguments of
            ``write_synthetic_shards`` (e.g. ``{"mix": "tiny", "num_samples": 512, "samples_per_shard": 32}``),
            plus optional ``val_num_samples``; ``train_shards`` (and ``val_shards``) must then be directories.
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

    Raises:
        ValueError: a bad setting, from the settings class that holds it (each is checked in one place).
        TypeError: a settings group of another type, or a group's dict with a key that is no field of it.

    Example:
        >>> dm = AdaptiveLoadDataModule(  # doctest: +SKIP
        ...     "data/train",
        ...     batching=Batching(max_tokens=65520, sizing="dual"),
        ...     plan=PlanSettings(schedule="lockstep", chunk_samples=500_000),
        ...     loader=Loader(num_workers=4),
        ... )

    Attributes:
        epoch_report: the current training epoch's report (plan counts, runtime skips; see
            ``docs/data_path.md``).
        batching, loader, source: the settings groups in use (given, or the defaults).
        plan_settings: the training split's :class:`~lightning_adaptiveload.planning.settings.PlanSettings`
            (the ``plan`` argument).
        eval_plan_settings: the validation, test and predict splits' (one fixed independent plan, planned
            at once, ``underfull=val_underfull``).

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
        *,
        batching: Batching = _DEFAULTS.batching,
        plan: PlanSettings = _DEFAULTS.plan,
        loader: Loader = _DEFAULTS.loader,
        source: Source = _DEFAULTS.source,
        synthetic: dict[str, Any] | None = None,
        val_underfull: Underfull = "pad",
        test_shards: str | list[str] | None = None,
        predict_shards: str | list[str] | None = None,
        sample_transform: Callable[[dict], dict] | None = None,
    ) -> None:
        super().__init__()
        given = {"batching": batching, "plan": plan, "loader": loader, "source": source}
        groups = DataModuleGroups.of(given)  # the defaults are not "given"
        self.batching, self.loader, self.source = groups.batching, groups.loader, groups.source
        # The plan settings, checked where they are built (PlanSettings): the training split's, and the
        # evaluation splits' (one fixed independent plan, padded or refused where underfull, at once).
        self.plan_settings = groups.plan
        self.eval_plan_settings = self.plan_settings.replace(
            schedule="independent", underfull=val_underfull, chunk_samples=None
        )
        if sample_transform is not None and not callable(sample_transform):
            raise ValueError(f"sample_transform must be callable(sample) -> sample, got {sample_transform!r}")
        self.save_hyperparameters(
            {
                "train_shards": train_shards,
                "val_shards": val_shards,
                # Plain data (a checkpoint is read with weights_only=True); the groups accept their dicts.
                **{name: dataclasses.asdict(value) for name, value in groups.as_dict().items()},
                "synthetic": synthetic,
                "val_underfull": val_underfull,
                "test_shards": test_shards,
                "predict_shards": predict_shards,
            }
        )
        self.train_shards = train_shards
        self.val_shards = val_shards
        self.test_shards = test_shards
        self.predict_shards = predict_shards
        self.sample_transform = sample_transform
        self.text_pad_to = self.loader.text_pad_to
        self.num_workers = self.loader.num_workers
        self.seed = self.loader.seed
        self.pin_memory = self.loader.pin_memory
        self.on_error = self.source.on_error
        self.synthetic = check_synthetic(synthetic) if synthetic else None
        self.max_member_bytes = self.source.max_member_bytes
        # What a loaded index may name (ShardIndex.load); the shard lists given here are trusted as written.
        self._index_trust = self.source.index_trust()
        self.patch_size = self.batching.patch_size
        # Under sequence parallelism every plan is a plan of the data-parallel groups, each group's batch
        # sized and costed for its G GPUs (planning/groups.py); degree 1: the batching as given.
        self.sequence_parallel = self.plan_settings.sequence_parallel
        self.batcher = DualConstraintBatcher.from_settings(
            group_batching(self.batching, self.sequence_parallel, self.plan_settings.sequence_comm)
        )
        self.train_index: Any = None
        self.val_index: Any = None
        self.train_dataset: PlannedShardDataset | None = None
        self.val_dataset: PlannedShardDataset | None = None
        self.test_dataset: PlannedShardDataset | None = None
        self.predict_dataset: PlannedShardDataset | None = None
        self._prepared_epoch: int | None = None  # the training epoch planned ahead of its iterator (by len)
        self._iterating = False  # a training epoch's iterator has started and not ended
        self._placement = (0, 1)  # (data rank, data world size) of the last setup
        self._epoch_counter = -1
        self._segments: list[dict[str, Any]] = []  # the current epoch's plan segments (resume history)
        self._segment_base = 0  # batches consumed before the current segment, in the current epoch
        self._resume: dict[str, Any] | None = None
        self._resume_source = "checkpoint"
        self._train_loader: PlannedDataLoader | None = None

    @property
    def schedule(self) -> str:
        """The training split's schedule (``plan_settings.schedule``)."""
        return self.plan_settings.schedule

    @property
    def lockstep_tail(self) -> str:
        """The lockstep tail asked for (``plan_settings.lockstep_tail``; see :meth:`_train_lockstep_tail`)."""
        return self.plan_settings.lockstep_tail

    # -- data preparation ------------------------------------------------------------------------------

    @override
    def prepare_data(self) -> None:
        """Generate synthetic shards when ``synthetic`` is set, and write ``index.json`` if missing.

        Runs on one process per node (Lightning). Reuses shards already written with the same settings.
        """
        from lightning_adaptiveload.shards.format import INDEX_NAME
        from lightning_adaptiveload.shards.index import ShardIndex

        if self.synthetic is not None:
            settings = dict(self.synthetic)
            val_n = settings.pop("val_num_samples", None)
            # A bar only for a large write (write_synthetic_shards announces and shows one over 1 GiB).
            settings.setdefault("progress", False)
            write_synthetic_into("train_shards", self.train_shards, settings, rank_zero_info)
            if self.val_shards is not None:
                n = int(val_n) if val_n is not None else max(8, int(settings.get("num_samples", 256)) // 8)
                val_settings = {**settings, "num_samples": n, "seed": int(settings.get("seed", 0)) + 1}
                if isinstance(val_settings.get("samples_per_shard"), list):
                    val_settings["samples_per_shard"] = max(1, n // 4)
                write_synthetic_into("val_shards", self.val_shards, val_settings, rank_zero_info)
        stage = getattr(getattr(self.trainer, "state", None), "fn", None)
        extra = {"test": self.test_shards, "predict": self.predict_shards}
        # Test and predict data are indexed only for their own stage (they may not exist while training).
        # Unknown stage (no trainer yet, or the CLI's check before fit): training data only.
        wanted = [v for k, v in extra.items() if stage is not None and getattr(stage, "value", stage) == k]
        for shards in (self.train_shards, self.val_shards, *wanted):
            folder = index_folder(shards) if shards is not None else None
            if folder is not None and not any(
                os.path.exists(os.path.join(folder, name)) for name in (INDEX_NAME, "index.npidx")
            ):
                # One index pass here, so that the ranks load it in setup instead of each rebuilding it.
                ShardIndex.for_paths(
                    shards,
                    patch_size=self.patch_size,
                    on_error=self.on_error,
                    save=os.path.join(folder, INDEX_NAME),
                    **self._index_trust,
                )

    @override
    def setup(self, stage: str | None = None) -> None:
        """Load the indexes and build the datasets; rank and world size come from the trainer.

        Raises:
            ValueError: the trainer's module cannot take the training batches (:meth:`check_module`), or
                the trainer may run several epochs without reloading its loaders every epoch
                (:func:`~.loader.check_reload_every_epoch`: build it with
                ``Trainer(reload_dataloaders_every_n_epochs=1)``; the DataModule never changes the trainer).
        """
        _dist.destroy_gloo_group_at_exit()  # each DDP process on CPU: see _dist.destroy_gloo_group_at_exit
        if stage in (None, "fit") and self.trainer is not None:
            # Every rank raises the same error here, before any collective of the fit: no rank waits.
            self.check_module(getattr(self.trainer, "lightning_module", None))
            check_reload_every_epoch(self.trainer)
        rank, world = self._data_placement()
        self._placement = (rank, world)  # where the datasets built now are placed (_dataset)
        loaded: list[tuple[str, Any, Any]] = []  # (name, shards, index) of the indexes loaded now
        if self.train_index is None and stage in (None, "fit"):
            self.train_index = self._load_index(self.train_shards, rank)
            train = self.plan_settings.replace(lockstep_tail=self._train_lockstep_tail())
            self.train_dataset = self._dataset(self.train_index, train)
            loaded.append(("train", self.train_shards, self.train_index))
        if self.val_shards is not None and self.val_index is None and stage in (None, "fit", "validate"):
            self.val_index = self._load_index(self.val_shards, rank)
            self.val_dataset = self._dataset(self.val_index, self.eval_plan_settings, fixed_epoch=0)
            loaded.append(("validation", self.val_shards, self.val_index))
        if self.test_shards is not None and self.test_dataset is None and stage in (None, "test"):
            index = self._load_index(self.test_shards, rank)
            self.test_dataset = self._dataset(index, self.eval_plan_settings, fixed_epoch=0)
            loaded.append(("test", self.test_shards, index))
        if self.predict_shards is not None and self.predict_dataset is None and stage in (None, "predict"):
            index = self._load_index(self.predict_shards, rank)
            self.predict_dataset = self._dataset(index, self.eval_plan_settings, fixed_epoch=0)
            loaded.append(("predict", self.predict_shards, index))
        # Datasets of an earlier setup (another trainer: fit, then test on other ranks) are placed anew.
        for name in ("train_dataset", "val_dataset", "test_dataset", "predict_dataset"):
            ds = getattr(self, name)
            if ds is not None:
                setattr(self, name, ds.on_ranks(rank, world))
        if loaded:
            check_indexes_agree(loaded)
        for name, shards, index in loaded:
            if (getattr(index, "metadata", None) or {}).get("demo"):
                # Written by `ingest --vae tiny-random` (ingest/demo.py): shapes right, content random.
                rank_zero_warn(
                    f"[adaptiveload] the {name} shards {shards!r} are DEMO DATA, NOT FOR TRAINING: their index "
                    "says they were encoded with a random-weight tiny VAE, so a model learns nothing useful "
                    "from them. Ingest real data with Wan's VAE (docs/ingest.md)"
                )

    def check_module(self, module: Any) -> None:
        """Refuse a training module that cannot take this DataModule's training batches, before any step.

        The packed schedule gives every training step a pack (``batch["packed"]`` is True and
        ``batch["latents"]`` a list of ``(C, T, H, W)`` tensors of different shapes; ``docs/data_path.md``,
        "Packed batches"). A module says it runs packs with the class attribute ``runs_packed_batches =
        True`` (``VideoDiTModule`` does); any other would fail deep inside its first step, or silently train on
        what it misreads. :meth:`setup` calls this on every rank; the CLI also calls it in the launching
        process, before DDP starts the ranks. Lockstep's packed tail asks the same attribute, but falls back
        to bucketed batches instead (:attr:`lockstep_tail`).

        Args:
            module: the LightningModule that will train, or None (nothing to check: plain PyTorch use).

        Under sequence parallelism (``plan.sequence_parallel`` > 1) packs are refused whatever the module:
        a pack's samples cannot be split over a sequence group (``docs/sequence_parallel.md``, "Limits");
        lockstep's packed tail becomes bucketed instead (:meth:`_train_lockstep_tail`).

        Raises:
            ValueError: ``schedule="packed"`` and the module does not set ``runs_packed_batches = True``, or
                ``schedule="packed"`` with ``plan.sequence_parallel`` > 1; the message names the module or
                the degree, the setting and the ways out.
        """
        if not SCHEDULE_TYPES[self.schedule].always_packs:
            return
        if self.sequence_parallel > 1:
            raise ValueError(
                f"schedule='packed' gives every training step a pack of samples of different shapes, but "
                f"plan.sequence_parallel={self.sequence_parallel} splits each batch's token sequence over a "
                "group of GPUs, and a pack cannot be split that way (Ulysses attention runs bucketed batches "
                "only; docs/sequence_parallel.md, 'Limits'). Set data.init_args.plan.schedule to 'lockstep' "
                "(recommended; its tail is bucketed under sequence parallelism), 'independent' or 'auto', or "
                "set data.init_args.plan.sequence_parallel to 1"
            )
        if module is None:
            return
        flag = getattr(module, "runs_packed_batches", None)
        if flag:
            return
        said = (
            "sets runs_packed_batches = False"
            if flag is not None
            else "does not set runs_packed_batches = True"
        )
        raise ValueError(
            f"schedule='packed' gives every training step a pack of samples of different shapes "
            f"(batch['packed'] is True, batch['latents'] a list of (C, T, H, W) tensors), but "
            f"{type(module).__name__} {said}, so it cannot take them. Either set the data's schedule to "
            "'lockstep' or 'independent' (in a recipe: data.init_args.plan.schedule), or make the module's "
            "training_step take packs and set runs_packed_batches = True on its class (docs/data_path.md, "
            "'Packed batches'; examples/your_own_model/wan_flow.py does)"
        )

    def _train_lockstep_tail(self) -> str:
        """``lockstep_tail``, or ``"bucketed"`` where the trainer's module does not run packs (warned), or
        under sequence parallelism (one info line: packs cannot be split over a sequence group)."""
        if self.lockstep_tail == "bucketed" or not SCHEDULE_TYPES[self.schedule].has_lockstep_tail:
            return self.lockstep_tail
        if self.sequence_parallel > 1:
            rank_zero_info(
                f"[adaptiveload] lockstep_tail='packed' under plan.sequence_parallel={self.sequence_parallel}: "
                "the lockstep epochs end with bucketed batches instead (a pack cannot be split over a sequence "
                "group; docs/sequence_parallel.md, 'Limits'). Set data.init_args.plan.lockstep_tail to "
                "'bucketed' to silence this"
            )
            return "bucketed"
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        if module is None or getattr(module, "runs_packed_batches", False):
            return "packed"  # no module to ask (plain PyTorch use): the caller chose packs
        rank_zero_warn(
            f"[adaptiveload] lockstep_tail='packed' needs a LightningModule that runs packed batches, but "
            f"{type(module).__name__} does not set runs_packed_batches = True: the lockstep epochs end with "
            "bucketed (unequal) batches instead. Set lockstep_tail='bucketed' to silence this, or run packs "
            "(docs/data_path.md, 'Packed batches') and set runs_packed_batches = True on the module"
        )
        return "bucketed"

    def _load_index(self, shards: Any, rank: int) -> Any:
        from lightning_adaptiveload.shards.index import ShardIndex

        binary = binary_index_of(shards)
        if binary is not None:
            # The binary index stays arrays (no Python object per sample); see shards/compact.py.
            from lightning_adaptiveload.shards.compact import load_checked_compact

            trust = {k: v for k, v in self._index_trust.items() if k != "max_member_bytes"}
            return load_checked_compact(binary, patch_size=self.patch_size, on_error=self.on_error, **trust)
        return ShardIndex.for_paths(
            shards,
            patch_size=self.patch_size,
            on_error=self.on_error,
            progress=rank == 0,
            **self._index_trust,
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
                check_oversize(index, batcher)
                batcher.resolve_max_compute(distinct_shapes(index))

    def _dataset(
        self, index: Any, settings: PlanSettings, fixed_epoch: int | None = None
    ) -> PlannedShardDataset:
        # In setup, not when the epoch's iterator starts: an error raised there is masked by Lightning's
        # teardown (`Please call iter(combined_loader) first`).
        check_oversize(index, self.batcher)
        training = fixed_epoch is None
        # Training plans with the DataModule's batcher (its cap is saved in the checkpoint, the closed loop
        # refits its cost model); every other split with a copy, so that resolving an "auto" cap on its
        # shapes never changes training's (a copy of a resolved batcher keeps training's cap).
        batcher = self.batcher if training else DualConstraintBatcher.from_config(self.batcher.config())
        return PlannedShardDataset(
            index,
            batcher,
            settings,
            seed=self.seed,
            num_workers=self.num_workers,
            on_error=self.on_error,
            fixed_epoch=fixed_epoch,
            max_member_bytes=self.max_member_bytes,
            sample_transform=self.sample_transform if training else None,
            text_pad_to=self.text_pad_to,
            placement=self._placement,
            remote=self.source.remote,
        )

    # -- loaders ---------------------------------------------------------------------------------------

    @override
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
            multiprocessing_context=loader_context(
                self.loader.start_method, self.num_workers, self.sample_transform, rank_zero_info
            ),
            length_fn=self._train_epoch_steps,
        )
        return self._train_loader

    @_only_with("val_shards")
    @override
    def val_dataloader(self) -> PlannedDataLoader | list:
        if self.val_shards is None:
            return []
        if self.val_dataset is None:
            self.setup("validate")
        assert self.val_dataset is not None
        return self._eval_loader(self.val_dataset)

    @override
    def test_dataloader(self) -> PlannedDataLoader | list:
        if self.test_shards is None:
            return []
        if self.test_dataset is None:
            self.setup("test")
        assert self.test_dataset is not None
        return self._eval_loader(self.test_dataset)

    @override
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
            multiprocessing_context=loader_context(
                self.loader.start_method, self.num_workers, None, rank_zero_info
            ),
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
        ds = self.train_dataset
        if (
            trainer is not None
            and self._resume is None
            and ds is not None
            and ds.planned_for(int(trainer.current_epoch))
        ):
            # The epoch's plan exists: start it over rather than plan it again. Lightning (2.x) creates the
            # training iterator twice in every epoch after the first when it reloads the loader (in
            # FitLoop.setup_data, then again in the epoch loop's on_run_start, abandoning the first), and
            # a plan costs minutes at 100M samples. The plan of an epoch is fixed by its seed and settings,
            # so it is the one a second planning would make (for a resumed epoch, the rest of it).
            ds.begin_epoch(ds.epoch, ds.plan)
            return
        self._prepare_train_epoch()
        self._prepared_epoch = None

    def _data_placement(self) -> tuple[int, int]:
        """``(data rank, data world size)`` of this process: its global rank and world size, or under
        ``plan.sequence_parallel`` G its group's (every GPU of a group reads the group's batches).

        Raises:
            ValueError: the world size is not a multiple of G, or the trainer's strategy runs another
                sequence-parallel degree than the plan's.
        """
        rank, world = _dist.rank_and_world(self.trainer)
        degree = _dist.sequence_degree(self.trainer)
        if degree is not None and degree != self.sequence_parallel:
            raise ValueError(
                f"AdaptiveLoadDataModule: plan.sequence_parallel={self.sequence_parallel}, but the trainer's "
                f"strategy splits sequences over {degree} GPUs: set data.init_args.plan.sequence_parallel to "
                f"{degree} (every GPU of a group must get the group's batches)"
            )
        return data_placement(rank, world, self.sequence_parallel)

    def _prepare_train_epoch(self) -> None:
        ds = self.train_dataset
        assert ds is not None
        rank, world = self._data_placement()
        if (ds.rank, ds.world_size) != (rank, world):  # setup placed it for this trainer
            raise RuntimeError(
                f"AdaptiveLoadDataModule: the training dataset was set up for rank {ds.rank} of {ds.world_size}, "
                f"but the trainer runs rank {rank} of {world}; call setup('fit') with this trainer first"
            )
        ds.plan_progress = PlanProgressBar() if _dist.rank_and_world(self.trainer)[0] == 0 else None
        epoch = self._current_epoch()
        resume, self._resume = self._resume, None
        if resume is not None and int(resume["epoch"]) > epoch:
            # Not the past epoch of a state saved at an epoch's end: a position ahead of the fit loop,
            # whose epochs before it would be trained again silently.
            raise ResumeStateError(
                f"{self._resume_source}: the AdaptiveLoadDataModule resume state's epoch is {resume['epoch']}, "
                f"but training is at epoch {epoch}: the state belongs to another run or checkpoint, and "
                f"starting fresh would train epochs {epoch} to {int(resume['epoch']) - 1} again. What to do: "
                "resume with the checkpoint that saved this state (its trainer and datamodule entries "
                "together), or drop the datamodule's entry from the checkpoint to start the epoch afresh"
            )
        if resume is not None and int(resume["epoch"]) == epoch:
            plan = self._resume_plan(ds, resume)
            if plan.steps == 0:  # saved after the epoch's last batch: Lightning restarts an empty epoch
                end_exhausted_restart(self.trainer)
        else:
            if resume is not None:  # an epoch already over (a state saved at its end): nothing to resume
                log.warning(
                    "resume state is for epoch %s, training is at epoch %s: starting fresh",
                    resume["epoch"],
                    epoch,
                )
            plan = ds.make_plan(epoch, local=True)
            self._segments = [{"kind": "fresh", **ds.plan_settings(), "consumed": None}]
            self._segment_base = 0
        ds.begin_epoch(epoch, plan)
        self._prepared_epoch = epoch
        rep = ds.report
        ranks = f"groups of {self.sequence_parallel} GPUs" if self.sequence_parallel > 1 else "ranks"
        if rank == 0:
            rank_zero_info(
                # Every rank yields one batch per step; a resumed rank-local plan counts this rank's samples.
                f"[adaptiveload] epoch {epoch}: {rep['samples']} samples"
                + (" on this rank" if rep.get("counts_of_rank") is not None else "")
                + f", {rep['steps']} steps x {world} {ranks}, "
                f"{rep['steps'] * world} batches, {rep['tokens']} tokens, padding 0, skipped {rep['skipped'] or 0}, "
                f"partial {rep['partial_batches']}, split {rep['split_batches']}, "
                f"{batching_label(rep['schedule'], self.batcher.sizing)}"
                + (
                    f", lockstep tail steps {rep['lockstep_tail_steps']}, packed tail steps "
                    f"{rep.get('packed_tail_steps', 0)}"
                    if getattr(SCHEDULE_TYPES.get(rep["schedule"]), "has_lockstep_tail", False)
                    else ""
                )
                + f", est. compute CV {rep['est_compute_cv']:.3f}, plan {rep['plan_seconds']:.2f}s"
            )
            auto = rep.get("schedule_auto")
            if auto:
                rank_zero_info(f"[adaptiveload] schedule 'auto' chose {auto['chose']}: {auto['why']}")

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

    def set_cost_model(self, cost_model: Any) -> None:
        """Plan the next training epoch with ``cost_model`` (a ``CostModel`` or its dict; the running epoch keeps
        its plan); an ``"auto"`` cap is resolved again. The closed loop calls it (``docs/closed_loop.md``).

        Raises:
            ValueError: ``max_compute`` is a number (in the starting model's unit).
        """
        shapes = distinct_shapes(self.train_index) if self.train_index is not None else []
        self.batcher.set_cost_model(cost_model, shapes)

    def replan_rest(self) -> Replanned:
        """The rest of the running training epoch planned again with the current cost model (every rank at the
        same step): :func:`~lightning_adaptiveload.loading.replan.replan_rest`, for the closed loop."""
        return replan_rest(self)

    # -- resume ----------------------------------------------------------------------------------------

    def _consumed_now(self) -> int:
        """Batches of the current training epoch consumed on this rank (whole epoch, all segments): those
        before this segment, plus the batches the loader's counting iterator handed out in it."""
        ds = self.train_dataset
        if ds is None or ds.plan is None:
            return 0
        total = self._segment_base + ds.plan.steps
        trainer = self.trainer
        if trainer is not None and int(trainer.current_epoch) != ds.epoch:
            return total  # the epoch ended (and the trainer went on) before this state was asked for
        return min(total, self._segment_base + ds.batches_yielded)

    @override
    def state_dict(self) -> dict[str, Any]:
        """The training epoch's position, for mid-epoch resume (gathers every rank's count: collective).

        Returns:
            ``{"version", "fingerprint", "epoch", "segments": [{"kind", "world_size", "num_workers",
            "seed", "schedule", "batcher", "max_buffered_samples", "lockstep_tolerance", "lockstep_tail",
            "chunk_samples", "consumed": [per rank], "digest", "digests": [per rank]}]}`` (the layout of
            :data:`~lightning_adaptiveload.loading.resume.STATE_VERSION`), or ``{}`` before the first
            training epoch. Every rank must call it (as ``Trainer.save_checkpoint`` does).
        """
        ds = self.train_dataset
        if ds is None or ds.plan is None or not self._segments:
            return {}
        return position_state(ds, self._segments, self._consumed_now() - self._segment_base)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position saved by :meth:`state_dict` (by this release or an earlier one: an older layout
        is read into the current one, :func:`~lightning_adaptiveload.loading.resume.read_state`); applied when
        that epoch's loader starts."""
        if not state_dict:
            return
        # Layout, types and bounds, now (an older layout migrated); the digest when the epoch is replayed.
        self._resume_source = self._state_source()
        self._resume = read_state(state_dict, self._resume_source)

    def _state_source(self) -> str:
        """Where the state being loaded comes from, for the messages: the checkpoint and its key."""
        trainer = getattr(self, "_trainer", None) or getattr(self, "trainer", None)
        path = getattr(trainer, "ckpt_path", None) if trainer is not None else None
        where = f"checkpoint {path}" if path else "checkpoint"
        return f"{where}, key {type(self).__qualname__!r}"

    def _resume_plan(self, ds: PlannedShardDataset, state: Mapping[str, Any]) -> EpochPlan:
        # This rank's plan at its position, or the rest replanned; refused where no digest can be checked
        # unless Loader(resume_unverified=True).
        resumed = resume_plan(ds, state, allow_unverified=self.loader.resume_unverified)
        self._segments = resumed.segments
        self._segment_base = resumed.segment_base
        rank_zero_info(
            f"[adaptiveload] resuming epoch {state['epoch']} after {resumed.consumed_samples} consumed samples"
            f"{' on this rank' if resumed.kind == 'continue' else ''} "
            f"({resumed.kind}: world size {ds.world_size}, {ds.num_workers} workers, {resumed.plan.steps} steps left)"
        )
        return local_plan(resumed.plan, ds.rank) if resumed.plan.rank is None else resumed.plan
