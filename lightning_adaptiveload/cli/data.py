"""``lightning-adaptiveload synth``, ``index`` and ``convert-index``: the parsers and printing of the shard tools.

The work is done by the data layer's plain functions (:func:`~lightning_adaptiveload.shards.synthetic.write_synthetic_shards`,
:meth:`~lightning_adaptiveload.shards.index.ShardIndex.build` / ``for_paths`` / ``save``); this module only
parses arguments, calls them and prints a summary.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Sequence

from lightning_adaptiveload.cli.recipe_file import check_regular
from lightning_adaptiveload.shards.columnar import BINARY_INDEX_NAME, is_binary_index
from lightning_adaptiveload.shards.format import (
    DEFAULT_PATCH,
    IGNORED_REASONS,
    INDEX_NAME,
    ShardError,
    patch_tokens,
)
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.mixes import Mix, load_mix
from lightning_adaptiveload.shards.paths import is_url
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards

__all__ = ["convert_index_main", "index_main", "synth_main"]


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def _print_bucket_table(index: ShardIndex, patch: Sequence[int], mix: Mix | None, out) -> None:
    if hasattr(index, "shape_table"):  # a CompactIndex: count by shape id, no per-sample objects
        rows = [tuple(r) for r in index.shape_table.tolist()]
        counts = Counter(dict(zip(rows, index.shape_counts().tolist())))
    else:
        counts = Counter(shape for s in index.shards for shape in s.latent_shapes)
    share = {tuple(b.latent_shape): b.p for b in mix.buckets} if mix is not None else {}
    total = sum(counts.values()) or 1
    print(
        f"{'latent (C,T,H,W)':<20} {'tokens/sample':>13} {'samples':>8} {'share':>7}"
        + (f" {'mix p':>7}" if mix else "")
        + f" {'tokens':>12}",
        file=out,
    )
    for shape in sorted(counts, key=lambda s: (patch_tokens(s, patch), s)):
        n = counts[shape]
        line = f"{'x'.join(map(str, shape)):<20} {patch_tokens(shape, patch):>13} {n:>8} {n / total:>7.1%}"
        if mix is not None:
            line += f" {share.get(tuple(shape), 0.0):>7.1%}"
        print(line + f" {n * patch_tokens(shape, patch):>12}", file=out)


def _add_patch_size(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument(
        "--patch-size", type=int, nargs=3, default=DEFAULT_PATCH, metavar=("PT", "PH", "PW"), help=help
    )


def synth_parser() -> argparse.ArgumentParser:
    """The arguments of ``lightning-adaptiveload synth``."""
    parser = argparse.ArgumentParser(
        prog="lightning-adaptiveload synth",
        description="Write synthetic latent shards following a length mix.",
    )
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--mix", default="tiny", help="packaged mix name or mix JSON path (default: tiny)")
    parser.add_argument("--num-samples", type=int, default=256, help="samples to write (256)")
    parser.add_argument("--samples-per-shard", type=int, default=64, help="samples per shard file (64)")
    parser.add_argument("--seed", type=int, default=0, help="seeds shapes, values and text (0)")
    parser.add_argument("--uneven", action="store_true", help="uneven shard sizes in [s/2, 1.5 s]")
    parser.add_argument(
        "--text-len",
        type=int,
        nargs=2,
        default=(0, 16),
        metavar=("MIN", "MAX"),
        help="text length range, inclusive (0 = no text member)",
    )
    parser.add_argument("--text-dim", type=int, default=32, help="width D of the text states (32)")
    parser.add_argument("--no-text", action="store_true", help="write no text states")
    parser.add_argument(
        "--dtype", choices=("float16", "float32"), default="float16", help="array dtype (float16)"
    )
    _add_patch_size(parser, "patch size used for the token counts in the summary")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace shards written with other settings in --out"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def synth_main(argv: Sequence[str] | None = None) -> int:
    """``lightning-adaptiveload synth``: write synthetic shards following a length mix, print a summary.

    Returns:
        The exit status (0 on success).
    """
    args = synth_parser().parse_args(argv)
    try:
        check_regular(args.mix, what=f"--mix {args.mix}")  # a FIFO would block the mix's reader
        mix = load_mix(args.mix)
        settings = SyntheticShards(
            mix=mix,
            num_samples=args.num_samples,
            samples_per_shard=args.samples_per_shard,
            seed=args.seed,
            text_len_range=None if args.no_text else tuple(args.text_len),
            text_dim=args.text_dim,
            dtype=args.dtype,
            uneven=args.uneven,
            overwrite=args.overwrite,
        )
        index = write_synthetic_shards(args.out, settings, progress=not args.no_progress)
    except (FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    nbytes = sum(s.num_bytes for s in index.shards)
    print(f"{index.num_shards} shards, {index.num_samples} samples, {_human_bytes(nbytes)} in {args.out}")
    print(f"index: {index.source}  mix: {mix.name}  seed: {args.seed}")
    _print_bucket_table(index, args.patch_size, mix, sys.stdout)
    print(f"total tokens (patch {tuple(args.patch_size)}): {index.total_tokens(args.patch_size)}")
    return 0


def _keep_metadata(index: ShardIndex, path: str) -> None:
    """Carry the metadata of the index at ``path`` (e.g. ``synth``'s settings) over to ``index`` when both
    list the same shards with the same sizes, so that re-indexing does not make the data look foreign."""
    try:
        old = ShardIndex.load(path)
    except (OSError, ValueError):
        return
    same = [(s.path, s.num_bytes) for s in old.shards] == [(s.path, s.num_bytes) for s in index.shards]
    if same and old.metadata:
        index.metadata = {**old.metadata, **index.metadata}


def index_parser() -> argparse.ArgumentParser:
    """The arguments of ``lightning-adaptiveload index``."""
    parser = argparse.ArgumentParser(
        prog="lightning-adaptiveload index",
        description="Build or verify index.json for WebDataset latent shards.",
    )
    parser.add_argument("paths", nargs="+", help="shard paths, URLs, brace patterns or directories")
    _add_patch_size(parser, "the model's patch size; latents must be divisible by it (default: 1 2 2)")
    parser.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="stop at the first bad sample, or skip and count",
    )
    parser.add_argument(
        "--no-check-values", action="store_true", help="do not read array data (no NaN check)"
    )
    parser.add_argument(
        "--rebuild", action="store_true", help="ignore any existing index and read every shard"
    )
    parser.add_argument("--output", help="where to write the index (default: index.json beside the shards)")
    parser.add_argument(
        "--format",
        choices=("json", "binary"),
        default=None,
        help="index format: json (index.json) or binary (index.npidx, columnar: for millions of samples); "
        "default: binary when --output ends in .npidx, else json",
    )
    parser.add_argument("--no-save", action="store_true", help="verify only; write nothing")
    parser.add_argument("--workers", type=int, default=1, help="shards indexed in parallel")
    parser.add_argument(
        "--processes",
        action="store_true",
        help="scan in --workers processes instead of threads (many local shards; threads suit remote ones)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def index_main(argv: Sequence[str] | None = None) -> int:
    """``lightning-adaptiveload index``: build or verify the index of existing shards, print counts.

    Returns:
        0 when every sample is valid, 1 when samples or shards were skipped (``--on-error skip``),
        2 on an error (the first problem under ``--on-error raise``, or bad arguments).
    """
    args = index_parser().parse_args(argv)
    paths = args.paths[0] if len(args.paths) == 1 else args.paths
    kwargs = dict(
        patch_size=args.patch_size,
        on_error=args.on_error,
        check_values=not args.no_check_values,
        progress=not args.no_progress,
    )
    try:
        if args.rebuild and args.format == "binary" and not args.no_save:
            # Straight to columns: no per-sample Python lists, for millions of samples.
            from lightning_adaptiveload.shards.compact_build import build_compact

            compact = build_compact(paths, num_workers=args.workers, processes=args.processes, **kwargs)
            return _save_compact(compact, args.output, args.patch_size)
        if args.rebuild:
            index = ShardIndex.build(paths, num_workers=args.workers, processes=args.processes, **kwargs)
        else:
            index = ShardIndex.for_paths(paths, num_workers=args.workers, **kwargs)
        if not args.no_save:
            _save_index(index, args.output, args.format)
    except (ShardError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return _print_index_summary(index, args.patch_size)


def _save_compact(compact, output: str | None, patch_size: Sequence[int]) -> int:
    """Save a compact index (to ``output``, else ``index.npidx`` beside the shards); print its summary."""
    folders = {os.path.dirname(p) for p in compact.paths if not is_url(p)}
    if output is None and (len(folders) != 1 or any(is_url(p) for p in compact.paths)):
        raise ValueError("shards are remote or in several directories; pass --output to save the index")
    target = output or os.path.join(folders.pop(), BINARY_INDEX_NAME)
    compact.save(target)
    nbytes = int(compact.columns.shard_bytes.clip(min=0).sum())
    print(
        f"{compact.num_shards} shards, {compact.num_samples} samples, {_human_bytes(nbytes)}, "
        f"{compact.total_tokens(patch_size)} tokens (patch {tuple(patch_size)})"
    )
    print(f"index: {compact.source}")
    counts = compact.counts()
    problems = {r: n for r, n in sorted(counts.items()) if r not in IGNORED_REASONS and r != "empty_shard"}
    print("skipped by reason: " + (", ".join(f"{r}={n}" for r, n in problems.items()) or "none"))
    _print_bucket_table(compact, patch_size, None, sys.stdout)
    return 1 if problems else 0


def _save_index(index: ShardIndex, output: str | None, fmt: str | None = None) -> None:
    """Save to ``output``, else beside the shards when they are local and in one folder."""
    if output:
        _keep_metadata(index, output)
        index.save(output, format=fmt)
        return
    folders = {os.path.dirname(p) for p in index.paths if not is_url(p)}
    if len(folders) == 1 and not any(is_url(p) for p in index.paths):
        target = os.path.join(folders.pop(), BINARY_INDEX_NAME if fmt == "binary" else INDEX_NAME)
        _keep_metadata(index, target)
        index.save(target, format=fmt)
    else:
        print(
            "note: shards are remote or in several directories; pass --output to save the index",
            file=sys.stderr,
        )


def _print_index_summary(index: ShardIndex, patch_size: Sequence[int]) -> int:
    """Print sizes, counts by reason and the bucket table; the exit status (1 when anything was skipped)."""
    nbytes = sum(max(s.num_bytes, 0) for s in index.shards)
    print(
        f"{index.num_shards} shards, {index.num_samples} samples, {_human_bytes(nbytes)}, "
        f"{index.total_tokens(patch_size)} tokens (patch {tuple(patch_size)})"
    )
    if index.source:
        print(f"index: {index.source}")
    counts = index.counts()
    problems = {r: n for r, n in sorted(counts.items()) if r not in IGNORED_REASONS and r != "empty_shard"}
    notes = {r: n for r, n in sorted(counts.items()) if r in IGNORED_REASONS or r == "empty_shard"}
    print("skipped by reason: " + (", ".join(f"{r}={n}" for r, n in problems.items()) or "none"))
    print("warnings: " + (", ".join(f"{r}={n}" for r, n in notes.items()) or "none"))
    _print_bucket_table(index, patch_size, None, sys.stdout)
    return 1 if problems else 0


def convert_index_parser() -> argparse.ArgumentParser:
    """The arguments of ``lightning-adaptiveload convert-index``."""
    parser = argparse.ArgumentParser(
        prog="lightning-adaptiveload convert-index",
        description="Convert an index between index.json and the binary columnar index.npidx (lossless).",
    )
    parser.add_argument("input", help="the index to read (its format is told by its first bytes)")
    parser.add_argument("output", help="the index to write")
    parser.add_argument(
        "--to",
        choices=("json", "binary"),
        default=None,
        help="output format (default: the other one of the input's)",
    )
    parser.add_argument(
        "--allow-outside", action="store_true", help="the index may name shards outside its folder"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def convert_index_main(argv: Sequence[str] | None = None) -> int:
    """``lightning-adaptiveload convert-index IN OUT``: JSON <-> binary index, with a progress bar.

    Returns:
        0 on success, 2 on an error (a damaged input, a missing file).
    """
    from tqdm.auto import tqdm

    from lightning_adaptiveload.shards.compact import CompactIndex

    args = convert_index_parser().parse_args(argv)
    try:
        binary_in = is_binary_index(args.input)
        to = args.to or ("json" if binary_in else "binary")
        compact = CompactIndex.load(args.input, allow_outside=args.allow_outside)
        if to == "binary":
            c = compact.columns  # the large arrays: about the file's size
            total = int(sum(a.nbytes for a in (c.key_blob, c.key_offsets, c.shape_id, c.text_len)))
            with tqdm(
                total=total, unit="B", unit_scale=True, desc="writing", disable=args.no_progress
            ) as bar:
                compact.save(args.output, progress=lambda done: bar.update(max(0, done - bar.n)))
        else:
            compact.to_shard_index().save(args.output, format="json")
    except (ShardError, FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    kind = "binary" if to == "binary" else "JSON"
    print(
        f"{compact.num_shards} shards, {compact.num_samples} samples -> {kind} index {os.path.abspath(args.output)}"
    )
    return 0
