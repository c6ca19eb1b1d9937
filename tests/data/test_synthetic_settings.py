"""SyntheticShards: each bad value rejected once, in one place; the recipe's ``synthetic:`` keys are its fields;
write_synthetic_shards takes them as one SyntheticShards (not as flat keywords or a positional mix)."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_adaptiveload.loading.datamodule_inputs import check_synthetic
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(num_samples=0), "num_samples"),
        (dict(samples_per_shard=0), "samples_per_shard"),
        (dict(num_samples=6, samples_per_shard=[1, 4]), "samples_per_shard"),
        (dict(text_len_range=(5, 2)), "text_len_range"),
        (dict(text_dim=0), "text_dim"),
        (dict(dtype="int8"), "dtype"),
        (dict(content="waves"), "content"),
    ],
)
def test_each_bad_value_is_rejected_once_by_synthetic_shards(kwargs, field, tmp_path):
    with pytest.raises(ValueError, match=field) as err:
        SyntheticShards(**kwargs)
    # One error site: SyntheticShards.__post_init__ (or the helper it calls); write_synthetic_shards has none.
    assert "__post_init__" in {entry.name for entry in err.traceback}
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        write_synthetic_shards(tmp_path, progress=False, **kwargs)
    assert not (tmp_path / "index.json").exists()


def test_the_recipe_keys_are_the_settings_fields():
    fields = [f.name for f in dataclasses.fields(SyntheticShards)]
    assert check_synthetic({k: None for k in fields} | {"val_num_samples": 8})
    with pytest.raises(ValueError, match="did you mean 'num_samples'"):
        check_synthetic({"num_sample": 8})
    with pytest.raises(ValueError, match="no setting 'progress'"):  # the DataModule's own, as before
        check_synthetic({"progress": True})


def test_settings_are_frozen_keyword_only_and_normalised():
    s = SyntheticShards(dtype="float32", text_len_range=[1, 3], num_samples=4, samples_per_shard=(1, 3))
    assert (s.dtype, s.text_len_range, s.samples_per_shard) == ("float32", (1, 3), [1, 3])
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.seed = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        SyntheticShards("tiny")  # type: ignore[misc]


def test_the_settings_are_one_object_and_a_positional_mix_is_refused(tmp_path):
    index = write_synthetic_shards(
        tmp_path / "new",
        SyntheticShards(mix="tiny", num_samples=6, samples_per_shard=3, seed=2),
        progress=False,
    )
    assert index.num_samples == 6 and index.metadata["synthetic"]["mix"] == "tiny"
    with pytest.raises(TypeError, match=r"settings must be a SyntheticShards, got 'tiny'.*SyntheticShards\(mix=\.\.\.\)"):
        write_synthetic_shards(tmp_path / "old", "tiny", progress=False)  # type: ignore[arg-type]
    assert not (tmp_path / "old").exists()
    with pytest.raises(TypeError, match="unexpected keyword argument 'num_samples'"):
        write_synthetic_shards(tmp_path / "x", num_samples=6)  # type: ignore[call-arg]
