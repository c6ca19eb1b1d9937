"""Structured synthetic latents (``content="structured"``): learnable, deterministic, recorded."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.shards.synthetic import SyntheticShards, structured_latent, write_synthetic_shards


def _draw(shape, n, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([structured_latent(rng, shape) for _ in range(n)])


def _channel_subspace(x: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """The top-k channel directions of latents x (N, C, T, H, W) and the share of energy they hold."""
    m = x.transpose(1, 0, 2, 3, 4).reshape(x.shape[1], -1)
    u, s, _ = np.linalg.svd(m, full_matrices=False)
    return u[:, :k], float((s[:k] ** 2).sum() / (s**2).sum())


def test_structured_latent_is_deterministic_unit_scale_float32():
    a, b = _draw((16, 3, 8, 12), 4), _draw((16, 3, 8, 12), 4)
    assert a.dtype == np.float32 and a.shape == (4, 16, 3, 8, 12)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, _draw((16, 3, 8, 12), 4, seed=1))
    assert 0.5 < float(_draw((16, 5, 8, 12), 64).var()) < 1.5


def test_structured_latent_lies_in_few_smooth_channel_directions():
    x = _draw((16, 5, 8, 12), 64)
    _, share = _channel_subspace(x, 4)
    assert share > 0.95  # 4 directions hold nearly all the energy (the rest is the 0.1 residual)
    noise = np.random.default_rng(0).standard_normal(x.shape)
    assert _channel_subspace(noise, 4)[1] < 0.4  # i.i.d. noise spreads over all 16

    def neighbour_corr(v):  # correlation of horizontally adjacent elements
        return float(np.corrcoef(v[..., :-1].ravel(), v[..., 1:].ravel())[0, 1])

    assert neighbour_corr(x) > 0.5
    assert abs(neighbour_corr(noise)) < 0.05


def test_images_and_clips_share_two_directions_and_own_two():
    img, _ = _channel_subspace(_draw((16, 1, 8, 12), 256), 4)
    clip, _ = _channel_subspace(_draw((16, 9, 8, 12), 64), 4)
    cosines = np.linalg.svd(img.T @ clip, compute_uv=False)  # cosines of the principal angles
    assert (cosines > 0.98).sum() == 2  # the shared directions
    assert (cosines < 0.9).sum() == 2  # each frame count's own


def test_write_structured_shards_records_content_and_default_does_not(tmp_path):
    idx = write_synthetic_shards(
        tmp_path / "s",
        settings=SyntheticShards(mix="tiny", num_samples=6, samples_per_shard=3, content="structured"),
        progress=False,
    )
    assert idx.metadata["synthetic"]["content"] == "structured"
    again = write_synthetic_shards(
        tmp_path / "s",
        settings=SyntheticShards(mix="tiny", num_samples=6, samples_per_shard=3, content="structured"),
        progress=False,
    )
    assert again.metadata == idx.metadata  # reused, not rewritten
    with pytest.raises(FileExistsError):
        write_synthetic_shards(
            tmp_path / "s",
            settings=SyntheticShards(mix="tiny", num_samples=6, samples_per_shard=3),
            progress=False,
        )
    plain = write_synthetic_shards(
        tmp_path / "n",
        settings=SyntheticShards(mix="tiny", num_samples=6, samples_per_shard=3),
        progress=False,
    )
    # Shards written before the option existed keep matching their settings.
    assert "content" not in plain.metadata["synthetic"]
    with open(os.path.join(tmp_path / "n", "index.json")) as f:
        assert "content" not in json.load(f)["metadata"]["synthetic"]


def test_unknown_content_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="content must be one of .*'waves'"):
        write_synthetic_shards(
            tmp_path, settings=SyntheticShards(mix="tiny", num_samples=2, content="waves"), progress=False
        )


def test_datamodule_accepts_content_in_synthetic_settings(tmp_path):
    from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule

    dm = AdaptiveLoadDataModule(
        train_shards=str(tmp_path / "train"),
        synthetic={"mix": "tiny", "num_samples": 4, "samples_per_shard": 2, "content": "structured"},
        loader=Loader(num_workers=0),
    )
    dm.prepare_data()
    with open(tmp_path / "train" / "index.json") as f:
        assert json.load(f)["metadata"]["synthetic"]["content"] == "structured"
