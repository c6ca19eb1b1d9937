"""Reading an ``index.json`` from disk or a URL: the size cap and the field-by-field checks.

An index is untrusted data: every entry is type- and range-checked (:func:`shard_info_from_json`)
and its shard paths must stay inside the index's folder unless the caller opts in.
"""

from __future__ import annotations

import urllib.parse
import urllib.request
from collections.abc import Collection
from typing import Any

from lightning_adaptiveload.shards.format import (
    REASONS,
    ShardError,
    ShardInfo,
)
from lightning_adaptiveload.shards.paths import (
    is_url,
    open_regular,
)
from lightning_adaptiveload.shards.scan import STREAM_CHUNK
from lightning_adaptiveload.shards.untrusted import (
    Refused,
    check_index_path,
)

__all__ = [
    "IndexProblem",
    "MAX_DIM",
    "describe",
    "int_list",
    "is_int",
    "read_index_bytes",
    "shard_info_from_json",
]

MAX_DIM = (1 << 31) - 1  # no latent dimension or text length is larger; bigger numbers are damage


def is_int(v: Any) -> bool:
    return type(v) is int  # not bool, not float: JSON 1e999 or true must not pass as a number


class IndexProblem(Exception):
    def __init__(self, where: str, detail: str, reason: str = "bad_index") -> None:
        super().__init__(detail)
        self.where, self.detail, self.reason = where, detail, reason


def int_list(value: Any, where: str, lo: int, hi: int, n: int | None = None) -> list[int]:
    if not isinstance(value, list) or (n is not None and len(value) != n):
        want = "a list" if n is None else f"a list of {n}"
        raise IndexProblem(where, f"must be {want} integers, got {describe(value)}")
    for v in value:
        if not is_int(v) or not lo <= v <= hi:
            raise IndexProblem(where, f"holds {describe(v)}; expected integers in [{lo}, {hi}]")
    return value


def _all_ints_in(rows: list, lo: int, hi: int, n: int) -> bool:
    """True when every row is a list of ``n`` ints in [lo, hi] (one pass over the flattened values)."""
    if not all(type(r) is list and len(r) == n for r in rows):
        return False
    flat = [v for r in rows for v in r]
    return not flat or (set(map(type, flat)) == {int} and lo <= min(flat) and max(flat) <= hi)


def describe(v: Any) -> str:
    text = repr(v)
    return f"{type(v).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def shard_info_from_json(
    entry: Any,
    i: int,
    root: str | None,
    allow_schemes: Collection[str] = (),
    allow_outside: bool = False,
) -> ShardInfo:
    """One checked ``shards[i]`` entry; raises IndexProblem naming the field and the rule."""
    where = f"shards[{i}]"
    if not isinstance(entry, dict):
        raise IndexProblem(where, f"must be an object, got {describe(entry)}")
    try:
        path = check_index_path(
            entry.get("path"), root, allow_schemes=allow_schemes, allow_outside=allow_outside
        )
    except Refused as err:
        raise IndexProblem(f"{where}.path", str(err), err.reason or "bad_index") from None
    keys = entry.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise IndexProblem(f"{where}.keys", f"must be a list of strings, got {describe(keys)}")
    n = entry.get("num_samples", len(keys))
    if not is_int(n) or n != len(keys):
        raise IndexProblem(f"{where}.num_samples", f"is {describe(n)} but keys has {len(keys)} entries")
    shapes = entry.get("latent_shapes")
    if not isinstance(shapes, list) or len(shapes) != len(keys):
        raise IndexProblem(
            f"{where}.latent_shapes",
            f"num_samples ({n}), keys ({len(keys)}) and latent_shapes "
            f"({len(shapes) if isinstance(shapes, list) else describe(shapes)}) disagree",
        )
    if not _all_ints_in(shapes, 1, MAX_DIM, 4):  # the fast check; the loop names the bad one
        for j, shape in enumerate(shapes):
            int_list(shape, f"{where}.latent_shapes[{j}]", 1, MAX_DIM, 4)
    text_lengths = entry.get("text_lengths", [0] * len(keys))
    if not (isinstance(text_lengths, list) and _all_ints_in([text_lengths], 0, MAX_DIM, len(keys))):
        int_list(text_lengths, f"{where}.text_lengths", 0, MAX_DIM, len(keys))
    num_bytes = entry.get("bytes", -1)
    if num_bytes is None:
        num_bytes = -1
    if not is_int(num_bytes) or not -1 <= num_bytes < 1 << 63:
        raise IndexProblem(f"{where}.bytes", f"is {describe(num_bytes)}, not a file size in bytes")
    skipped = entry.get("skipped", [])
    if not isinstance(skipped, list):
        raise IndexProblem(f"{where}.skipped", f"must be a list, got {describe(skipped)}")
    for j, e in enumerate(skipped):
        if (
            not isinstance(e, dict)
            or not (e.get("key") is None or isinstance(e.get("key"), str))
            or e.get("reason") not in REASONS
            or not isinstance(e.get("detail", ""), str)
        ):
            raise IndexProblem(
                f"{where}.skipped[{j}]",
                f"must be {{'key': str | null, 'reason': <a reason of REASONS>, 'detail': str}}, got {describe(e)}",
            )
    ignored = entry.get("ignored", {})
    if not isinstance(ignored, dict) or not all(is_int(v) and v >= 0 for v in ignored.values()):
        raise IndexProblem(f"{where}.ignored", f"must map reasons to counts, got {describe(ignored)}")
    return ShardInfo(
        path=path,
        keys=list(keys),
        latent_shapes=[tuple(s) for s in shapes],  # type: ignore[misc]
        text_lengths=list(text_lengths),
        num_bytes=num_bytes,
        skipped=[dict(e) for e in skipped],
        ignored=dict(ignored),
    )


def _read_capped(f, limit: int) -> bytes:
    """At most ``limit + 1`` bytes of ``f``, in chunks: ``read(n)`` would allocate n bytes up front."""
    chunks, got = [], 0
    while got <= limit:
        chunk = f.read(min(STREAM_CHUNK, limit + 1 - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_index_bytes(path: str, limit: int) -> bytes:
    """The content of a (local or remote) index file, refused beyond ``limit`` bytes."""
    if is_url(path):
        from lightning_adaptiveload.shards.ranged import RANGED_SCHEMES

        if urllib.parse.urlparse(path).scheme.lower() in RANGED_SCHEMES:
            # The backends of ranged reads (http(s), s3, gs, az): no shell command, bounded size, the same
            # redirect rules; not gopen (its curl retries for a minute on a missing file).
            from lightning_adaptiveload.shards.objstore import read_object

            data = read_object(path, limit)
        else:
            from webdataset.gopen import gopen

            with gopen(path, "rb") as f:
                data = _read_capped(f, limit)
    else:
        with open_regular(path) as f:
            data = _read_capped(f, limit)
    if len(data) > limit:
        raise ShardError(
            path,
            None,
            f"the file is larger than max_index_bytes={limit}",
            reason="bad_index",
            hint="raise lightning_adaptiveload.shards.untrusted.MAX_INDEX_BYTES if the index is genuine, else rebuild it",
        )
    return data
