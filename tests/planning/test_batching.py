import collections
import io
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.loading.collate import collate
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.sizing import tokens_per_sample
from lightning_adaptiveload.shards.synthetic import SyntheticShards

QUAD = CostModel(kind="quadratic", alpha=1.0, beta=0.01)


def sample(key, shape, text_len=None, dtype=torch.float16):
    text = None if text_len is None else torch.ones(text_len, 8, dtype=dtype)
    return {"__key__": key, "latent": torch.zeros(shape, dtype=dtype), "text": text, "meta": {"k": key}}


def test_tokens_per_sample():
    assert tokens_per_sample((16, 21, 60, 104)) == 32760  # Wan 2.1, 480x832, 81 frames
    assert tokens_per_sample((21, 60, 104)) == 32760
    assert tokens_per_sample((16, 4, 8, 8), (2, 4, 4)) == 8
    with pytest.raises(ValueError, match=r"\[16, 21, 61, 104\].*not divisible"):
        tokens_per_sample((16, 21, 61, 104))
    with pytest.raises(ValueError, match="must be"):
        tokens_per_sample((1, 16, 21, 60, 104))
    with pytest.raises(ValueError, match="patch_size"):
        tokens_per_sample((16, 1, 4, 4), (1, 0, 2))


def test_batch_sizes_equal_tokens_and_dual():
    eq = DualConstraintBatcher(1000, sizing="equal_tokens")
    assert eq.batch_size((4, 1, 10, 10)) == 40  # S = 25
    assert eq.batch_size((4, 8, 10, 10)) == 5  # S = 200
    dual = DualConstraintBatcher(1000, max_compute=1000.0, cost_model=QUAD)
    # cost(25) = 25 + 6.25 = 31.25 -> floor(1000/31.25) = 32 < 40
    assert dual.batch_size((4, 1, 10, 10)) == 32
    # cost(200) = 600 -> compute allows 1, tokens allow 5
    assert dual.batch_size((4, 8, 10, 10)) == 1
    # one sample over the compute cap is still allowed (B >= 1)
    assert dual.batch_size((4, 36, 10, 10)) == 1 and not dual.satisfies(2, 900)
    assert dual.satisfies(1, 900)


def test_auto_max_compute_rule():
    shapes = [(4, 1, 10, 10), (4, 8, 10, 10), (4, 2, 10, 10)]
    b = DualConstraintBatcher(1000, max_compute="auto", cost_model=QUAD)
    assert b.needs_resolution
    with pytest.raises(ValueError, match="resolve_max_compute"):
        b.batch_size(shapes[0])
    cap = b.resolve_max_compute(shapes)
    expect = min((1000 // s) * QUAD.cost(s) for s in (25, 200, 50))
    assert cap == pytest.approx(expect)
    # the cheapest full bucket keeps its full token batch exactly (no float loss in floor)
    cheapest = min((25, 200, 50), key=lambda s: (1000 // s) * QUAD.cost(s))
    shape = {25: shapes[0], 200: shapes[1], 50: shapes[2]}[cheapest]
    assert b.batch_size(shape) == 1000 // cheapest
    assert DualConstraintBatcher(1000, max_compute=None, cost_model=QUAD).needs_resolution  # None means auto
    assert DualConstraintBatcher(1000, sizing="equal_tokens").resolve_max_compute(shapes) is None


def test_settings_errors():
    with pytest.raises(ValueError, match="cost_model"):
        DualConstraintBatcher(1000, max_compute=5.0)  # a number needs the model whose unit it is
    for kwargs in (
        {"sizing": "x"},
        {"oversize": "drop"},
        {"partial": "drop"},
        {"max_compute": "fast"},
        {"max_compute": -1.0, "cost_model": QUAD},
    ):
        with pytest.raises(ValueError):
            DualConstraintBatcher(1000, **kwargs)
    with pytest.raises(ValueError, match="max_tokens"):
        DualConstraintBatcher(0)


def test_oversize_policies():
    raising = DualConstraintBatcher(100, sizing="equal_tokens")
    with pytest.raises(ValueError, match="more than max_tokens=100"):
        raising.batch_size((4, 8, 10, 10))
    with pytest.raises(ValueError, match="'big'"):
        list(raising([sample("big", (4, 8, 10, 10))]))
    skipping = DualConstraintBatcher(100, sizing="equal_tokens", oversize="skip")
    assert skipping.batch_size((4, 8, 10, 10)) == 0
    out = list(skipping([sample("big", (4, 8, 10, 10)), sample("ok", (4, 1, 10, 10))]))
    assert [b["keys"] for b in out] == [["ok"]]
    assert skipping.stats["skipped_oversize"] == 1 and skipping.stats["samples"] == 2


def test_partial_emit_and_carry():
    data = [sample(f"a{i}", (4, 1, 10, 10)) for i in range(5)]  # B = 4 at 100 tokens
    emit = DualConstraintBatcher(100, sizing="equal_tokens")
    out = list(emit(data))
    assert [len(b["keys"]) for b in out] == [4, 1] and emit.stats["partial_batches"] == 1
    carry = DualConstraintBatcher(100, sizing="equal_tokens", partial="carry")
    first = list(carry(data))
    assert [len(b["keys"]) for b in first] == [4] and carry.stats["carried"] == 1
    second = list(carry([sample(f"b{i}", (4, 1, 10, 10)) for i in range(3)]))
    assert second[0]["keys"] == ["a4", "b0", "b1", "b2"]  # carried sample first, nothing lost


def test_channel_mismatch_in_a_bucket_raises():
    b = DualConstraintBatcher(1000, sizing="equal_tokens")
    with pytest.raises(ValueError, match="C=8.*C=4"):
        list(b([sample("x", (4, 1, 10, 10)), sample("y", (8, 1, 10, 10))]))


def test_collate_contract_and_text_padding():
    cm = CostModel(kind="power", p=1.0)
    batch = collate(
        [sample("a", (4, 2, 4, 6), 3), sample("b", (4, 2, 4, 6), None), sample("c", (4, 2, 4, 6), 5)],
        cost_model=cm,
        global_tokens=99,
    )
    assert batch["latents"].shape == (3, 4, 2, 4, 6) and batch["latents"].dtype == torch.float16
    assert batch["text"].shape == (3, 5, 8) and batch["text_mask"].tolist() == [
        [True] * 3 + [False] * 2,
        [False] * 5,
        [True] * 5,
    ]
    assert batch["text"][0, 3:].abs().sum() == 0
    assert batch["seq_len"] == 12 and batch["batch_size"] == 3 and batch["num_tokens"] == 36
    assert batch["cost"] == pytest.approx(36.0) and batch["global_tokens"] == 99
    assert batch["keys"] == ["a", "b", "c"] and batch["meta"][2] == {"k": "c"}
    no_text = collate([sample("a", (4, 2, 4, 6))])
    assert no_text["text"] is None and no_text["text_mask"] is None and no_text["global_tokens"] == -1
    mixed = collate([sample("a", (4, 2, 4, 6)), sample("b", (4, 2, 4, 6), dtype=torch.float32)])
    assert mixed["latents"].dtype == torch.float32
    with pytest.raises(ValueError, match="one shape"):
        collate([sample("a", (4, 2, 4, 6)), sample("b", (4, 2, 4, 4))])
    with pytest.raises(ValueError, match="D_text"):
        s2 = sample("b", (4, 2, 4, 6))
        s2["text"] = torch.ones(2, 9)
        collate([sample("a", (4, 2, 4, 6), 2), s2])


SHAPES = [(4, t, h, w) for t in (1, 3, 5) for h, w in ((4, 6), (6, 4), (4, 4))]


@settings(max_examples=150, deadline=None)
@given(
    picks=st.lists(st.integers(0, len(SHAPES) - 1), max_size=80),
    max_tokens=st.integers(4, 120),
    sizing=st.sampled_from(["dual", "equal_tokens"]),
    p=st.floats(1.0, 2.5),
    oversize=st.sampled_from(["raise", "skip"]),
)
def test_property_every_batch_meets_both_caps_and_nothing_is_lost(picks, max_tokens, sizing, p, oversize):
    """Every batch: one shape, B*S <= max_tokens, B*cost(S) <= max_compute unless B = 1 (a single sample
    whose own compute exceeds the cap is allowed, but never one over the token cap); the multiset of
    yielded keys + skipped oversize samples == the input's."""
    data = [sample(f"k{i}", SHAPES[j]) for i, j in enumerate(picks)]
    fits = [tokens_per_sample(SHAPES[j]) <= max_tokens for j in picks]
    cm = CostModel(kind="power", p=p)
    if any(fits):
        b = DualConstraintBatcher(max_tokens, cost_model=cm, sizing=sizing, oversize=oversize)
        b.resolve_max_compute(SHAPES[j] for j in picks)
    else:  # "auto" needs a sample within the cap; use a numeric cap
        b = DualConstraintBatcher(max_tokens, max_compute=10.0, cost_model=cm, sizing=sizing, oversize=oversize)
    too_big = fits.count(False)
    if too_big and oversize == "raise":
        with pytest.raises(ValueError, match="max_tokens"):
            list(b(data))
        return
    out = list(b(data))
    for batch in out:
        s, n = batch["seq_len"], batch["batch_size"]
        assert len({tuple(x.shape) for x in batch["latents"]}) == 1
        assert n * s <= max_tokens
        assert b.satisfies(n, s)
        if sizing == "dual" and n > 1:
            assert b.cost_model.batch_cost(n, s) <= b.max_compute * (1 + 1e-9)
    got = collections.Counter(k for batch in out for k in batch["keys"])
    want = collections.Counter(
        f"k{i}" for i, j in enumerate(picks) if tokens_per_sample(SHAPES[j]) <= max_tokens
    )
    assert got == want
    assert b.stats["skipped_oversize"] == too_big
    assert b.stats["samples"] == len(data)


def _npy(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def test_batcher_is_a_webdataset_pipeline_stage(tmp_path):
    import webdataset as wds

    from lightning_adaptiveload.shards.synthetic import write_synthetic_shards

    index = write_synthetic_shards(
        str(tmp_path),
        settings=SyntheticShards(mix="tiny", num_samples=60, samples_per_shard=20, seed=1),
        progress=False,
    )
    urls = [s.path for s in index.shards]
    batcher = DualConstraintBatcher(512, sizing="dual")
    batcher.resolve_max_compute(s for sh in index.shards for s in sh.latent_shapes)

    def decode(sample):  # our own safe decoding: never webdataset's pickle-capable defaults
        out = {"__key__": sample["__key__"], "latent.npy": _npy(sample["latent.npy"])}
        if "text.npy" in sample:
            out["text.npy"] = _npy(sample["text.npy"])
        if "json" in sample:
            out["json"] = json.loads(sample["json"])
        return out

    pipeline = wds.DataPipeline(wds.SimpleShardList(urls), wds.tarfile_to_samples(), wds.map(decode), batcher)
    batches = list(pipeline)
    keys = [k for b in batches for k in b["keys"]]
    assert sorted(keys) == sorted(k for s in index.shards for k in s.keys)
    for b in batches:
        assert b["batch_size"] == len(b["keys"]) == b["latents"].shape[0]
        assert batcher.satisfies(b["batch_size"], b["seq_len"])
        assert isinstance(b["meta"][0], dict)
    assert os.path.exists(urls[0])
