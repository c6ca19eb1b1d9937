"""Indexing shards: one checking pass per shard (threads optional), cross-shard checks, the skip report.

Used by :meth:`ShardIndex.build <lightning_adaptiveload.shards.index.ShardIndex.build>` and
:meth:`~lightning_adaptiveload.shards.index.ShardIndex.for_paths`; it turns each shard's scan into a
:class:`~lightning_adaptiveload.shards.format.ShardInfo`, raising or recording every problem.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor

from tqdm.auto import tqdm

from lightning_adaptiveload.shards.format import (
    IGNORED_REASONS,
    PatchSize,
    ShardError,
    ShardInfo,
    divisibility_problem,
)
from lightning_adaptiveload.shards.paths import (
    close_quietly,
    open_shard,
)
from lightning_adaptiveload.shards.protocol import ShardIndexLike
from lightning_adaptiveload.shards.scan import (
    DATA,
    HEADERS,
    Group,
    Ignored,
    open_source,
    scan_shard,
)

__all__ = [
    "apply_patch_check",
    "check_cross_duplicates",
    "first_duplicate",
    "index_shards",
    "iter_index_shards",
    "report_skips",
]

log = logging.getLogger(__name__)


def _index_one(
    path: str,
    patch: PatchSize | None,
    on_error: str,
    check_values: bool,
    max_member_bytes: int | None = None,
) -> ShardInfo:
    info = ShardInfo(path=path, keys=[], latent_shapes=[], text_lengths=[], num_bytes=0, spans=[])

    def problem(reason: str, key: str | None, detail: str, member: str | None = None) -> None:
        if on_error == "raise":
            raise ShardError(path, key, detail, reason=reason, member=member)
        info.skipped.append({"key": key, "reason": reason, "detail": detail})

    try:
        raw = open_shard(path)
    except FileNotFoundError:
        problem("missing_shard", None, "the shard file does not exist")
        return info
    except OSError as err:
        problem("unreadable_shard", None, f"cannot open the shard ({err})")
        return info
    src = open_source(path, raw)
    groups = 0
    finished = damaged = False
    mode = DATA if check_values else HEADERS
    try:
        for event in scan_shard(src, lambda key: mode, patch, check_values, max_member_bytes):
            if isinstance(event, Group):
                groups += 1
                if event.problem is not None:
                    problem(event.problem[0], event.key, event.problem[1], event.problem_member)
                    continue
                assert event.latent is not None
                info.keys.append(event.key)
                info.latent_shapes.append(event.latent.shape)  # type: ignore[arg-type]
                info.text_lengths.append(event.text.shape[0] if event.text is not None else 0)
                info.spans.append(event.span)  # type: ignore[union-attr]
            elif isinstance(event, Ignored):
                if event.reason == "pickle_member" and on_error == "raise":
                    problem(
                        "pickle_member",
                        event.key,
                        f"member {event.member!r} is a pickle; refused, not read",
                        event.member,
                    )
                info.ignored[event.reason] = info.ignored.get(event.reason, 0) + 1
            else:
                damaged = True
                problem(event.reason, event.key, event.detail, event.member)
        finished = True
        try:
            info.num_bytes = src.drain()
            raw.close()
        except Exception as err:  # noqa: BLE001 - e.g. a pipe command that exited with an error
            if not damaged:  # the same failure seen earlier is already recorded
                problem("unreadable_shard", None, f"the shard stream failed ({err})")
    finally:
        if not finished:
            close_quietly(raw)
    if groups == 0 and not info.skipped:
        log.warning("shard %s is empty (no samples); counted as 'empty_shard'", path)
    return info


class _IndexOne:
    """``_index_one`` of a path with the other arguments fixed; picklable for worker processes."""

    def __init__(self, *args) -> None:
        self.args = args

    def __call__(self, path: str) -> ShardInfo:
        return _index_one(path, *self.args)


def index_shards(
    paths: list[str],
    patch: PatchSize | None,
    on_error: str,
    check_values: bool,
    progress: bool,
    num_workers: int,
    max_member_bytes: int | None = None,
    processes: bool = False,
) -> list[ShardInfo]:
    return list(
        iter_index_shards(
            paths, patch, on_error, check_values, progress, num_workers, max_member_bytes, processes
        )
    )


def iter_index_shards(
    paths: list[str],
    patch: PatchSize | None,
    on_error: str,
    check_values: bool,
    progress: bool,
    num_workers: int,
    max_member_bytes: int | None = None,
    processes: bool = False,
) -> Iterator[ShardInfo]:
    """Each shard's :class:`ShardInfo`, in the order of ``paths``, with a tqdm bar.

    ``num_workers > 1`` scans that many shards at once: in threads (remote shards: the wait is I/O), or
    with ``processes`` in worker processes (local shards: the header parsing is Python, bound by the GIL).
    """
    bar = tqdm(total=len(paths), unit="shard", desc="indexing shards", disable=not progress)
    samples = 0
    one = _IndexOne(patch, on_error, check_values, max_member_bytes)
    pool: Executor | None = None
    try:
        if num_workers <= 1:
            results: Iterable[ShardInfo] = (one(p) for p in paths)
        elif processes:
            # fork where there is one: a spawned worker re-imports the package (torch: seconds each). The
            # child only scans files (no torch, no locks of the parent's threads; logging re-inits its own).
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
            pool = ProcessPoolExecutor(num_workers, mp_context=context)
            results = pool.map(one, paths, chunksize=max(1, min(64, len(paths) // (8 * num_workers))))
        else:
            pool = ThreadPoolExecutor(max_workers=num_workers)
            results = pool.map(one, paths)
        for info in results:
            samples += info.num_samples
            bar.update(1)
            bar.set_postfix(samples=samples, refresh=False)
            yield info
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        bar.close()


def apply_patch_check(shards: list[ShardInfo], patch: PatchSize, on_error: str) -> None:
    for s in shards:
        details = {}
        for pos, shape in enumerate(s.latent_shapes):
            problem = divisibility_problem(shape, patch)
            if problem is not None:
                if on_error == "raise":
                    raise ShardError(s.path, s.keys[pos], problem, reason="not_divisible")
                details[pos] = problem
        if details:
            s.drop_samples(details.keys(), "not_divisible", details)


def check_cross_duplicates(shards: list[ShardInfo], on_error: str) -> None:
    """Keys listed twice, across shards or within one: raise, or keep the first and record the others."""
    first: dict[str, tuple[int, int]] = {}
    for sid, s in enumerate(shards):
        details = {}
        for pos, key in enumerate(s.keys):
            owner, at = first.setdefault(key, (sid, pos))
            if (owner, at) != (sid, pos):
                if owner == sid:
                    detail = f"key {key!r} is listed twice in this shard (samples {at} and {pos})"
                else:
                    detail = f"key {key!r} is also in shard {shards[owner].path}"
                if on_error == "raise":
                    raise ShardError(s.path, key, detail, reason="duplicate_key")
                details[pos] = detail
        if details:
            s.drop_samples(details.keys(), "duplicate_key", details)


def first_duplicate(shards: Sequence[ShardInfo]) -> tuple[str, int, int, int, int] | None:
    """The first key listed twice: ``(key, shard, position, later shard, later position)``, or None."""
    first: dict[str, tuple[int, int]] = {}
    for sid, s in enumerate(shards):
        for pos, key in enumerate(s.keys):
            owner = first.setdefault(key, (sid, pos))
            if owner != (sid, pos):
                return key, owner[0], owner[1], sid, pos
    return None


_MAX_LOGGED_SKIPS = 20


def report_skips(index: ShardIndexLike, on_error: str) -> None:
    """Log what was skipped: each of the first few, then a summary by reason."""
    skipped = index.skipped()
    for entry in skipped[:_MAX_LOGGED_SKIPS]:
        log.warning(
            "skipped %s in shard %s: %s (%s)",
            "shard" if entry["key"] is None else f"key {entry['key']!r}",
            entry["shard"],
            entry["reason"],
            entry["detail"],
        )
    counts = index.counts()
    problems = {r: n for r, n in counts.items() if r not in IGNORED_REASONS}
    if skipped:
        log.warning(
            "index: %d samples/shards skipped (on_error=%r): %s; see ShardIndex.skipped()",
            len(skipped),
            on_error,
            problems,
        )
    ignored = {r: n for r, n in counts.items() if r in IGNORED_REASONS}
    if ignored:
        log.info("index: members ignored: %s", ignored)
