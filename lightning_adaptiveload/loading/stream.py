"""One stream of an epoch plan turned into decoded, batched samples (pure: torch, no Lightning).

A plan gives every (rank, worker) stream its batches (lists of sample refs), the shard reads that hold
them, and each batch's step and bucket. :func:`stream_batches` opens those reads lazily with
:func:`~lightning_adaptiveload.shards.reader.iter_shard`, keeps samples that arrive before their batch,
runs the user's sample transform, collates every batch and notes what the reader skipped on the way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from lightning_adaptiveload.loading.collate import collate
from lightning_adaptiveload.loading.packed_collate import collate_packed
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.plan import EpochPlan
from lightning_adaptiveload.shards.format import MEMBER_REASONS
from lightning_adaptiveload.shards.objstore import RemoteSettings
from lightning_adaptiveload.shards.protocol import ShardIndexLike
from lightning_adaptiveload.shards.ranged import RangedReader, ranged_shards
from lightning_adaptiveload.shards.reader import iter_shard

__all__ = ["apply_sample_transform", "empty_batch", "stream_batches"]

Ref = tuple[int, int]  # (shard_id, sample_id)


def empty_batch(
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
    from lightning_adaptiveload.loading.collate import sample_fields
    from lightning_adaptiveload.planning.sizing import tokens_per_sample

    key, latent, text, meta, ref = sample_fields(sample)
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


def stream_batches(
    plan: EpochPlan,
    stream: tuple[int, int],
    index: ShardIndexLike,
    batcher: DualConstraintBatcher,
    *,
    on_error: str = "raise",
    max_member_bytes: int | None = None,
    sample_transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    text_pad_to: int | None = None,
    remote: RemoteSettings | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield the planned batches of one ``(rank, worker)`` stream, in order.

    Shards whose index lists sample spans and that live in object storage (or any, under
    ``remote.ranged="always"``) are read by ranges: the stream fetches exactly its planned samples' bytes,
    ahead of the batch being collated (:class:`~lightning_adaptiveload.shards.ranged.RangedReader`).
    The others are streamed with ``iter_shard``, each planned read opened once.

    Args:
        plan: the epoch plan.
        stream: ``(rank, worker)``, a key of ``plan.streams``.
        index: the ``ShardIndex`` the plan was made from.
        batcher: gives the patch size and the cost model of the batches.
        on_error, max_member_bytes: passed to ``iter_shard``.
        sample_transform: ``f(sample) -> sample`` run on every decoded sample (see
            :func:`apply_sample_transform`), or None.
        text_pad_to: see :func:`~lightning_adaptiveload.loading.collate.collate`.
        remote: how ranged reads run (:class:`~lightning_adaptiveload.shards.objstore.RemoteSettings`);
            None: its defaults (``ranged="auto"``).

    Yields:
        ``collate``'s batch dict (or :func:`empty_batch` when every member was skipped) plus ``"step"``
        (the global step), ``"skipped"`` (samples the reader skipped since the previous batch, by reason,
        with ``"missing"`` for samples lost without a reason) and ``"ignored_members"`` (members ignored or
        refused, by reason); in a stream with ranged reads also ``"fetched"``: ``{"bytes", "requests",
        "retries", "cache_hits"}`` since the previous batch (bytes and requests of answers received;
        cache hits fetch nothing).
    """
    patch = batcher.patch_size
    stats: dict[str, int] = {}

    def open_read(shard: int, ids: list[int]) -> Iterator[dict[str, Any]]:
        return iter_shard(
            index.shards[shard],
            shard_id=shard,
            select=ids,
            on_error=on_error,
            stats=stats,
            patch_size=patch,
            max_member_bytes=max_member_bytes,
        )

    settings = remote if remote is not None else RemoteSettings()
    shards = index.shards
    ranged = (
        ranged_shards(shards, [s for s, _ in plan.reads[stream]], settings)
        if settings.ranged != "never"
        else set()
    )
    reads = _Reads([r for r in plan.reads[stream] if r[0] not in ranged], open_read)
    by_range = None
    if ranged:
        by_range = RangedReader(
            shards,
            plan.streams[stream],
            settings,
            ranged.__contains__,
            on_error=on_error,
            stats=stats,
            patch_size=patch,
            max_member_bytes=max_member_bytes,
        )
    skips = _SkipCounter(stats)
    buckets, steps = plan.batch_buckets[stream], plan.batch_steps[stream]
    try:
        for j, refs in enumerate(plan.streams[stream]):
            if by_range is None:
                members = reads.take(refs)
            else:
                got = by_range.take(j)
                streamed = reads.take([r for r in refs if r[0] not in ranged])
                got.update(((int(m["__ref__"][0]), int(m["__ref__"][1])), m) for m in streamed)
                members = [got[r] for r in refs if r in got]
            if sample_transform is not None:
                members = [apply_sample_transform(sample_transform, m, patch) for m in members]
            step = steps[j]
            if members:
                batch = (collate_packed if plan.is_pack(stream, j) else collate)(
                    members, patch, batcher.cost_model, plan.global_tokens[step], text_pad_to=text_pad_to
                )
            else:
                spec = plan.buckets[buckets[j]]
                batch = empty_batch(
                    spec["shape"], spec["seq_len"], batcher.cost_model, plan.global_tokens[step]
                )
            batch["step"] = step
            batch["skipped"], batch["ignored_members"] = skips.since_last(len(refs) - len(members))
            if by_range is not None:
                batch["fetched"] = by_range.counts_since_last()
            yield batch
    finally:
        reads.close_all()
        if by_range is not None:
            by_range.close()


class _Reads:
    """The shard reads of one stream, opened when first needed; samples read ahead wait here for their batch.

    A read yields its samples in file order; a batch may want a later sample of a read before an earlier
    one (the earlier one is kept) or a sample the reader skipped (passed over in file order: missing).
    """

    def __init__(
        self,
        reads: Sequence[tuple[int, Sequence[int]]],
        open_read: Callable[[int, list[int]], Iterator[dict[str, Any]]],
    ) -> None:
        self.reads = reads
        self.open_read = open_read
        self.read_of: dict[Ref, int] = {}
        self.left: list[int] = []  # samples each read has still to deliver
        for k, (shard, ids) in enumerate(reads):
            for i in ids:
                self.read_of[(shard, i)] = k
            self.left.append(len(ids))
        self.open: dict[int, Iterator[dict[str, Any]]] = {}
        self.got: dict[Ref, dict[str, Any]] = {}
        self.missing: set[Ref] = set()
        self.pulled: set[Ref] = set()

    def take(self, refs: Sequence[Ref]) -> list[dict[str, Any]]:
        """The samples of ``refs`` that were delivered, in batch order."""
        for ref in refs:
            self._ensure(ref)
        return [self.got.pop(ref) for ref in refs if ref in self.got]

    def close(self, k: int) -> None:
        it = self.open.pop(k, None)
        if it is not None:
            it.close()  # type: ignore[attr-defined]

    def close_all(self) -> None:
        for k in list(self.open):
            self.close(k)

    def _ensure(self, ref: Ref) -> None:
        """Read ``ref``'s shard until ``ref`` arrives or is passed over."""
        if ref in self.got or ref in self.missing:
            return
        k = self.read_of[ref]
        it = self.open.get(k)
        if it is None:
            shard, ids = self.reads[k]
            it = self.open[k] = self.open_read(shard, ids)
        for sample in it:
            r2 = (int(sample["__ref__"][0]), int(sample["__ref__"][1]))
            self.got[r2] = sample
            self.pulled.add(r2)
            self.left[k] -= 1
            if r2 == ref or r2[1] > ref[1]:
                if r2 != ref:  # file order passed it: the reader skipped it (counted in stats)
                    self.missing.add(ref)
                if self.left[k] == 0:
                    self.close(k)
                return
        self.close(k)
        shard = self.reads[k][0]
        self.missing.update((shard, i) for i in self.reads[k][1] if (shard, i) not in self.pulled)


class _SkipCounter:
    """What the reader counted since the previous batch, split into skipped samples and ignored members."""

    def __init__(self, stats: Mapping[str, int]) -> None:
        self.stats = stats  # iter_shard's counts, updated in place by every read of the stream
        self.seen: dict[str, int] = {}
        self.lost = 0
        self.reported_missing = 0

    def since_last(self, gone: int) -> tuple[dict[str, int], dict[str, int]]:
        """(skipped samples by reason, ignored members by reason) new since the last call.

        Args:
            gone: planned samples of this batch that were not delivered.
        """
        stats = self.stats
        delta = {r: n - self.seen.get(r, 0) for r, n in stats.items() if n != self.seen.get(r, 0)}
        self.seen = dict(stats)
        # A sample the reader did not deliver without counting a reason (e.g. a shard shorter than its
        # index): report it as "missing", once.
        self.lost += gone
        explained = sum(n for r, n in stats.items() if r not in MEMBER_REASONS)
        if self.lost > explained + self.reported_missing:
            delta["missing"] = self.lost - explained - self.reported_missing
            self.reported_missing = self.lost - explained
        skipped = {r: n for r, n in delta.items() if r not in MEMBER_REASONS}
        return skipped, {r: n for r, n in delta.items() if r in MEMBER_REASONS}
