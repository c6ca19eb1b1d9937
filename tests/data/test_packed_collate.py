"""The packed batch contract: per-sample latents, offsets, per-sample text with its own length, cost."""

import pytest
import torch

from lightning_adaptiveload.loading.packed_collate import collate_packed
from lightning_adaptiveload.planning.cost_model import CostModel


def _sample(key, shape, text_len):
    text = torch.randn(text_len, 8) if text_len is not None else None
    return {"__key__": key, "latent": torch.randn(shape), "text": text, "meta": {"k": key}}


def test_collate_packed_keeps_shapes_and_offsets():
    samples = [_sample("a", (4, 1, 4, 6), 3), _sample("b", (4, 3, 6, 4), None), _sample("c", (4, 1, 4, 4), 5)]
    cost = CostModel(kind="quadratic", alpha=1.0, beta=0.0, c0=10.0)
    b = collate_packed(samples, cost_model=cost, global_tokens=100)
    assert b["packed"] and b["keys"] == ["a", "b", "c"] and b["batch_size"] == 3
    assert [list(x.shape) for x in b["latents"]] == [[4, 1, 4, 6], [4, 3, 6, 4], [4, 1, 4, 4]]
    assert b["seq_lens"].tolist() == [6, 18, 4] and b["cu_seqlens"].tolist() == [0, 6, 24, 28]
    assert b["num_tokens"] == 28 and b["seq_len"] == 18 and b["global_tokens"] == 100
    assert b["cost"] == pytest.approx(10.0 + 28.0)
    assert b["text_lens"].tolist() == [3, 0, 5] and b["text_cu_seqlens"].tolist() == [0, 3, 3, 8]
    assert b["text"].shape == (3, 5, 8)
    assert b["text_mask"].sum(dim=1).tolist() == [3, 0, 5]
    torch.testing.assert_close(b["text"][0, :3], samples[0]["text"])
    torch.testing.assert_close(b["latents"][1], samples[1]["latent"])


def test_collate_packed_rejects_mixed_channels():
    with pytest.raises(ValueError, match="one channel count"):
        collate_packed([_sample("a", (4, 1, 4, 4), None), _sample("b", (8, 1, 4, 4), None)])
