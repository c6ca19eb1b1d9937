"""Mid-epoch resume: the saved data position's layout and versions, and the replay that plans the rest of
the epoch.

The DataModule saves, per epoch, its *segments*: the plan settings of each run of the epoch and how many
batches every rank consumed in it. :func:`read_state` reads a saved state of any version this release
reads into the current layout (:func:`_migrate_state`, the one place where older layouts are translated)
and checks it; :func:`resume_plan` replays its segments (re-planning each with the samples consumed before
it left out) and continues the last plan where it stopped, or re-plans the remaining samples when the
world size changed or the ranks stopped at different batches. Pure (no Lightning).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_adaptiveload import _dist
from lightning_adaptiveload.planning.plan import EpochPlan
from lightning_adaptiveload.planning.resume import ConsumedMask, consumed_digest, continue_plan, mark_consumed

__all__ = [
    "MAX_NUM_WORKERS",
    "MAX_WORLD_SIZE",
    "STATE_VERSION",
    "ResumeStateError",
    "Resumed",
    "check_state",
    "consumed_mask",
    "digest_text",
    "position_state",
    "read_state",
    "resume_plan",
]

log = logging.getLogger(__name__)

#: Version of ``AdaptiveLoadDataModule.state_dict()``'s layout. 2 adds each segment's ``digest`` of the
#: samples it consumed; 3 adds ``digests``, each rank's part of it (so that a rank resuming at its position
#: checks its own part without the other ranks' plans); 4 (release 0.2.0) names each segment's schedule
#: ``schedule`` (``mode`` before) and always holds its ``lockstep_tail`` and ``chunk_samples``. Versions 1
#: to 3 are still read: :func:`_migrate_state` brings them to this layout.
STATE_VERSION = 4
_READS = (1, 2, 3, 4)
#: The plan settings every segment of the current layout holds (besides its kind and counts).
_SEGMENT_KEYS = (
    "kind",
    "world_size",
    "num_workers",
    "seed",
    "schedule",
    "batcher",
    "max_buffered_samples",
    "lockstep_tolerance",
    "lockstep_tail",
    "chunk_samples",
    "consumed",
)
#: Bounds on a saved segment's settings: beyond them the replay would plan for a machine that does not
#: exist (``world_size=10**9`` ran into MemoryError).
MAX_WORLD_SIZE = 1 << 16
MAX_NUM_WORKERS = 1 << 10
_MAX_STREAMS = 1 << 18  # ranks x workers of one saved plan
_MAX_SEGMENTS = 1 << 12  # resumes within one epoch
_MAX_COUNT = 1 << 40  # batches consumed by one rank in one segment
#: "refit": the rest of an epoch planned mid-epoch with a refit cost model (``loading/replan.py``), on the same ranks.
_KINDS = ("fresh", "continue", "replan", "refit")
_WHAT_TO_DO = (
    "What to do: resume from another checkpoint, or drop the datamodule's entry from the checkpoint to start "
    "the epoch afresh"
)


class ResumeStateError(ValueError):
    """A resume state that cannot be used; the message names the field, the rule and what to do."""


def _bad(where: str, problem: str) -> ResumeStateError:
    return ResumeStateError(f"AdaptiveLoadDataModule resume state: {where} {problem}. {_WHAT_TO_DO}")


def _describe(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def _int(value: Any, where: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise _bad(where, f"is {_describe(value)}; expected an integer in [{lo}, {hi}]")
    return value


def digest_text(value: int) -> str:
    """A :func:`consumed_digest` as saved in the state: 16 hex digits."""
    return f"{value & ((1 << 64) - 1):016x}"


def _migrate_state(version: int, state: Mapping[str, Any]) -> dict[str, Any]:
    """``state``, saved in the layout of ``version``, in the layout of :data:`STATE_VERSION`: the one place
    where the key names and defaults of older layouts are translated. A copy (``state`` is left as it was);
    what is not where the layout puts it is left for :func:`read_state`'s checks to name.

    Versions 1 to 3 (releases up to 0.1.0) to 4:

    * a segment's ``mode`` (its schedule) is ``schedule``;
    * a segment's batcher settings name the sizing rule ``sizing`` (``mode`` in states written before the
      sizing rule was named so);
    * a segment saved without ``lockstep_tail`` was planned before the packed tail existed: ``"bucketed"``;
      one without ``chunk_samples`` before chunked planning existed: ``None`` (planned at once); one
      without ``max_buffered_samples`` or ``lockstep_tolerance``: their defaults (None and 0.05).
    """
    out = dict(state)
    if version >= STATE_VERSION or not isinstance(state.get("segments"), list):
        return out
    segments = []
    for seg in state["segments"]:
        if isinstance(seg, Mapping):
            seg = dict(seg)
            if "mode" in seg and "schedule" not in seg:
                seg["schedule"] = seg.pop("mode")
            batcher = seg.get("batcher")
            if isinstance(batcher, Mapping) and "mode" in batcher and "sizing" not in batcher:
                batcher = dict(batcher)
                batcher["sizing"] = batcher.pop("mode")
                seg["batcher"] = batcher
            seg.setdefault("lockstep_tail", "bucketed")
            seg.setdefault("chunk_samples", None)
            seg.setdefault("max_buffered_samples", None)
            seg.setdefault("lockstep_tolerance", 0.05)
        segments.append(seg)
    out["segments"] = segments
    out["version"] = STATE_VERSION
    return out


def read_state(state: Any, source: str | None = None) -> dict[str, Any]:
    """A saved resume state (``AdaptiveLoadDataModule.state_dict()``, of any version this release reads) in
    the current layout (:func:`_migrate_state`), its layout, types and ranges checked.

    Args:
        source: where the state was read (``"checkpoint last.ckpt, key 'AdaptiveLoadDataModule'"``), put
            at the front of every error's message.

    Raises:
        ResumeStateError: (a ``ValueError``) naming the field (``segments[1].world_size``), its value and
            the rule, and saying what to do; or a version this release does not read.
    """
    if source is None:
        return _read_state(state)
    try:
        return _read_state(state)
    except ResumeStateError as err:
        raise ResumeStateError(f"{source}: {err}") from None


def _read_state(state: Any) -> dict[str, Any]:
    if not isinstance(state, Mapping):
        raise _bad("the state", f"is {_describe(state)}, not a dict")
    if state.get("version") not in _READS or type(state.get("version")) is not int:
        raise ResumeStateError(
            f"AdaptiveLoadDataModule state version {state.get('version')!r} is not supported "
            f"(this version reads {list(_READS)}); resume without the datamodule state or from a newer checkpoint"
        )
    state = _migrate_state(state["version"], state)
    _check_layout(state)
    return state


def check_state(state: Any) -> None:
    """Check a saved resume state as :func:`read_state` reads it (any version this release reads).

    Raises:
        ResumeStateError: as :func:`read_state`.
    """
    read_state(state)


def _check_layout(state: Mapping[str, Any]) -> None:
    """Check the layout, types and ranges of a resume state in the current layout."""
    if not isinstance(state.get("fingerprint"), str):
        raise _bad("fingerprint", f"is {_describe(state.get('fingerprint'))}, not a string")
    _int(state.get("epoch"), "epoch", 0, 1 << 40)
    segments = state.get("segments")
    if not isinstance(segments, list) or not 1 <= len(segments) <= _MAX_SEGMENTS:
        raise _bad("segments", f"is {_describe(segments)}; expected a list of 1 to {_MAX_SEGMENTS} segments")
    for i, seg in enumerate(segments):
        where = f"segments[{i}]"
        if not isinstance(seg, Mapping):
            raise _bad(where, f"is {_describe(seg)}, not a dict")
        missing = [k for k in _SEGMENT_KEYS if k not in seg]
        if missing:
            raise _bad(where, f"lacks {missing}")
        if seg["kind"] not in _KINDS:
            raise _bad(f"{where}.kind", f"is {_describe(seg['kind'])}; expected one of {list(_KINDS)}")
        world = _int(seg["world_size"], f"{where}.world_size", 1, MAX_WORLD_SIZE)
        workers = _int(seg["num_workers"], f"{where}.num_workers", 0, MAX_NUM_WORKERS)
        if world * max(1, workers) > _MAX_STREAMS:
            raise _bad(
                where,
                f"has {world} ranks x {workers} workers = {world * max(1, workers)} streams to replay; at most "
                f"{_MAX_STREAMS}",
            )
        _int(seg["seed"], f"{where}.seed", -(1 << 63), (1 << 64) - 1)
        if not isinstance(seg["schedule"], str):
            raise _bad(f"{where}.schedule", f"is {_describe(seg['schedule'])}, not a schedule name")
        if not isinstance(seg["batcher"], Mapping):
            raise _bad(f"{where}.batcher", f"is {_describe(seg['batcher'])}, not a dict")
        if seg.get("max_buffered_samples") is not None:
            _int(seg["max_buffered_samples"], f"{where}.max_buffered_samples", 0, _MAX_COUNT)
        if seg.get("chunk_samples") is not None:
            _int(seg["chunk_samples"], f"{where}.chunk_samples", 1, _MAX_COUNT)
        tol = seg["lockstep_tolerance"]
        if isinstance(tol, bool) or not isinstance(tol, int | float) or not (math.isfinite(tol) and tol >= 0):
            raise _bad(f"{where}.lockstep_tolerance", f"is {_describe(tol)}; expected a finite number >= 0")
        if not isinstance(seg["lockstep_tail"], str):
            raise _bad(f"{where}.lockstep_tail", f"is {_describe(seg['lockstep_tail'])}, not a string")
        consumed = seg["consumed"]
        if not isinstance(consumed, list) or len(consumed) != world:
            raise _bad(
                f"{where}.consumed",
                f"is {_describe(consumed)}; expected a list of {world} batch counts, one per rank of "
                f"{where}.world_size = {world}",
            )
        for r, c in enumerate(consumed):
            _int(c, f"{where}.consumed[{r}]", 0, _MAX_COUNT)
        if not _is_digest(seg.get("digest")):
            raise _bad(
                f"{where}.digest", f"is {_describe(seg.get('digest'))}; expected 16 hex digits or null"
            )
        digests = seg.get("digests")
        if digests is not None:
            if not isinstance(digests, list) or len(digests) != world:
                raise _bad(
                    f"{where}.digests",
                    f"is {_describe(digests)}; expected a list of {world} digests or nulls",
                )
            for r, d in enumerate(digests):
                if not _is_digest(d):
                    raise _bad(f"{where}.digests[{r}]", f"is {_describe(d)}; expected 16 hex digits or null")


def _is_digest(value: Any) -> bool:
    return value is None or (
        isinstance(value, str) and len(value) == 16 and all(ch in "0123456789abcdef" for ch in value)
    )


@dataclass
class Resumed:
    """The rest of a resumed epoch.

    Attributes:
        plan: the plan of the batches still to run on this rank (``plan.rank``: a rank-local plan).
        segments: the saved segments plus the new one (its ``consumed`` still None).
        segment_base: batches consumed before the new segment (the fit loop's restored count).
        kind: ``"continue"`` (the last plan, continued at its position) or ``"replan"`` (the rest planned
            afresh).
        consumed_samples: samples consumed before the new segment, on every rank (``"replan"``) or on this
            rank (``"continue"``: the other ranks' plans are never made).
    """

    plan: EpochPlan
    segments: list[dict[str, Any]]
    segment_base: int
    kind: str
    consumed_samples: int


def resume_plan(ds: Any, state: Mapping[str, Any], allow_unverified: bool = False) -> Resumed:
    """Plan what is left of ``state["epoch"]`` for this rank (``ds.rank``).

    Where every segment of the epoch ran on this world size and ended with every rank at the same step
    (a fresh plan, continued, maybe with other worker counts), the rest is this rank's own plan continued
    at its position: the cost of a fresh epoch start (one rank-local plan), whatever the world size. Else
    (another world size now, ranks stopped at different steps, or the epoch was replanned before) the
    consumed samples are found by replaying each saved rank's own plan in turn, one flag per sample
    (:class:`~lightning_adaptiveload.planning.resume.ConsumedMask`), and the rest is planned afresh
    without them: the memory of one rank-local plan and one byte per sample, the time of one rank-local
    plan per saved rank.

    Args:
        ds: the :class:`~lightning_adaptiveload.loading.loader.PlannedShardDataset` to resume (its
            ``rank``, ``world_size`` and ``num_workers`` are the new run's).
        state: ``AdaptiveLoadDataModule.state_dict()``'s dict.
        allow_unverified: resume a segment that holds no digest this replay can check (a version 1
            state, or one whose digests are all null), with a warning naming what may be repeated or lost
            (``Loader(resume_unverified=True)``); else such a state is refused.

    Raises:
        ResumeStateError: a malformed state (:func:`read_state`), a segment that cannot be replayed, one
            whose replay consumed other samples than were consumed (its digest differs), or one with no
            digest to check (unless ``allow_unverified``).
        ValueError: the state belongs to other shards (another index fingerprint).
    """
    state = read_state(state)
    if state["fingerprint"] != ds.fingerprint:
        raise ValueError(
            "the checkpoint's data position belongs to other shards (index fingerprint "
            f"{state['fingerprint']} vs {ds.fingerprint} now): resume with the same shards, or drop the "
            "datamodule state from the checkpoint to start the epoch afresh"
        )
    segments = [dict(s) for s in state["segments"]]
    refit = _continues_refit(segments, ds.world_size)
    if _continues(segments, ds.world_size):
        plan, consumed_samples = _continue_at_position(
            ds, int(state["epoch"]), segments, allow_unverified=allow_unverified
        )
        kind = "continue"
    elif refit is not None:
        # The epoch was replanned mid-epoch with a refit model and ran on since: continue that plan.
        plan, consumed_samples = _continue_refit(ds, int(state["epoch"]), segments, refit, allow_unverified)
        kind = "continue"
    else:
        plan, consumed_samples = _replan_rest(ds, int(state["epoch"]), segments, allow_unverified)
        kind = "replan"
    return Resumed(
        plan=plan,
        segments=segments + [{"kind": kind, **ds.plan_settings(), "consumed": None}],
        # Lightning restores its processed-batch count to the total consumed so far (equal on all ranks).
        segment_base=sum(max(int(x) for x in s["consumed"]) for s in segments),
        kind=kind,
        consumed_samples=consumed_samples,
    )


def _continues(segments: list[dict[str, Any]], world: int) -> bool:
    """Whether the epoch is its first plan, continued: every segment on ``world`` ranks, each ending with
    every rank at the same step, every segment after the first a continuation."""
    return all(
        int(seg["world_size"]) == world
        and len(set(seg["consumed"])) == 1
        and (seg["kind"] == "continue" if i else seg["kind"] != "continue")
        for i, seg in enumerate(segments)
    ) and not any(seg["kind"] in ("replan", "refit") for seg in segments)


def _continues_refit(segments: list[dict[str, Any]], world: int) -> int | None:
    """The index of the last segment when it is a mid-epoch replan (kind ``"refit"``) continued on ``world``
    ranks since, every rank at the same step at the end of each of those segments; else None."""
    b = max(i for i, seg in enumerate(segments) if seg["kind"] != "continue" or i == 0)
    if segments[b]["kind"] != "refit":
        return None
    same = all(int(seg["world_size"]) == world and len(set(seg["consumed"])) == 1 for seg in segments[b:])
    return b if same else None


def _continue_refit(
    ds: Any, epoch: int, segments: list[dict[str, Any]], b: int, allow_unverified: bool = False
) -> tuple[EpochPlan, int]:
    """This rank's plan of the refit segment ``b`` (its saved settings and cost model, without the samples
    the segments before it consumed: replayed, :func:`consumed_mask`), continued at its position."""
    gone = consumed_mask(ds, epoch, segments[:b], allow_unverified)
    plan, consumed = _continue_at_position(
        ds, epoch, segments[b:], exclude=gone or None, first=b, allow_unverified=allow_unverified
    )
    return plan, consumed + gone.total()


def _digest_error(i: int, seg: Mapping[str, Any], saved: str, replayed: str) -> ResumeStateError:
    return ResumeStateError(
        f"AdaptiveLoadDataModule resume state: segments[{i}] consumed other samples than its replay "
        f"gives (digest {saved} saved, {replayed} replayed): the saved plan settings (seed "
        f"{seg['seed']}, schedule {seg['schedule']!r}, batcher) or the planner changed since the "
        "checkpoint, so resuming would repeat some samples and skip others. What to do: resume with "
        "the version and settings that saved it, or drop the datamodule's entry from the checkpoint "
        "to start the epoch afresh"
    )


def _part(plan: EpochPlan, rank: int, start: int, stop: int) -> int:
    """The digest of ``rank``'s steps ``start <= k < stop`` in ``plan`` (digests are additive mod 2^64)."""
    return consumed_digest(plan, {rank: stop}) - consumed_digest(plan, {rank: start})


def _plan_of(ds: Any, epoch: int, i: int, seg: Mapping[str, Any], rank: int, exclude: Any) -> EpochPlan:
    try:
        return ds.make_plan(epoch, seg, exclude=exclude, rank=rank)
    except (TypeError, ValueError, KeyError) as err:
        raise _bad(f"segments[{i}]", f"cannot be replayed ({type(err).__name__}: {err})") from None


def _unverified(i: int, seg: Mapping[str, Any], what: str, allow: bool, rank: int) -> None:
    """Refuse segment ``i`` whose saved state holds no digest this replay can check, or, with ``allow``
    (``Loader(resume_unverified=True)``), warn naming what may be repeated or lost."""
    counts = [int(c) for c in seg["consumed"]]
    field = f"segments[{i}].digest and segments[{i}].digests"
    if not allow:
        raise ResumeStateError(
            f"AdaptiveLoadDataModule resume state: {field} hold no digest that the replay on rank {rank} can "
            f"check ({what}), so the {sum(counts)} consumed batches (per rank {counts}) cannot be verified: "
            "if the seed, the plan settings or the planner changed since the checkpoint, resuming would repeat "
            "some samples and skip others silently. What to do: resume from a checkpoint that holds the "
            "digests, drop the datamodule's entry from the checkpoint to start the epoch afresh, or accept "
            "the risk with Loader(resume_unverified=True)"
        )
    log.warning(
        "resume_unverified: %s hold no digest that rank %d can check (%s): the replay of the %d consumed "
        "batches (per rank %s, seed %s, schedule %r) is not verified; if the seed, the settings or the "
        "planner changed since the checkpoint, up to that many batches' samples may be read again this epoch "
        "and as many never",
        field,
        rank,
        what,
        sum(counts),
        counts,
        seg["seed"],
        seg["schedule"],
    )


def _continue_at_position(
    ds: Any,
    epoch: int,
    segments: list[dict[str, Any]],
    exclude: Any = None,
    first: int = 0,
    allow_unverified: bool = False,
) -> tuple[EpochPlan, int]:
    """This rank's plan of ``segments[0]`` (without ``exclude``), continued after the steps every segment
    consumed. Each segment is verified by one digest its replay must reproduce: this rank's part
    (``digests[rank]``, version 3 and later) where saved; else the whole segment's ``digest`` (every
    rank's plan replayed, any world size); else another rank's saved part (its plan replayed: the same
    settings and planner give every rank's plan). A segment with none is refused unless
    ``allow_unverified``. ``first``: the index of ``segments[0]`` in the saved state (for the messages)."""
    rank = int(ds.rank)
    plan = _plan_of(ds, epoch, first, segments[0], rank, exclude)
    done = 0
    for i, seg in enumerate(segments, start=first):
        k = int(seg["consumed"][0])
        if done + k > plan.steps:
            raise _bad(
                f"segments[{i}].consumed", f"is {k} steps after {done}, but the epoch has {plan.steps}"
            )
        world = int(seg["world_size"])
        digests = seg.get("digests") or [None] * world
        saved = digests[rank] if rank < len(digests) else None
        if saved is not None:
            replayed = digest_text(_part(plan, rank, done, done + k))
            if replayed != saved:
                raise _digest_error(i, seg, saved, replayed)
        elif seg.get("digest") is not None:
            # The whole segment's digest: every rank's part, from its own plan (the same steps on each).
            total = _part(plan, rank, done, done + k)
            for r in range(world):
                if r != rank:
                    other = _plan_of(ds, epoch, first, segments[0], r, exclude)
                    total += _part(other, r, done, done + k)
                    del other
            replayed = digest_text(total)
            if replayed != seg["digest"]:
                raise _digest_error(i, seg, seg["digest"], replayed)
        else:
            r = next((r for r, d in enumerate(digests) if d is not None), None)
            if r is None:
                what = "the whole digest is null and every rank's part is null or absent"
                _unverified(i, seg, what, allow_unverified, rank)
            else:
                other = _plan_of(ds, epoch, first, segments[0], r, exclude)
                replayed = digest_text(_part(other, r, done, done + k))
                del other
                if replayed != digests[r]:
                    raise _digest_error(i, seg, digests[r], replayed)
        done += k
    consumed = sum(len(plan.streams[(rank, w)][j]) for w, j in plan.step_order[rank][:done])
    return continue_plan(plan, done, ds.num_workers), consumed


def _replan_rest(
    ds: Any, epoch: int, segments: list[dict[str, Any]], allow_unverified: bool = False
) -> tuple[EpochPlan, int]:
    """The rest of the epoch planned for this rank without the samples the segments consumed."""
    gone = consumed_mask(ds, epoch, segments, allow_unverified)
    return ds.make_plan(epoch, exclude=gone or None, local=True), gone.total()


def consumed_mask(
    ds: Any, epoch: int, segments: list[dict[str, Any]], allow_unverified: bool = False
) -> ConsumedMask:
    """The samples ``segments`` (with their ``consumed`` counts) consumed in ``epoch``, one flag per sample.

    Replays every saved rank's plan of every segment, one rank at a time (the time of one rank-local plan per
    rank and segment), checking each part against its saved digest and the whole segment's digest.

    Raises:
        ResumeStateError: a segment cannot be replayed, its replay consumed other samples (digest), or it
            holds no digest at all (neither the whole nor any rank's part) and not ``allow_unverified``.
    """
    gone = ConsumedMask.of_index(ds.index)
    base_gone = gone.copy()  # what was consumed before the plan the current segment continues
    base = 0
    for i, seg in enumerate(segments):
        if seg["kind"] != "continue" or i == 0:
            base, base_gone = i, gone.copy()
        elif int(seg["world_size"]) != int(segments[base]["world_size"]):
            raise _bad(f"segments[{i}]", "continues a plan of another world size")
        consumed = [int(x) for x in seg["consumed"]]
        total = 0
        digests = seg.get("digests")
        if seg.get("digest") is None and not any(d is not None for d in digests or []):
            what = "the whole digest is null and every rank's part is null or absent"
            _unverified(i, seg, what, allow_unverified, int(ds.rank))
        for r, k in enumerate(consumed):
            # Where this rank's plan of the base segment stood when segment i began.
            start = sum(int(segments[j]["consumed"][r]) for j in range(base, i))
            plan = _plan_of(ds, epoch, i, segments[base], r, base_gone or None)
            if not start + k <= plan.steps:
                raise _bad(
                    f"segments[{i}].consumed[{r}]",
                    f"is {k} steps after {start}, but the plan has {plan.steps}",
                )
            part = _part(plan, r, start, start + k)
            total += part
            if digests is not None and digests[r] is not None and digest_text(part) != digests[r]:
                raise _digest_error(i, seg, digests[r], digest_text(part))
            mark_consumed(gone, plan, r, start, start + k)
            del plan
        if seg.get("digest") is not None and digest_text(total) != seg["digest"]:
            raise _digest_error(i, seg, seg["digest"], digest_text(total))
    return gone


def position_state(ds: Any, segments: list[dict[str, Any]], mine: int) -> dict[str, Any]:
    """``AdaptiveLoadDataModule.state_dict``'s value: the epoch's segments with the last one's consumed counts
    and digests. ``ds``: the training dataset (its plan, rank, world size, epoch, fingerprint); ``mine``: the
    batches this rank consumed in the last segment. Gathers every rank's count and digest part (a collective
    where a process group is up: every rank must call it).
    """
    # This rank's part of the digest of the consumed samples (parts add up; see consumed_digest),
    # gathered with the counts in the same collective, as two 32-bit halves (exact in float64).
    part = consumed_digest(ds.plan, {ds.rank: mine}) if ds.plan.rank in (None, ds.rank) else None
    digest: int | None
    if _dist.is_distributed() and ds.world_size > 1:
        # One row per data rank: under sequence parallelism a group's GPUs share its position.
        rows = _dist.all_gather_floats_by_group(
            [float(mine), float((part or 0) >> 32), float((part or 0) & 0xFFFFFFFF)], ds.world_size
        )
        consumed = [int(r[0]) for r in rows]
        parts = [(int(r[1]) << 32) + int(r[2]) if part is not None else None for r in rows]
    else:
        consumed = [mine] * ds.world_size
        if ds.plan.rank is None:  # a plan of every rank: all parts are here
            parts = [consumed_digest(ds.plan, {r: c}) for r, c in enumerate(consumed)]
        else:  # other ranks' plans are elsewhere and no collective reaches them: only this rank's part
            parts = [part if r == ds.rank else None for r in range(ds.world_size)]
    digest = sum(parts) if None not in parts else None  # type: ignore[arg-type]
    if len(set(consumed)) > 1:
        log.warning(
            "ranks consumed different numbers of batches this epoch (%s); resume re-plans the rest",
            consumed,
        )
    segments = [dict(s) for s in segments]
    segments[-1]["consumed"] = consumed
    segments[-1]["digest"] = None if digest is None else digest_text(digest)
    segments[-1]["digests"] = [None if d is None else digest_text(d) for d in parts]
    return {
        "version": STATE_VERSION,
        "fingerprint": ds.fingerprint,
        "epoch": ds.epoch,
        "segments": segments,
    }
