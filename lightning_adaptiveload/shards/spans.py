"""Sample spans: where each sample's bytes lie in its tar, as the index records them.

A span is ``(offset, length)``: from the first member's header (a pax or GNU long-name header included)
through the last member's data padded to a 512-byte block. A ranged read fetches exactly these bytes
(:mod:`~lightning_adaptiveload.shards.ranged`). Spans come from an index, which may be hostile: they are
checked once, when the index is loaded, so that no read can be asked for bytes outside its shard or
for overlapping or unaligned ranges. ``(-1, -1)`` rows mark a shard without spans in the binary index
(reused from an index written before spans existed): such a shard is streamed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["BLOCK", "MAX_SPAN_BYTES", "span_columns_problem", "spans_problem", "spans_or_none"]

BLOCK = 512  # tar block size
# The largest sample span an index may claim (bytes): a ranged read allocates a span before parsing it.
# Settable; spans above max_member_bytes per member are refused again by the scan.
MAX_SPAN_BYTES = 1 << 32


def spans_problem(spans: np.ndarray | Sequence[Sequence[int]], count: int, shard_bytes: int) -> str | None:
    """What is wrong with one shard's spans, or None.

    Args:
        spans: ``(count, 2)`` int64 ``(offset, length)`` rows in sample (file) order.
        count: the shard's sample count.
        shard_bytes: the shard's size in bytes, or -1 when unknown.

    Returns:
        A sentence naming the first bad row (``spans[<row>]``), or None when every span is a block-aligned
        range inside the shard, after the previous one.
    """
    arr = np.asarray(spans, dtype=np.int64) if len(spans) else np.zeros((0, 2), dtype=np.int64)
    if arr.ndim != 2 or arr.shape != (count, 2):
        return f"has shape {list(arr.shape)}; expected {count} rows of [offset, length]"
    if count == 0:
        return None
    off, length = arr[:, 0], arr[:, 1]
    bad = (
        (off < 0) | (length < BLOCK) | (off % BLOCK != 0) | (length % BLOCK != 0) | (length > MAX_SPAN_BYTES)
    )
    if bad.any():
        k = int(np.argmax(bad))
        return (
            f"spans[{k}] is {arr[k].tolist()}: offsets and lengths must be multiples of {BLOCK}, lengths in "
            f"[{BLOCK}, {MAX_SPAN_BYTES}]"
        )
    end = off + length
    if count > 1 and (off[1:] < end[:-1]).any():
        k = int(np.argmax(off[1:] < end[:-1])) + 1
        return f"spans[{k}] starts at {int(off[k])}, inside the previous span (ends at {int(end[k - 1])})"
    if shard_bytes >= 0 and int(end[-1]) > shard_bytes:
        return f"spans[{count - 1}] ends at byte {int(end[-1])}, past the shard's {shard_bytes} bytes"
    return None


def spans_or_none(rows: np.ndarray) -> list[tuple[int, int]] | None:
    """One shard's span rows as a list of tuples; None when the shard has none (rows of -1, or no rows
    at all where the shard has samples is decided by the caller)."""
    if len(rows) and int(rows[0, 0]) < 0:
        return None
    return [(int(a), int(b)) for a, b in rows.tolist()]


def span_columns_problem(
    spans: np.ndarray, shard_offsets: np.ndarray, shard_bytes: np.ndarray
) -> tuple[str, str] | None:
    """What is wrong with the binary index's ``spans`` array (``2n`` int64), or None: ``(where, detail)``.

    The same rules as :func:`spans_problem` for every shard at once; a shard's rows are either all
    ``-1`` (no spans: streamed) or all valid.
    """
    n = int(shard_offsets[-1])
    if spans.size != 2 * n:
        return "spans", f"has {spans.size} values, expected 2 x {n}"
    if n == 0:
        return None
    arr = spans.reshape(n, 2)
    off, length = arr[:, 0], arr[:, 1]
    known = off >= 0
    unknown_bad = ~known & ((off != -1) | (length != -1))
    bad = unknown_bad | (
        known & ((length < BLOCK) | (off % BLOCK != 0) | (length % BLOCK != 0) | (length > MAX_SPAN_BYTES))
    )
    if bad.any():
        k = int(np.argmax(bad))
        return f"spans[{k}]", (
            f"is {arr[k].tolist()}: offsets and lengths must be multiples of {BLOCK}, lengths in "
            f"[{BLOCK}, {MAX_SPAN_BYTES}] (or both -1: no span)"
        )
    counts = np.diff(shard_offsets)
    first = np.zeros(n, dtype=bool)
    first[shard_offsets[:-1][counts > 0]] = True
    follows = ~first[1:]  # row i+1 is in the same shard as row i
    end = off + length
    mixed = follows & (known[1:] != known[:-1])
    overlap = follows & known[1:] & (off[1:] < end[:-1])
    if (mixed | overlap).any():
        k = int(np.argmax(mixed | overlap)) + 1
        return f"spans[{k}]", (
            "mixes rows with and without spans in one shard"
            if mixed[k - 1]
            else f"starts at {int(off[k])}, inside the previous span (ends at {int(end[k - 1])})"
        )
    last = shard_offsets[1:][counts > 0] - 1
    size = shard_bytes[counts > 0]
    past = known[last] & (size >= 0) & (end[last] > size)
    if past.any():
        k = int(last[int(np.argmax(past))])
        return (
            f"spans[{k}]",
            f"ends at byte {int(end[k])}, past its shard's {int(size[int(np.argmax(past))])} bytes",
        )
    return None
