"""Do all ranks hold the same index? One all-gather of a few numbers per index, and the message if not.

Ranks that would plan different epochs fail here, each with the same message, instead of hanging at
the first collective of the epoch. Pure: talks to ``torch.distributed`` through ``_dist`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_adaptiveload import _dist
from lightning_adaptiveload.planning.inputs import index_fingerprint
from lightning_adaptiveload.shards.protocol import ShardIndexLike

__all__ = ["check_indexes_agree", "index_disagreement"]

_INDEX_FIELDS = ("shards", "samples", "fingerprint")


def _index_summary(index: ShardIndexLike) -> list[float]:
    """Shard count, sample count and the two 32-bit halves of the index fingerprint, exact as floats."""
    fp = index_fingerprint(index)
    samples = index.num_samples
    return [float(index.num_shards), float(samples), float(int(fp[:8], 16)), float(int(fp[8:], 16))]


def index_disagreement(names: Sequence[str], gathered: Sequence[Sequence[float]]) -> str | None:
    """What differs between the ranks' indexes, in words; None when every rank has the same.

    Args:
        names: the indexes compared (e.g. ``["train", "validation"]``).
        gathered: per rank, :func:`_index_summary` of each index in ``names`` order, concatenated.
    """
    lines = []
    for j, name in enumerate(names):
        rows = [tuple(g[4 * j : 4 * j + 4]) for g in gathered]
        if len(set(rows)) == 1:
            continue
        # Other counts imply another fingerprint; name the fingerprint alone only when the counts agree.
        differ = [f for f, k in zip(_INDEX_FIELDS, (0, 1)) if len({r[k] for r in rows}) > 1]
        differ = differ or ["fingerprint"]
        per_rank = "; ".join(
            f"rank {r}: {int(row[0])} shards, {int(row[1])} samples, fingerprint "
            f"{int(row[2]):08x}{int(row[3]):08x}"
            for r, row in enumerate(rows)
        )
        lines.append(f"the {name} index differs between ranks ({', '.join(differ)}): {per_rank}")
    return "\n".join(lines) or None


def check_indexes_agree(loaded: list[tuple[str, Any, Any]]) -> None:
    """One all-gather of a few numbers per index: ranks that would plan different epochs fail here, each
    with the same message, instead of hanging at the first collective of the epoch."""
    local = [v for _, _, index in loaded for v in _index_summary(index)]
    message = index_disagreement([name for name, _, _ in loaded], _dist.all_gather_floats(local))
    if message is not None:
        sources = "; ".join(f"{name} shards {shards!r}" for name, shards, _ in loaded)
        raise RuntimeError(
            f"{message}. Every rank must index the same samples ({sources}): check that the paths or URL "
            "patterns resolve to the same shards on every node (a shard written while the job started, a "
            "different mount), or build the index once (`lightning-adaptiveload index ...`) and give every "
            "rank the same index.json"
        )
