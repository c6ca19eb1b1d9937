"""IngestSettings: each bad value rejected once, in one place, before ingest() touches a file; ingest takes its
settings as one IngestSettings, not as flat keywords."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_adaptiveload.ingest.job import ingest
from lightning_adaptiveload.ingest.settings import IngestSettings


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(fps=0.0), "fps"),
        (dict(max_frames=0), "max_frames"),
        (dict(buckets="480x830"), "buckets"),
        (dict(samples_per_shard=0), "samples_per_shard"),
        (dict(latent_dtype="int8"), "latent_dtype"),
        (dict(on_error="ignore"), "on_error"),
        (dict(num_workers=-1), "num_workers"),
        (dict(dtype="float64"), "dtype"),
    ],
)
def test_each_bad_value_is_rejected_once_by_ingest_settings(kwargs, field, tmp_path):
    with pytest.raises(ValueError, match=field) as err:
        IngestSettings(**kwargs)
    assert err.traceback[-1].name == "__post_init__"  # the one error site
    assert repr(next(iter(kwargs.values()))) in str(err.value)
    out = tmp_path / "out"
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        ingest(tmp_path / "nothing", out, "tiny-random", **kwargs)
    assert not out.exists()  # refused before any file was touched


def test_ingest_settings_are_frozen_and_keyword_only():
    settings = IngestSettings()
    assert (settings.buckets, settings.max_frames, settings.on_error) == ("wan480p", 81, "skip")
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.fps = 8.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        IngestSettings(16.0)  # type: ignore[misc]
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_frames'"):
        ingest("in", "out", "tiny-random", max_frames=5)  # type: ignore[call-arg]
