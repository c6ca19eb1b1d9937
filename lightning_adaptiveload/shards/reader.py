"""Reading samples: :func:`iter_shard` streams one shard and yields its decoded, checked samples.

Only the selected samples are decoded; given the index's keys, the samples the index left out are
passed over unread and reading stops at the last wanted sample.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterator, MutableMapping, Sequence
from typing import Any

from lightning_adaptiveload.shards.format import (
    DEFAULT_PATCH,
    ShardError,
    ShardInfo,
    check_on_error,
    check_patch,
)
from lightning_adaptiveload.shards.npy import (
    to_tensor,
)
from lightning_adaptiveload.shards.paths import (
    close_quietly,
    norm_path,
    open_shard,
)
from lightning_adaptiveload.shards.scan import (
    DATA,
    HEADERS,
    SKIP,
    BytesSource,
    FileSource,
    Group,
    Ignored,
    ShardProblem,
    StreamSource,
    open_source,
    scan_shard,
)

__all__ = ["iter_range", "iter_shard"]

log = logging.getLogger(__name__)


def iter_shard(
    path: str | os.PathLike | ShardInfo,
    shard_id: int = 0,
    select: Collection[int] | None = None,
    on_error: str = "raise",
    stats: MutableMapping[str, int] | None = None,
    *,
    keys: Sequence[str] | None = None,
    patch_size: Sequence[int] | None = DEFAULT_PATCH,
    max_member_bytes: int | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    text_lengths: Sequence[int] | None = None,
) -> Iterator[dict[str, Any]]:
    """Stream one shard in file order and yield its decoded samples.

    The tar is read as a stream (local file, ``file://``, or any URL webdataset's ``gopen`` opens);
    only the selected samples' data is read and decoded. Every yielded latent and text array is checked
    finite. Never unpickles.

    Sample ids: pass the index's keys for this shard (``keys=index.shards[shard_id].keys``, or pass the
    :class:`ShardInfo` itself as ``path``); then sample ids are exactly the index's positions, samples the
    index left out are passed over unread and uncounted, and reading stops as soon as every wanted
    sample was yielded. Given a :class:`ShardInfo` (or ``shapes``), every sample read must have the
    latent shape the index lists (and its text length, where the index lists one): the planner sized the
    batches from them, so a sample that differs is ``shape_mismatch``, found from its ``.npy`` header
    before its values are decoded. Without ``keys``, ids count the samples that pass this reader's checks in file
    order, which equals the index's numbering only when the index skipped nothing in this shard.

    Args:
        path: the shard's path or URL, or its :class:`ShardInfo`.
        shard_id: the shard's position in the index (copied into ``__ref__``).
        select: sample ids to yield (others are not decoded), or None for all.
        keys: the shard's keys in the index (see above).
        on_error: ``"raise"`` a :class:`ShardError`, or ``"skip"`` the sample, count it in ``stats`` and
            log a warning.
        stats: a dict updated in place with counts by reason (skipped samples, ``empty_shard``, ignored
            members such as ``unknown_extension``).
        patch_size: (pt, ph, pw) the latent must be divisible by, or None.
        max_member_bytes: the largest member (bytes) read; a larger claim is refused
            (``member_too_large``) before anything is allocated. None: :data:`MAX_MEMBER_BYTES`.
        shapes, text_lengths: the latent shapes and text lengths the index lists for ``keys`` (taken
            from a :class:`ShardInfo` given as ``path``); None: not checked.

    Yields:
        ``{"__key__": str, "__shard__": str, "__ref__": (shard_id, sample_id),
        "latent": Tensor (C, T, H, W) float16/float32, "text": Tensor (L, D_text) | None,
        "meta": dict | None}``. Tensors own their memory (one copy out of the tar stream).

    Raises:
        ShardError: under ``on_error="raise"``, naming the shard, key and problem.
    """
    if isinstance(path, ShardInfo):
        if keys is None:
            keys = path.keys
            shapes = path.latent_shapes if shapes is None else shapes
            text_lengths = path.text_lengths if text_lengths is None else text_lengths
        path = path.path
    check_on_error(on_error)
    patch = check_patch(patch_size)
    read = _ShardRead(norm_path(path), shard_id, select, keys, on_error, stats)
    expect_for = None
    if shapes is not None and keys is not None:
        if len(shapes) != len(keys) or (text_lengths is not None and len(text_lengths) != len(keys)):
            raise ValueError(
                f"shard {read.label}: keys, shapes and text_lengths must have one entry per sample"
            )
        expect_for = read.expectation(shapes, text_lengths)
    if read.remaining is not None and not read.remaining:
        return  # nothing selected
    try:
        raw = open_shard(read.label)
    except FileNotFoundError:
        read.problem("missing_shard", None, "the shard file does not exist")
        return
    except OSError as err:
        read.problem("unreadable_shard", None, f"cannot open the shard ({err})")
        return
    src = open_source(read.label, raw)
    finished = False  # read to the end or to the last wanted sample, without an exception
    scan = scan_shard(src, read.mode_for, patch, True, max_member_bytes, expect_for)
    try:
        for event in scan:
            sample = read.on_event(event)
            if sample is not None:
                yield sample
            if read.remaining is not None and not read.remaining:
                break  # every wanted sample was yielded
        else:
            finished = True
            read.finish(src, raw)
    finally:
        scan.close()
        if not finished:
            # After an early stop or an error a pipe's writer may exit with SIGPIPE: not worth reporting.
            close_quietly(raw)


def iter_range(
    info: ShardInfo,
    shard_id: int,
    select: Collection[int],
    data: bytes,
    where: str,
    *,
    on_error: str = "raise",
    stats: MutableMapping[str, int] | None = None,
    patch_size: Sequence[int] | None = DEFAULT_PATCH,
    max_member_bytes: int | None = None,
    key_pos: dict[str, int] | None = None,
) -> Iterator[dict[str, Any]]:
    """The samples ``select`` of ``info``'s shard out of ``data``, bytes a ranged read fetched.

    ``data`` is a run of whole tar members (from a sample span's start to a span's end, see
    :mod:`~lightning_adaptiveload.shards.spans`); it is scanned with :func:`iter_shard`'s checks (key
    rules, size caps, ``.npy`` headers, the index's shapes, finiteness; never unpickled) and yields the
    same dicts, in file order. A selected sample the bytes do not hold is ``stale_index``; a member that
    runs past them is ``truncated_tar``.

    Args:
        info: the shard's index entry (its keys, shapes and text lengths).
        shard_id, select, on_error, stats, patch_size, max_member_bytes: as for :func:`iter_shard`.
        data: the fetched bytes.
        where: the range, for messages (e.g. ``"bytes 0-30719"``).
        key_pos: ``{key: sample id}`` of the shard, if the caller keeps one (built here otherwise).
    """
    check_on_error(on_error)
    patch = check_patch(patch_size)
    read = _ShardRead(info.path, shard_id, select, info.keys, on_error, stats, key_pos=key_pos)
    if not read.remaining:
        return
    # A problem of the bytes as a whole (not a tar, a member cut off) concerns this range's samples:
    # name them and the range, never "the whole shard".
    planned = [info.keys[i] for i in sorted(read.remaining)]
    first = planned[0]
    if len(planned) > 1:
        first += f" (and {len(planned) - 1} more samples: {planned[1:4]})"
    read.in_range = (first, where)
    expect_for = read.expectation(info.latent_shapes, info.text_lengths)
    src = BytesSource(data)
    scan = scan_shard(src, read.mode_for, patch, True, max_member_bytes, expect_for)
    try:
        for event in scan:
            sample = read.on_event(event)
            if sample is not None:
                yield sample
            if not read.remaining:
                return
        read.finish(src, src, where=where)
    finally:
        scan.close()


class _ShardRead:
    """The bookkeeping of one :func:`iter_shard` call: which samples to read, ids, counts, problems."""

    def __init__(
        self,
        label: str,
        shard_id: int,
        select: Collection[int] | None,
        keys: Sequence[str] | None,
        on_error: str,
        stats: MutableMapping[str, int] | None,
        key_pos: dict[str, int] | None = None,
    ) -> None:
        self.label, self.shard_id, self.on_error = label, shard_id, on_error
        self.counts: MutableMapping[str, int] = stats if stats is not None else {}
        self.wanted: set[int] | None = None if select is None else {int(i) for i in select}
        if key_pos is None and keys is not None:
            key_pos = {k: i for i, k in enumerate(keys)}
        self.key_pos = key_pos
        if self.key_pos is not None and self.wanted and max(self.wanted) >= len(self.key_pos):
            raise ValueError(
                f"select has sample ids up to {max(self.wanted)} but shard {label} has {len(self.key_pos)} samples"
            )
        # Ids still to yield; None = read to the end of the shard.
        self.remaining: set[int] | None = (
            set(self.wanted)
            if self.wanted is not None
            else (set(range(len(self.key_pos))) if self.key_pos is not None else None)
        )
        self.count = 0  # valid samples seen, without keys: the sample id of the next one
        self.groups = 0
        self.damaged = False
        self.in_range: tuple[str, str] | None = None  # (planned keys, "bytes a-b") of a ranged read

    def mode_for(self, key: str) -> int:
        if self.key_pos is not None:
            sid = self.key_pos.get(key)
            return DATA if sid is not None and sid in self.remaining else SKIP  # type: ignore[operator]
        return DATA if self.wanted is None or self.count in self.wanted else HEADERS

    def expectation(
        self, shapes: Sequence[Sequence[int]], text_lengths: Sequence[int] | None
    ) -> Callable[[str], tuple[tuple[int, ...], int] | None]:
        """``expect_for`` of :func:`scan_shard`: the index's (shape, text length) of a key."""
        key_pos = self.key_pos or {}

        def expect_for(key: str) -> tuple[tuple[int, ...], int] | None:
            sid = key_pos.get(key)
            if sid is None:
                return None
            return tuple(shapes[sid]), int(text_lengths[sid]) if text_lengths is not None else 0

        return expect_for

    def problem(self, reason: str, key: str | None, detail: str, member: str | None = None) -> None:
        if self.in_range is not None:
            key = key if key is not None else self.in_range[0]
            member = f"{member} in {self.in_range[1]}" if member else self.in_range[1]
        if self.on_error == "raise":
            raise ShardError(self.label, key, detail, reason=reason, member=member)
        self.counts[reason] = self.counts.get(reason, 0) + 1
        log.warning(
            "skipped %s in shard %s: %s (%s)",
            "shard" if key is None else f"key {key!r}",
            self.label,
            reason,
            detail,
        )

    def on_event(self, event: Group | Ignored | ShardProblem) -> dict[str, Any] | None:
        """Count or report one scan event; the decoded sample when it is one to yield."""
        if isinstance(event, Ignored):
            if event.reason == "pickle_member" and self.on_error == "raise":
                self.problem(
                    "pickle_member",
                    event.key,
                    f"member {event.member!r} is a pickle; refused, not read",
                    event.member,
                )
            if event.reason == "pickle_member":
                # A refused member, not a lost sample: the key's other members are still read.
                log.warning("refused member %r in shard %s: a pickle, never loaded", event.member, self.label)
            self.counts[event.reason] = self.counts.get(event.reason, 0) + 1
            return None
        if isinstance(event, ShardProblem):
            self.damaged = True
            self.problem(event.reason, event.key, event.detail, event.member)
            return None
        self.groups += 1
        if event.mode == SKIP:
            return None
        return self._on_sample(event)

    def _on_sample(self, event: Group) -> dict[str, Any] | None:
        sid = -1
        if self.key_pos is not None:
            sid = self.key_pos[event.key]
            self.remaining.discard(sid)  # type: ignore[union-attr]
        if event.problem is not None:
            self.problem(event.problem[0], event.key, event.problem[1], event.problem_member)
            return None
        if self.key_pos is None:
            sid = self.count
            self.count += 1
        if self.wanted is not None and sid not in self.wanted:
            return None
        if self.key_pos is None and self.remaining is not None:
            self.remaining.discard(sid)
        latent, text = event.latent, event.text
        assert latent is not None
        return {
            "__key__": event.key,
            "__shard__": self.label,
            "__ref__": (self.shard_id, sid),
            "latent": to_tensor(latent),
            "text": to_tensor(text) if text is not None else None,
            "meta": event.meta,
        }

    def finish(self, src: StreamSource | FileSource, raw: Any, where: str | None = None) -> None:
        """After the whole shard (or, ``where``, a fetched range of it) was read: close the stream, count an
        empty shard, report what was not found."""
        try:
            src.drain()  # let a pipe's writer finish cleanly
            raw.close()
        except Exception as err:  # noqa: BLE001 - e.g. a pipe command that exited with an error
            if not self.damaged:  # the same failure seen earlier is already counted
                self.damaged = True
                self.problem("unreadable_shard", None, f"the shard stream failed ({err})")
        if self.groups == 0 and not self.damaged and where is None:
            self.counts["empty_shard"] = self.counts.get("empty_shard", 0) + 1
            log.warning("shard %s is empty (no samples); counted as 'empty_shard'", self.label)
        if self.remaining:
            if self.key_pos is not None:
                inv = {i: k for k, i in self.key_pos.items()}
                missing = sorted(inv[i] for i in self.remaining)
                detail = f"{len(missing)} samples listed in the index were not found: {missing[:5]}"
                if where is not None:
                    detail += f" (in {where} of the shard, where the index places them)"
            else:
                detail = f"the shard has no valid samples with ids {sorted(self.remaining)[:5]}"
            self.problem("stale_index", None, detail)
