"""Checks and lookups behind ``AdaptiveLoadDataModule``'s arguments: the ``synthetic`` settings and writing
them, oversize samples, and where an index lies (a binary index file or folder, the one local folder of the shards).
Pure (no Lightning): :mod:`lightning_adaptiveload.datamodule` adapts them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.sizing import tokens_per_sample
from lightning_adaptiveload.shards.protocol import ShardIndexLike

__all__ = [
    "binary_index_of",
    "check_oversize",
    "check_synthetic",
    "index_folder",
    "is_binary_index_file",
    "synthetic_folder",
    "write_synthetic_into",
]

_SYNTHETIC_EXTRA = ("val_num_samples",)


def check_synthetic(synthetic: Mapping[str, Any]) -> dict[str, Any]:
    """The ``synthetic`` settings, with unknown keys refused now (not when ``prepare_data`` runs).

    The keys are the fields of :class:`~lightning_adaptiveload.shards.synthetic.SyntheticShards` and
    ``val_num_samples``; ``progress`` is the DataModule's own. Their values are checked by ``SyntheticShards``
    when the shards are written.
    """
    import dataclasses
    import difflib

    from lightning_adaptiveload.shards.synthetic import SyntheticShards

    valid = [f.name for f in dataclasses.fields(SyntheticShards)] + list(_SYNTHETIC_EXTRA)
    for key in synthetic:
        if key not in valid:
            near = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(
                f"data.synthetic has no setting {key!r}: {hint}valid keys are {', '.join(valid)}"
            )
    return dict(synthetic)


def check_oversize(index: ShardIndexLike, batcher: DualConstraintBatcher) -> None:
    """Raise the batcher's oversize error (``oversize="raise"``) for the first sample over ``max_tokens``,
    with how many are over it and the largest token count: the floor ``max_tokens`` must reach."""
    if batcher.oversize != "raise":
        return
    first: tuple[Any, int, str] | None = None
    largest, n_over, shapes_over = 0, 0, set()
    if hasattr(index, "shape_table"):  # a CompactIndex: each distinct shape once, named by its first use
        for row, shape in enumerate(index.shape_table.tolist()):
            s = tokens_per_sample(shape, batcher.patch_size)
            if s > batcher.max_tokens:
                shapes_over.add(tuple(shape))
                largest = max(largest, s)
                if first is None:
                    ref = index.first_use(row)
                    first = (shape, s, f"shard {index.paths[ref[0]]}, key {index.key(ref)!r}: ")
        over = f"{len(shapes_over)} shape(s)"
    else:
        tokens: dict[tuple[int, ...], int] = {}
        for shard in index.shards:
            for key, shape in zip(shard.keys, shard.latent_shapes):
                shape = tuple(shape)
                s = tokens.get(shape)
                if s is None:
                    s = tokens[shape] = tokens_per_sample(shape, batcher.patch_size)
                if s > batcher.max_tokens:
                    n_over += 1
                    shapes_over.add(shape)
                    largest = max(largest, s)
                    if first is None:
                        first = (shape, s, f"shard {shard.path}, key {key!r}: ")
        over = f"{n_over} sample(s) of {len(shapes_over)} shape(s)"
    if first is not None:
        shape, s, where = first
        raise ValueError(batcher.sizer.oversize_message(shape, s, where=where, largest=largest, over=over))


def is_binary_index_file(path: str) -> bool:
    from lightning_adaptiveload.shards.columnar import is_binary_index

    return os.path.isfile(path) and is_binary_index(path)


def binary_index_of(shards: Any) -> str | None:
    """The binary index ``shards`` names: the file itself, or ``index.npidx`` alone in the named folder."""
    if not isinstance(shards, str | os.PathLike):
        return None
    path = os.fspath(shards)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "index.json")):
        path = os.path.join(path, "index.npidx")  # columnar.BINARY_INDEX_NAME
    return path if is_binary_index_file(path) else None


def index_folder(shards: str | list[str]) -> str | None:
    """The one local folder holding these shards, or None (URLs, several folders, index.json given)."""
    from lightning_adaptiveload.shards.paths import expand_paths

    if isinstance(shards, str) and (shards.endswith((".json", ".npidx")) or is_binary_index_file(shards)):
        return None
    try:
        paths = expand_paths(shards)
    except FileNotFoundError:
        return None
    folders = {os.path.dirname(p) for p in paths}
    if len(folders) != 1 or any("://" in p or p.startswith("pipe:") for p in paths):
        return None
    return folders.pop()


def synthetic_folder(shards: Any) -> str:
    """The one directory synthetic shards are written into, or a ``ValueError`` that says what to pass."""
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


def write_synthetic_into(
    name: str, shards: Any, settings: dict[str, Any], announce: Callable[[str], None]
) -> None:
    """``write_synthetic_shards`` into ``shards`` (the argument ``name``); data there that it did not write is
    never replaced. ``announce`` says it before writing into a folder that holds no shards."""
    from lightning_adaptiveload.shards.synthetic import (
        NotSyntheticDataError,
        SyntheticShards,
        write_synthetic_shards,
    )

    folder = synthetic_folder(shards)
    if not os.path.exists(os.path.join(folder, "index.json")):
        # Said before it happens: a mistyped train_shards path would otherwise fill up with generated data.
        announce(
            f"[adaptiveload] {name}: {os.path.abspath(folder)} holds no shards; data.synthetic is set, so "
            f"{settings.get('num_samples', '?')} synthetic samples (mix {settings.get('mix', '?')!r}) are "
            "written there now. Set data.synthetic to null to train on real shards only."
        )
    try:
        values = dict(settings)
        progress = bool(values.pop("progress", False))
        write_synthetic_shards(folder, SyntheticShards(**values), progress=progress)
    except NotSyntheticDataError as err:
        # The usual cause: a recipe's `synthetic:` block left in after pointing it at real shards.
        raise NotSyntheticDataError(
            err.directory,
            err.found,
            context=f" It is {name}, and data.synthetic is set: synthetic shards would be written there.",
            advice=f"to train on the data in {name}={shards!r}, remove the `synthetic:` block from the recipe "
            "(data.init_args.synthetic; on the command line: --data.init_args.synthetic=null); for "
            f"synthetic data, point {name} at an empty or new folder",
        ) from None
