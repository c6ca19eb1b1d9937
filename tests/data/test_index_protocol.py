"""Both shard indexes implement ShardIndexLike, with the protocol's signatures, and agree on a real index."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from lightning_adaptiveload.shards.compact import CompactIndex
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.protocol import ShardIndexLike
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards

MEMBERS = [n for n in vars(ShardIndexLike) if not n.startswith("_")]


def test_the_protocol_lists_what_the_package_asks():
    assert {"shards", "num_samples", "paths", "sample_refs", "latent_shape", "skipped"} <= set(MEMBERS)


@pytest.mark.parametrize("cls", [ShardIndex, CompactIndex])
@pytest.mark.parametrize("name", MEMBERS)
def test_each_index_implements_each_member_with_its_signature(cls, name):
    want = vars(ShardIndexLike)[name]
    if dataclasses.is_dataclass(cls) and name in {f.name for f in dataclasses.fields(cls)}:
        assert isinstance(want, property), f"{cls.__name__}.{name} is a field, the protocol has a method"
        return
    have = getattr(cls, name, None)
    assert have is not None, f"{cls.__name__} lacks {name}"
    if isinstance(want, property):
        assert isinstance(have, property) or not callable(have), f"{cls.__name__}.{name} must be an attribute"
        return
    want_params = list(inspect.signature(want).parameters)
    have_params = list(inspect.signature(have).parameters)
    assert have_params == want_params, (cls.__name__, name, have_params, want_params)


def test_both_indexes_answer_alike(tmp_path):
    write_synthetic_shards(
        str(tmp_path), settings=SyntheticShards(num_samples=24, samples_per_shard=8, mix="tiny", seed=3)
    )
    plain = ShardIndex.build(str(tmp_path))
    compact = CompactIndex.from_shard_index(plain)
    for index in (plain, compact):
        assert isinstance(index, ShardIndexLike)
    assert plain.num_samples == compact.num_samples == 24
    assert plain.paths == compact.paths
    assert plain.sample_refs() == compact.sample_refs()
    assert [plain.latent_shape(r) for r in plain.sample_refs()] == [
        compact.latent_shape(r) for r in compact.sample_refs()
    ]
    assert plain.total_tokens() == compact.total_tokens()
    assert plain.counts() == compact.counts() and plain.skipped() == compact.skipped()
    assert not isinstance(object(), ShardIndexLike)
