"""Dual-constraint batching: a token cap and a compute cap per batch, one latent shape per batch.

A batch holds B samples of one latent shape (C, T, H, W), so it is never padded. With S tokens per
sample, the batch size of a bucket is (the rule itself: :class:`~.sizing.BatchSizer`)

- ``sizing="equal_tokens"`` (the baseline every trainer uses): ``B = floor(max_tokens / S)``;
- ``sizing="dual"`` (AdaptiveLoad): ``B = max(1, min(floor(max_tokens / S), floor((max_compute - c0) / cost(S))))``
  (``c0``: the cost model's per-step constant, 0 unless fitted to packs).

A batch *satisfies the constraints* (:meth:`DualConstraintBatcher.satisfies`) when ``B * S <= max_tokens``
and, with ``sizing="dual"``, ``c0 + B * cost(S) <= max_compute``; the one exception is a single sample (B = 1) whose
compute alone exceeds ``max_compute``: it is allowed (B is at least 1) as long as ``S <= max_tokens``.
A sample with ``S > max_tokens`` is *oversize*: ``oversize="raise"`` raises, ``"skip"`` leaves it out and
counts it.

``max_compute="auto"`` (also what ``None`` means with ``sizing="dual"``) is the compute of the cheapest full
bucket at the token cap: ``min over the buckets b present of floor(max_tokens / S_b) * cost(S_b)``. With
a convex cost this is usually the image bucket, so every bucket's batch compute is brought down to the
image batch's, except buckets where one sample already costs more (B = 1).

This module holds :class:`DualConstraintBatcher` (the settings, the "auto" cap's resolution, and a
WebDataset pipeline stage: ``__call__``, an iterator of decoded samples -> an iterator of batches, which
imports torch when called). The batch itself is :func:`~lightning_adaptiveload.loading.collate.collate`. The
planned path (``planner.py`` + ``datamodule.py``) uses the batcher's :attr:`~DualConstraintBatcher.sizer`
only.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any

from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.settings import Batching
from lightning_adaptiveload.planning.sizing import BatchSizer, tokens_per_sample

__all__ = ["DualConstraintBatcher"]

_PARTIAL = ("emit", "carry")


class DualConstraintBatcher:
    """Buckets samples by latent shape and sizes each bucket's batches under a token and a compute cap.

    Args:
        max_tokens: token cap per batch (B * S <= max_tokens); also the largest sample allowed.
        max_compute: compute cap per batch in the cost model's unit (``B * cost(S) <= max_compute``), or
            ``"auto"`` / None (``sizing="dual"``: the documented rule, resolved by :meth:`resolve_max_compute`).
            Ignored with ``sizing="equal_tokens"``.
        cost_model: a :class:`CostModel` or its dict; :meth:`CostModel.default` when None. A numeric
            ``max_compute`` needs an explicit cost model (the number is in its unit).
        sizing: ``"dual"`` or ``"equal_tokens"`` (the batch sizing rule).
        patch_size: (pt, ph, pw) of the model.
        oversize: a sample with more than ``max_tokens`` tokens: ``"raise"`` or ``"skip"`` (counted in
            ``stats["skipped_oversize"]``).
        partial: pipeline stage only: at the end of the input, ``"emit"`` the incomplete buckets as smaller
            batches (counted in ``stats["partial_batches"]``) or ``"carry"`` them into the next call (counted
            in ``stats["carried"]``).

    The settings are checked by :class:`~.settings.Batching` (:meth:`from_settings` takes one), the one place.

    Attributes:
        stats: counters of the pipeline stage: samples, batches, partial_batches, skipped_oversize,
            carried (samples held for the next call).

    Buckets are keyed by (T, H, W); all samples of a bucket must have the same C (a data set mixing
    VAEs is an error).

    Example:
        >>> b = DualConstraintBatcher(max_tokens=4096, sizing="equal_tokens")
        >>> b.batch_size((16, 1, 8, 12))  # 24 tokens
        170
    """

    def __init__(
        self,
        max_tokens: int,
        max_compute: float | str | None = None,
        cost_model: CostModel | Mapping[str, Any] | None = None,
        sizing: str = "dual",
        patch_size: Sequence[int] = (1, 2, 2),
        oversize: str = "raise",
        partial: str = "emit",
    ) -> None:
        if partial not in _PARTIAL:
            raise ValueError(f"partial must be one of {_PARTIAL}, got {partial!r}")
        settings = Batching(
            max_tokens=max_tokens,
            max_compute=max_compute,  # type: ignore[arg-type]
            cost_model=cost_model,  # type: ignore[arg-type]
            sizing=sizing,  # type: ignore[arg-type]
            patch_size=patch_size,  # type: ignore[arg-type]
            oversize=oversize,  # type: ignore[arg-type]
        )
        self.oversize = settings.oversize
        self.partial = partial
        sizer = BatchSizer(settings.max_tokens, sizing=settings.sizing, patch_size=settings.patch_size)
        self._explicit_cost_model = cost_model is not None
        if self._explicit_cost_model:
            sizer = replace(sizer, cost_model=CostModel.from_dict(cost_model))  # type: ignore[arg-type]
        self._auto = settings.sizing == "dual" and settings.max_compute in (None, "auto")
        if settings.sizing == "dual" and not self._auto:
            sizer = replace(sizer, max_compute=settings.max_compute)
        self._sizer = sizer
        self._carry: list[dict[str, Any]] = []
        self.stats: dict[str, int] = {}
        self._reset_stats()

    # -- configuration ---------------------------------------------------------------------------------

    @property
    def sizer(self) -> BatchSizer:
        """The sizing rule in use (torch-free); replaced by a new one when the "auto" cap is resolved."""
        return self._sizer

    @property
    def max_tokens(self) -> int:
        """Token cap per batch."""
        return self._sizer.max_tokens

    @classmethod
    def from_settings(cls, settings: Batching, partial: str = "emit") -> DualConstraintBatcher:
        """The batcher of a :class:`~.settings.Batching` (``partial``: the pipeline stage's, see above)."""
        return cls(
            max_tokens=settings.max_tokens,
            max_compute=settings.max_compute,
            cost_model=settings.cost_model,
            sizing=settings.sizing,
            patch_size=settings.patch_size,
            oversize=settings.oversize,
            partial=partial,
        )

    @property
    def sizing(self) -> str:
        """The sizing rule: ``"dual"`` or ``"equal_tokens"``."""
        return self._sizer.sizing

    @property
    def patch_size(self) -> tuple[int, int, int]:
        """(pt, ph, pw) of the model."""
        return self._sizer.patch_size

    @property
    def cost_model(self) -> CostModel:
        """The cost model (:meth:`CostModel.default` when none was given)."""
        return self._sizer.cost_model

    @property
    def max_compute(self) -> float | None:
        """The compute cap in use (None with ``sizing="equal_tokens"`` or while ``"auto"`` is unresolved)."""
        return self._sizer.max_compute

    @property
    def needs_resolution(self) -> bool:
        """True while ``max_compute="auto"`` waits for :meth:`resolve_max_compute`."""
        return self.sizing == "dual" and self.max_compute is None

    @property
    def cap_follows_cost_model(self) -> bool:
        """Whether another cost model keeps the compute cap meaningful: ``"auto"`` (re-resolved from the new
        model) or ``sizing="equal_tokens"`` (no compute cap); False for a number in the current model's unit."""
        return self.sizing != "dual" or self._auto

    def set_cost_model(
        self, cost_model: CostModel | Mapping[str, Any], latent_shapes: Iterable[Sequence[int]]
    ) -> None:
        """Plan with ``cost_model`` from now on; an ``"auto"`` cap is resolved again from ``latent_shapes``.

        Raises:
            ValueError: the compute cap is a number (in the old model's unit; :attr:`cap_follows_cost_model`),
                or the model's cost is not positive at a length of ``latent_shapes`` (naming the coefficient);
                the current model is kept then.
        """
        if not self.cap_follows_cost_model:
            raise ValueError(
                f"max_compute={self.max_compute!r} is in the unit of the current cost model; a new cost model would "
                "change its meaning. Use max_compute='auto' to change the cost model during training"
            )
        model = CostModel.from_dict(cost_model)
        shapes = [tuple(s) for s in latent_shapes]
        model.check_positive(sorted({tokens_per_sample(s, self.patch_size) for s in set(shapes)}))
        self._sizer = replace(self._sizer, cost_model=model, max_compute=None)
        self._explicit_cost_model = True
        if self.sizing == "dual":
            self.resolve_max_compute(shapes)

    def config(self) -> dict[str, Any]:
        """Settings that rebuild this batcher (``DualConstraintBatcher(**config)``), with the resolved cap."""
        return {
            "max_tokens": self.max_tokens,
            "max_compute": self.max_compute
            if self.max_compute is not None
            else ("auto" if self._auto else None),
            "cost_model": self.cost_model.to_dict() if self._explicit_cost_model else None,
            "sizing": self.sizing,
            "patch_size": list(self.patch_size),
            "oversize": self.oversize,
            "partial": self.partial,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DualConstraintBatcher:
        """Inverse of :meth:`config` (a resolved "auto" cap comes back as that number). A config saved in an
        older checkpoint is brought to this layout by :func:`~lightning_adaptiveload.loading.resume.read_state`
        first."""
        cfg = dict(config)
        dual = cfg.get("sizing", "dual") == "dual"
        batcher = cls(**{**cfg, "max_compute": None if dual else cfg.get("max_compute")})
        if dual and isinstance(cfg.get("max_compute"), int | float):
            batcher._fix_max_compute(float(cfg["max_compute"]), auto=False)
        return batcher

    def _fix_max_compute(self, value: float, auto: bool) -> None:
        """Fix the compute cap; ``auto``: it was resolved by the "auto" rule (which a later call re-applies)."""
        self._sizer = replace(self._sizer, max_compute=value)
        self._auto = auto

    def resolve_max_compute(self, latent_shapes: Iterable[Sequence[int]]) -> float | None:
        """Apply the ``"auto"`` rule to the data set's latent shapes and fix the cap on this batcher.

        ``max_compute = min over the distinct buckets b of floor(max_tokens / S_b) * cost(S_b)``, over the
        buckets that fit the token cap (:meth:`BatchSizer.auto_max_compute`). No-op (returns the cap) when
        the cap is numeric or the sizing is ``equal_tokens``. Call it once with every shape of the data set
        (the index's), not per shard, so that every rank and every epoch uses the same cap.

        Returns:
            The cap (cost-model units), or None with ``sizing="equal_tokens"``.

        Raises:
            ValueError: no shape fits the token cap, or the cost is not positive at some length.
        """
        if self.sizing != "dual" or not self._auto:
            return self.max_compute
        self._fix_max_compute(self._sizer.auto_max_compute(latent_shapes), auto=True)
        return self.max_compute

    # -- batch sizes -----------------------------------------------------------------------------------

    def seq_len(self, latent_shape: Sequence[int]) -> int:
        """Tokens per sample S of this latent shape (cached)."""
        return self._sizer.size(latent_shape).seq_len

    def batch_size(self, latent_shape: Sequence[int]) -> int:
        """Samples per batch for this latent shape; 0 only for an oversize sample under ``oversize="skip"``.

        Raises:
            ValueError: an oversize sample under ``oversize="raise"`` (names the shape, S and max_tokens).
        """
        s, b = self._sizer.size(latent_shape)
        if b == 0 and self.oversize == "raise":
            raise ValueError(self._sizer.oversize_message(latent_shape, s))
        return b

    def satisfies(self, batch_size: int, seq_len: int) -> bool:
        """Whether a batch of ``batch_size`` samples of ``seq_len`` tokens meets the constraints.

        ``B * S <= max_tokens`` and (dual) ``B * cost(S) <= max_compute``, except that a single sample
        (B = 1) within the token cap is always allowed.
        """
        return self._sizer.satisfies(batch_size, seq_len)

    # -- the pipeline stage ----------------------------------------------------------------------------

    def _reset_stats(self) -> None:
        self.stats = {"samples": 0, "batches": 0, "partial_batches": 0, "skipped_oversize": 0, "carried": 0}

    def __call__(self, samples: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
        """WebDataset pipeline stage: decoded samples in, batches (:func:`collate` dicts) out.

        Samples are bucketed by (T, H, W); a bucket is emitted as soon as it holds its batch size. At the
        end of the input the incomplete buckets are emitted (``partial="emit"``) in the order of their
        oldest sample, or kept for the next call (``partial="carry"``). ``stats`` counts what happened.

        Raises:
            ValueError: an oversize sample under ``oversize="raise"``, or a sample whose C differs from
                its bucket's (names the key and shapes).
        """
        # The one import of loading/ from planning/: this stage emits torch batches (allowed in
        # tests/package/test_layout.py).
        from lightning_adaptiveload.loading.collate import collate, sample_fields

        if self.needs_resolution:
            raise ValueError(
                "max_compute='auto' is not resolved: call batcher.resolve_max_compute(latent_shapes) with the data "
                "set's latent shapes before using the batcher as a pipeline stage, or pass a number"
            )
        pending: dict[tuple[int, int, int], list[Mapping[str, Any]]] = {}
        channels: dict[tuple[int, int, int], tuple[int, str]] = {}
        carried, self._carry = self._carry, []
        self.stats["carried"] = 0

        def stream() -> Iterator[Mapping[str, Any]]:
            yield from carried
            yield from samples

        n_carried = len(carried)
        for i, sample in enumerate(stream()):
            key, latent, _, _, _ = sample_fields(sample)
            shape = tuple(latent.shape)
            if len(shape) != 4:
                raise ValueError(f"sample {key!r}: latent must be (C, T, H, W), got shape {list(shape)}")
            s, b = self._sizer.size(shape)
            if i >= n_carried:
                self.stats["samples"] += 1
            if b == 0:
                if self.oversize == "raise":
                    raise ValueError(self._sizer.oversize_message(shape, s, where=f"sample {key!r}: "))
                self.stats["skipped_oversize"] += 1
                continue
            bucket = shape[1:]
            first = channels.setdefault(bucket, (shape[0], key))
            if first[0] != shape[0]:
                raise ValueError(
                    f"sample {key!r} has latent shape {list(shape)} with C={shape[0]}, but sample {first[1]!r} of the "
                    f"same bucket (T, H, W)={list(bucket)} has C={first[0]}; all latents must come from one VAE"
                )
            group = pending.setdefault(bucket, [])
            group.append(sample)
            if len(group) == b:
                del pending[bucket]
                self.stats["batches"] += 1
                yield collate(group, self.patch_size, self.cost_model)
        # dict order = order in which each pending bucket got its oldest sample
        for group in pending.values():
            if self.partial == "carry":
                self._carry.extend(group)
                self.stats["carried"] += len(group)
            else:
                self.stats["batches"] += 1
                self.stats["partial_batches"] += 1
                yield collate(group, self.patch_size, self.cost_model)
