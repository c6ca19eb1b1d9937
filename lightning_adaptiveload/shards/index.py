"""``ShardIndex``: per-shard keys and latent shapes, the input every rank plans an epoch from.

It owns the index's summaries, its ``index.json`` persistence (:meth:`ShardIndex.save`,
:meth:`ShardIndex.load`), building one from shards (:meth:`ShardIndex.build`) and reusing an existing
index where it still covers the shards (:meth:`ShardIndex.for_paths`). The scan itself lives in
:mod:`~lightning_adaptiveload.shards.indexing`.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning_adaptiveload.shards import untrusted
from lightning_adaptiveload.shards.format import (
    DEFAULT_PATCH,
    INDEX_NAME,
    INDEX_VERSION,
    PatchSize,
    ShardError,
    ShardInfo,
    check_on_error,
    check_patch,
    patch_tokens,
)
from lightning_adaptiveload.shards.index_columns import (
    checked_keys,
    columns_of,
    index_root,
    resolve_paths,
    shard_info,
    write_index,
)
from lightning_adaptiveload.shards.index_file import (
    MAX_DIM,
    IndexProblem,
    describe,
    int_list,
    is_int,
    read_index_bytes,
    shard_info_from_json,
)
from lightning_adaptiveload.shards.indexing import (
    apply_patch_check,
    check_cross_duplicates,
    first_duplicate,
    index_shards,
    report_skips,
)
from lightning_adaptiveload.shards.paths import (
    expand_paths,
    is_url,
    norm_path,
)
from lightning_adaptiveload.shards.spans import spans_problem
from lightning_adaptiveload.shards.untrusted import (
    Refused,
    load_json,
)

__all__ = ["ShardIndex"]

log = logging.getLogger(__name__)


@dataclass
class ShardIndex:
    """Per-shard sample keys and latent shapes: what every rank plans an epoch from.

    A sample reference is ``(shard_id, sample_id)``: positions in :attr:`shards` and in that shard's
    ``keys``.

    Attributes:
        shards: one :class:`ShardInfo` per shard, in the order given.
        patch_size: the patch size (pt, ph, pw) the latent shapes were checked against, or None.
        values_checked: True when every listed sample's values were checked finite.
        metadata: free-form extra data saved with the index (e.g. synthetic-data settings).
        source: the file the index was loaded from or last saved to, or None.
    """

    shards: list[ShardInfo]
    patch_size: PatchSize | None = None
    values_checked: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    # -- summaries -------------------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        """Valid samples in all shards."""
        return sum(s.num_samples for s in self.shards)

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    @property
    def paths(self) -> list[str]:
        """Shard paths or URLs, by shard id."""
        return [s.path for s in self.shards]

    def sample_refs(self) -> list[tuple[int, int]]:
        """All sample references ``(shard_id, sample_id)`` in index order."""
        return [(i, j) for i, s in enumerate(self.shards) for j in range(s.num_samples)]

    def latent_shape(self, ref: tuple[int, int]) -> tuple[int, int, int, int]:
        """The latent shape (C, T, H, W) of the sample ``ref = (shard_id, sample_id)``."""
        return self.shards[ref[0]].latent_shapes[ref[1]]

    def total_tokens(self, patch_size: Sequence[int] = DEFAULT_PATCH) -> int:
        """Sum over samples of T/pt * H/ph * W/pw."""
        return sum(patch_tokens(shape, patch_size) for s in self.shards for shape in s.latent_shapes)

    def counts(self) -> dict[str, int]:
        """Problems and ignored members by reason: skipped samples/shards, ``empty_shard``, ignored members."""
        out: Counter[str] = Counter()
        for s in self.shards:
            out.update(entry["reason"] for entry in s.skipped)
            out.update(s.ignored)
            if s.empty:
                out["empty_shard"] += 1
        return dict(out)

    def skipped(self) -> list[dict[str, Any]]:
        """Every skipped sample or shard: ``{"shard": path, "key", "reason", "detail"}``."""
        return [{"shard": s.path, **entry} for s in self.shards for entry in s.skipped]

    # -- persistence -----------------------------------------------------------------------------------

    def to_dict(self, relative_to: str | None = None) -> dict[str, Any]:
        """The ``index.json`` content; shard paths under ``relative_to`` (a directory) are made relative."""
        shards = []
        for s in self.shards:
            path = s.path
            if relative_to is not None and not is_url(path):
                rel = os.path.relpath(path, relative_to)
                if not rel.startswith(os.pardir):
                    path = rel.replace(os.sep, "/")
            entry: dict[str, Any] = {
                "path": path,
                "num_samples": s.num_samples,
                "bytes": s.num_bytes,
                "keys": s.keys,
                "latent_shapes": [list(x) for x in s.latent_shapes],
                "text_lengths": s.text_lengths,
            }
            if s.skipped:
                entry["skipped"] = s.skipped
            if s.ignored:
                entry["ignored"] = s.ignored
            if s.spans is not None:  # optional: an index without spans is streamed, never ranged
                entry["spans"] = [[int(a), int(b)] for a, b in s.spans]
            shards.append(entry)
        return {
            "version": INDEX_VERSION,
            "patch_size": None if self.patch_size is None else list(self.patch_size),
            "values_checked": self.values_checked,
            "metadata": self.metadata,
            "shards": shards,
        }

    def save(self, path: str | os.PathLike, format: str | None = None) -> str:
        """Write the index atomically (temp file + rename); shard paths beside it become relative.

        Args:
            path: the file to write.
            format: ``"json"`` (``index.json``), ``"binary"`` (the columnar ``index.npidx``), or None:
                binary when ``path`` ends in ``.npidx``, else JSON.

        Returns:
            The absolute path written.
        """
        if format not in (None, "json", "binary"):
            raise ValueError(f"format must be 'json', 'binary' or None, got {format!r}")
        if format == "binary" or (format is None and os.fspath(path).endswith(".npidx")):
            self.source = write_index(columns_of(self), path)
            return self.source
        path = os.path.abspath(os.fspath(path))
        folder = os.path.dirname(path)
        data = self.to_dict(relative_to=folder)
        shards = data.pop("shards")
        outside = [e["path"] for e in shards if os.path.isabs(e["path"]) or is_url(e["path"])]
        if outside:
            log.warning(
                "index %s names %d shards outside its folder (e.g. %s); loading it will need "
                "allow_outside=True or allow_schemes=[...]",
                path,
                len(outside),
                outside[0],
            )
        head = json.dumps(data)[:-1]
        # One shard per line: readable and diffable, still compact for large data sets.
        body = ",\n".join(json.dumps(s, separators=(",", ":")) for s in shards)
        text = f'{head}, "shards": [\n{body}\n]}}\n'
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.source = path
        return path

    @classmethod
    def from_dict(
        cls,
        data: Any,
        source: str = "<dict>",
        root: str | None = None,
        *,
        allow_schemes: Collection[str] = (),
        allow_outside: bool = False,
    ) -> ShardIndex:
        """Validate and convert the ``index.json`` content; relative shard paths resolve against ``root``.

        Every field is type- and range-checked; shard paths follow the rules of :meth:`load` (with
        ``root=None`` local paths are taken as given, as there is no folder to stay in).

        Raises:
            ShardError: ``bad_index`` or ``unsafe_index_path``, naming ``source`` and the entry;
                ``duplicate_key`` for a key listed twice (across shards or within one), naming both.
        """
        if "pipe" in {str(s).lower() for s in allow_schemes}:
            raise ValueError("allow_schemes cannot hold 'pipe': commands are never taken from an index")
        try:
            if not isinstance(data, dict) or not isinstance(data.get("shards"), list):
                raise IndexProblem("shards", "the index must be an object with a 'shards' list")
            if not is_int(data.get("version")) or data.get("version") != INDEX_VERSION:
                raise IndexProblem(
                    "version", f"version {data.get('version')!r} is not supported (expected {INDEX_VERSION})"
                )
            patch = data.get("patch_size")
            if patch is not None:
                int_list(patch, "patch_size", 1, MAX_DIM, 3)
            if not isinstance(data.get("values_checked", False), bool):
                raise IndexProblem(
                    "values_checked", f"must be true or false, got {describe(data['values_checked'])}"
                )
            metadata = data.get("metadata") or {}
            if not isinstance(metadata, dict):
                raise IndexProblem("metadata", f"must be an object, got {describe(metadata)}")
            shards = [
                shard_info_from_json(e, i, root, allow_schemes, allow_outside)
                for i, e in enumerate(data["shards"])
            ]
            for i, (e, s) in enumerate(zip(data["shards"], shards)):
                s.spans = _json_spans(e.get("spans"), s, f"shards[{i}].spans")
        except IndexProblem as err:
            raise ShardError(source, None, err.detail, reason=err.reason, member=err.where) from None
        twice = first_duplicate(shards)
        if twice is not None:  # the builder never writes one: a sample would be trained twice, or unreachable
            key, s1, p1, s2, p2 = twice
            where = (
                f"twice in this shard (shards[{s2}].keys[{p1}] and [{p2}])"
                if s1 == s2
                else f"also in shard {shards[s1].path} (shards[{s1}].keys[{p1}] and shards[{s2}].keys[{p2}])"
            )
            raise ShardError(
                shards[s2].path,
                key,
                f"key {key!r} is listed {where} by the index {source}; an index lists every key once",
                reason="duplicate_key",
                hint="rebuild the index from the shards (`lightning-adaptiveload index <shards> --rebuild`); keys "
                "must be unique in a data set",
            )
        return cls(
            shards=shards,
            patch_size=check_patch(patch),
            values_checked=data.get("values_checked", False),
            metadata=dict(metadata),
            source=source,
        )

    @classmethod
    def from_columns(cls, columns: Any, source: str | None = None) -> ShardIndex:
        """The index held by a binary index's columns (:class:`~.columnar.IndexColumns`, paths resolved),
        as per-sample lists, every key checked; ``source`` names the file in errors."""
        shapes = [tuple(r) for r in columns.shapes.tolist()]
        where = source or "<columns>"
        return cls(
            shards=[
                shard_info(columns, i, shapes, checked_keys(columns, i, where))
                for i in range(columns.num_shards)
            ],
            patch_size=columns.patch_size,
            values_checked=columns.values_checked,
            metadata=dict(columns.metadata),
            source=source,
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        allow_schemes: Collection[str] = (),
        allow_outside: bool = False,
    ) -> ShardIndex:
        """Load an index (local path, ``file://`` or URL); relative shard paths resolve beside it.

        Either format: ``index.json`` or the binary ``index.npidx`` (:mod:`~lightning_adaptiveload.shards.columnar`),
        told by the file's first bytes; a binary index is converted to lists here (use
        :class:`~lightning_adaptiveload.shards.compact.CompactIndex` to keep it as arrays).

        An index is data, never a command: its shard paths may name files in its own folder (for a
        remote index, URLs under its folder), nothing else unless you opt in. ``pipe:`` paths are
        always refused; list such shards yourself (``for_paths(["pipe:..."])``, ``train_shards``).

        Args:
            path: the index file (a ``pipe:`` source you write is allowed here, as for shards).
            allow_schemes: URL schemes an entry may name anywhere, e.g. ``["https", "s3"]``.
            allow_outside: accept local paths (and same-scheme URLs) outside the index's folder.

        Raises:
            FileNotFoundError: no such file.
            ShardError: (a ``ValueError``) ``bad_index`` when the file is not a valid version-1 index
                (larger than :data:`~lightning_adaptiveload.shards.untrusted.MAX_INDEX_BYTES`, nested too deep,
                wrong types or values), ``unsafe_index_path`` for a path outside what is allowed; the
                message names the file and the entry.
        """
        from lightning_adaptiveload.shards.columnar import (
            MAGIC,
            is_binary_index,
            read_columns,
            refuse_duplicate_keys,
        )

        text = os.fspath(path)
        if not is_url(text):
            text = norm_path(text)
            if is_binary_index(text):  # told by the magic bytes, not the name
                cols = read_columns(text)
                cols.paths = resolve_paths(cols.paths, text, allow_schemes, allow_outside)
                refuse_duplicate_keys(cols, text)
                return cls.from_columns(cols, text)
        raw = read_index_bytes(text, untrusted.MAX_INDEX_BYTES)
        if raw.startswith(MAGIC):
            cols = read_columns(text, raw)
            cols.paths = resolve_paths(cols.paths, text, allow_schemes, allow_outside)
            refuse_duplicate_keys(cols, text)
            return cls.from_columns(cols, text)
        try:
            data = load_json(raw, finite=False)  # a 1e999 is then named by the field check
        except Refused as err:
            raise ShardError(text, None, f"not valid JSON: the file {err}", reason="bad_index") from None
        root = index_root(text)  # beside the index: its folder, or its URL's (http(s), s3, gs, az)
        return cls.from_dict(
            data, source=text, root=root, allow_schemes=allow_schemes, allow_outside=allow_outside
        )

    # -- building ----------------------------------------------------------------------------------------

    @classmethod
    def build(
        cls,
        paths: str | os.PathLike | Iterable[str | os.PathLike],
        progress: bool = True,
        *,
        patch_size: Sequence[int] | None = DEFAULT_PATCH,
        on_error: str = "raise",
        check_values: bool = True,
        num_workers: int = 1,
        max_member_bytes: int | None = None,
        processes: bool = False,
    ) -> ShardIndex:
        """Index shards in one streaming pass, checking every sample.

        Reads tar headers, ``.npy`` headers (dtype and shape, without the data) and the json members;
        with ``check_values`` also the array data, to refuse NaN and Inf. Never unpickles.

        Args:
            paths: shard paths, URLs, brace patterns or directories (see :func:`expand_paths`).
            progress: show a tqdm bar over the shards.
            patch_size: (pt, ph, pw) the latent T, H, W must be divisible by; None to skip that check.
            on_error: ``"raise"`` a :class:`ShardError` at the first problem, or ``"skip"``: leave the
                sample (or shard) out, record it in ``ShardInfo.skipped`` and log a warning.
            check_values: also check that every latent and text array is finite (reads all data).
            num_workers: shards indexed in parallel (threads; helps with remote shards).
            max_member_bytes: the largest member read (``member_too_large`` beyond it); None:
                :data:`MAX_MEMBER_BYTES`.
            processes: scan in ``num_workers`` processes instead of threads (many local shards).

        Returns:
            The index; shard order is the order of ``paths``.

        Raises:
            ShardError: under ``on_error="raise"``, naming the shard, key and problem.
        """
        check_on_error(on_error)
        patch = check_patch(patch_size)
        shard_paths = expand_paths(paths)
        infos = index_shards(
            shard_paths, patch, on_error, check_values, progress, num_workers, max_member_bytes, processes
        )
        index = cls(shards=infos, patch_size=patch, values_checked=check_values)
        check_cross_duplicates(index.shards, on_error)
        report_skips(index, on_error)
        return index

    @classmethod
    def for_paths(
        cls,
        paths_or_pattern: str | os.PathLike | Iterable[str | os.PathLike],
        patch_size: Sequence[int] | None = DEFAULT_PATCH,
        on_error: str = "raise",
        *,
        check_values: bool = True,
        progress: bool = True,
        save: bool | str | os.PathLike = False,
        index_path: str | os.PathLike | None = None,
        num_workers: int = 1,
        max_member_bytes: int | None = None,
        allow_schemes: Collection[str] = (),
        allow_outside: bool = False,
    ) -> ShardIndex:
        """The index of these shards: from ``index.json`` beside them where it covers them, else built.

        An index entry covers a shard when its path matches and (for local files) its recorded size
        equals the file's size; entries of an index whose patch size or value check differ from the
        request are re-checked in memory or rebuilt. Shards not covered are indexed in one pass
        (:meth:`build`, with a progress bar).

        Args:
            paths_or_pattern: shard paths, URLs, brace patterns or directories, or the path of an
                ``index.json`` (then its shards are used).
            patch_size: (pt, ph, pw) latents must be divisible by, or None.
            on_error: ``"raise"`` or ``"skip"`` (see :meth:`build`); a loaded index's recorded skips
                raise under ``"raise"``.
            check_values: require every sample's values checked finite.
            progress: tqdm bar while building.
            save: True to write the resulting index as ``index.json`` beside the shards (all local, one
                directory), or a path to write it to.
            index_path: an index file to use instead of looking beside the shards.
            num_workers: shards indexed in parallel when building.
            max_member_bytes: see :meth:`build`.
            allow_schemes, allow_outside: what the shard paths of a loaded index may name (see
                :meth:`load`). An index found beside the shards that breaks these rules (or is damaged)
                is ignored with a warning and the shards are indexed again; one you name (an
                ``index.json`` as ``paths_or_pattern``, or ``index_path``) raises.

        Returns:
            The index, shard order as given.

        Raises:
            ShardError: under ``on_error="raise"``.
        """
        check_on_error(on_error)
        patch = check_patch(patch_size)
        given = os.fspath(paths_or_pattern) if isinstance(paths_or_pattern, str | os.PathLike) else None
        if index_path is None and given is not None and "{" not in given and _names_index_file(given):
            index_path = given
            shard_paths = cls.load(given, allow_schemes=allow_schemes, allow_outside=allow_outside).paths
        else:
            shard_paths = expand_paths(paths_or_pattern)
        known = _load_indexes(shard_paths, index_path, allow_schemes, allow_outside)
        infos = _covered_or_built(
            shard_paths, known, patch, on_error, check_values, progress, num_workers, max_member_bytes
        )
        index = cls(
            shards=infos,
            patch_size=patch,
            values_checked=check_values,
            metadata=_carried_metadata(shard_paths, known),
        )
        if patch is not None:
            apply_patch_check(index.shards, patch, on_error)
        check_cross_duplicates(index.shards, on_error)
        if on_error == "raise":
            _raise_recorded_skip(index)
        report_skips(index, on_error)
        if save:
            index.save(_save_target(index) if save is True else os.fspath(save))
        return index


def _carried_metadata(
    shard_paths: list[str], known: dict[str, tuple[ShardInfo, ShardIndex]]
) -> dict[str, Any]:
    """The metadata of the loaded index that lists every shard (e.g. synthetic settings), else {}; and the
    ``demo`` mark of any loaded index that lists one of them: demo shards among others make demo data."""
    sources = {id(found[1]): found[1] for p in shard_paths if (found := known.get(p)) is not None}
    covered = len(sources) == 1 and all(p in known for p in shard_paths)
    metadata = dict(next(iter(sources.values())).metadata) if covered else {}
    for source in sources.values():
        if source.metadata.get("demo"):
            metadata["demo"] = source.metadata["demo"]
    return metadata


def _covered_or_built(
    shard_paths: list[str],
    known: dict[str, tuple[ShardInfo, ShardIndex]],
    patch: PatchSize | None,
    on_error: str,
    check_values: bool,
    progress: bool,
    num_workers: int,
    max_member_bytes: int | None,
) -> list[ShardInfo]:
    """One entry per shard: the loaded entry where it still covers the shard, else a fresh scan."""
    infos: list[ShardInfo | None] = []
    todo: list[int] = []
    for i, path in enumerate(shard_paths):
        found = known.get(path)
        info = _usable_entry(found, path, patch, check_values) if found is not None else None
        infos.append(info)
        if info is None:
            todo.append(i)
    if todo:
        if len(todo) < len(shard_paths):
            log.info(
                "index covers %d of %d shards; indexing the other %d",
                len(shard_paths) - len(todo),
                len(shard_paths),
                len(todo),
            )
        built = index_shards(
            [shard_paths[i] for i in todo],
            patch,
            on_error,
            check_values,
            progress,
            num_workers,
            max_member_bytes,
        )
        for i, info in zip(todo, built):
            infos[i] = info
    return [i for i in infos if i is not None]


def _names_index_file(given: str) -> bool:
    """Whether ``given`` names an index file (``*.json``, ``*.npidx``, or any file with the binary magic)."""
    from lightning_adaptiveload.shards.columnar import is_binary_index

    return given.endswith((".json", ".npidx")) or (not is_url(given) and is_binary_index(given))


def _raise_recorded_skip(index: ShardIndex) -> None:
    """Under on_error="raise", a skip recorded in a loaded index is an error too."""
    for s in index.shards:
        for entry in s.skipped:
            raise ShardError(
                s.path,
                entry.get("key"),
                f"{entry.get('detail')} (recorded in the index)",
                reason=entry.get("reason"),
            )


def _save_target(index: ShardIndex) -> str:
    """``index.json`` in the one local folder holding the index's shards (``save=True``)."""
    folders = {os.path.dirname(p) for p in index.paths if not is_url(p)}
    if len(folders) != 1 or any(is_url(p) for p in index.paths):
        raise ValueError("save=True needs local shards in one directory; pass the index path as save=")
    return os.path.join(folders.pop(), INDEX_NAME)


def _load_indexes(
    shard_paths: list[str],
    index_path: str | os.PathLike | None,
    allow_schemes: Collection[str] = (),
    allow_outside: bool = False,
) -> dict[str, tuple[ShardInfo, ShardIndex]]:
    """Entries of the index files that may cover ``shard_paths``: normalised path -> (entry, its index)."""
    if index_path is not None:
        candidates = [os.fspath(index_path)]
    else:
        candidates = []
        for p in shard_paths:
            if is_url(p):
                folder = untrusted.url_folder(p)
                if folder is None or folder.startswith("file:"):
                    continue  # pipe: and friends have no "beside"
                cand = folder + INDEX_NAME
            else:
                cand = os.path.join(os.path.dirname(p), INDEX_NAME)
            if cand not in candidates:
                candidates.append(cand)
    known: dict[str, tuple[ShardInfo, ShardIndex]] = {}
    for cand in candidates:
        binary = os.path.join(os.path.dirname(cand), "index.npidx")  # columnar.BINARY_INDEX_NAME
        if index_path is None and not is_url(cand) and not os.path.exists(cand) and os.path.exists(binary):
            cand = binary  # only the binary index beside the shards
        if not is_url(cand) and not os.path.exists(cand):
            if index_path is not None:
                raise FileNotFoundError(f"index file {cand} does not exist")
            continue
        try:
            idx = ShardIndex.load(cand, allow_schemes=allow_schemes, allow_outside=allow_outside)
        except (OSError, ValueError) as err:
            if index_path is not None:
                raise
            log.warning("ignoring index %s: %s", cand, err)
            continue
        for info in idx.shards:
            known[info.path] = (info, idx)
    return known


def _usable_entry(
    found: tuple[ShardInfo, ShardIndex], path: str, patch: PatchSize | None, check_values: bool
) -> ShardInfo | None:
    """A copy of the loaded entry if it can stand for the shard at ``path`` now, else None (rebuild it)."""
    info, owner = found
    if check_values and not owner.values_checked:
        return None
    if not is_url(path):
        try:
            size = os.path.getsize(path)
        except OSError:
            return None  # gone: building reports it
        if size != info.num_bytes:
            log.warning(
                "index entry for %s is stale (%s bytes recorded, %d on disk); re-indexing it",
                path,
                info.num_bytes,
                size,
            )
            return None
    if owner.patch_size != patch and any(e.get("reason") == "not_divisible" for e in info.skipped):
        return None  # skipped under another patch size: only a rebuild can tell
    return ShardInfo(
        path=info.path,
        keys=list(info.keys),
        latent_shapes=list(info.latent_shapes),
        text_lengths=list(info.text_lengths),
        num_bytes=info.num_bytes,
        skipped=[dict(e) for e in info.skipped],
        ignored=dict(info.ignored),
        spans=None if info.spans is None else list(info.spans),
    )


def _json_spans(value: Any, info: ShardInfo, where: str) -> list[tuple[int, int]] | None:
    """An entry's optional ``spans`` (``[[offset, length], ...]``, one per key), checked; None if absent."""
    if value is None:
        return None
    if not (
        isinstance(value, list)
        and all(
            isinstance(r, list) and len(r) == 2 and all(is_int(v) and 0 <= v < 1 << 62 for v in r)
            for r in value
        )
    ):
        raise IndexProblem(where, f"must be a list of [offset, length] integer pairs, got {describe(value)}")
    problem = spans_problem(value, info.num_samples, info.num_bytes)
    if problem is not None:
        raise IndexProblem(where, problem)
    return [(int(a), int(b)) for a, b in value]
