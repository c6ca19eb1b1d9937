"""Helpers shared by tests: the multi-process data tests (test_ddp_data, test_resume, test_soak) and the
monitor's one-process fits.

Uneven synthetic shards, the keys of their index, the exactly-once check of an epoch's records (as written
by ``_ddp_data_runner.KeyRecorder``), the config of a run resumed from a checkpoint, and a quiet CPU trainer.
"""

from __future__ import annotations

import collections
import os

from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards


def uneven_shards(tmp_path_factory, name: str, sizes: list[int], seed: int, **settings) -> str:
    """A folder of synthetic ``tiny``-mix shards with these shard sizes; returns its path. ``settings``: more
    :class:`SyntheticShards` fields (``text_len_range=...``). Tests take it through the ``synthetic_shards``
    fixture of ``conftest.py``."""
    d = str(tmp_path_factory.mktemp(name))
    write_synthetic_shards(
        d,
        settings=SyntheticShards(
            mix="tiny", num_samples=sum(sizes), samples_per_shard=list(sizes), seed=seed, **settings
        ),
        progress=False,
    )
    return d


def index_keys(data: str) -> list[str]:
    """Every sample key of the shards in ``data``, in index order."""
    return [k for s in ShardIndex.load(os.path.join(data, "index.json")).shards for k in s.keys]


def epoch_rows(rows_by_rank: list[list[dict]], epoch: int) -> list[list[dict]]:
    """Per rank, the step records of ``epoch``."""
    return [[r for r in rows if r["epoch"] == epoch] for rows in rows_by_rank]


def assert_each_key_once(per_rank: list[list[dict]], keys: list[str], label: str) -> None:
    """Every key in exactly one batch across the ranks' records (none missing, none repeated)."""
    seen = collections.Counter(k for rows in per_rank for r in rows for k in r["keys"])
    assert sorted(seen) == sorted(keys), f"{label}: missing {sorted(set(keys) - set(seen))[:5]}"
    assert max(seen.values()) == 1, f"{label}: repeated {[k for k, n in seen.items() if n > 1][:5]}"


def resumed_run(run: dict, ckpt: str, name: str, num_workers: int) -> dict:
    """The config of ``run`` resumed from ``ckpt`` under a new name: no crash, no checkpoints."""
    return {
        **run,
        "name": name,
        "num_workers": num_workers,
        "kill_at": None,
        "ckpt_every": None,
        "resume": ckpt,
    }


def quiet_cpu_trainer(tmp_path, **trainer_kwargs):
    """A one-process CPU ``Trainer`` that writes nothing of its own (no logger, checkpoints, bars, summary);
    ``trainer_kwargs``: the rest (``max_steps=``, ``callbacks=``, ...)."""
    import lightning as L

    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
