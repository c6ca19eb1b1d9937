"""The per-segment ops of mixed packs equal their references in value and gradient (CPU, fp32, rtol 1e-5).

``segment_rows`` spreads per-sample rows to tokens with a segment-sum backward (issue 36: the advanced-index
gather it replaces had a sort-based CUDA backward that took 60% of a packed step); ``PackSegments`` describes
a pack without host copies; the attention paths that run inside ``torch.compile`` (block-diagonal masks) are
checked here in eager mode against the per-sample loops.
"""

import pytest
import torch

from lightning_adaptiveload.models import packing
from lightning_adaptiveload.models.pack_attention import equal_runs
from lightning_adaptiveload.models.packing import (
    PackSegments,
    cu_seqlens,
    segment_cross_attention,
    segment_ids,
    segment_rows,
    segment_self_attention,
    segment_sum,
)

HOWS = ["splits", "matmul", "index_add", "index", "auto"]


def _random_pack(seed: int, d: int = 24):
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (1,), generator=g))
    lens = torch.randint(1, 40, (n,), generator=g).tolist()
    rows = torch.randn(n, d, generator=g, dtype=torch.float32)
    return lens, rows, g


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("seed", range(6))
def test_segment_rows_equal_the_gather_in_value_and_gradient(how, seed, monkeypatch):
    monkeypatch.setattr(packing, "_segment_sum_route", lambda: how)
    lens, rows, g = _random_pack(seed)
    segments = PackSegments.build(lens, "cpu")
    dy = torch.randn(1, sum(lens), rows.shape[1], generator=g)

    leaf = rows.clone().requires_grad_()
    out = segment_rows(leaf, segments)
    (grad,) = torch.autograd.grad((out * dy).sum(), leaf)

    ref_leaf = rows.clone().requires_grad_()
    ref = torch.cat([ref_leaf[i].expand(s, -1) for i, s in enumerate(lens)])[None]  # per-sample broadcast
    (ref_grad,) = torch.autograd.grad((ref * dy).sum(), ref_leaf)
    assert out.shape == (1, sum(lens), rows.shape[1])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("how", ["splits", "matmul", "index_add"])
def test_segment_sum_equals_a_loop_over_segments(how):
    lens = [5, 1, 17, 3]
    seg = segment_ids(lens)
    values = torch.randn(sum(lens), 3, 4)
    out = segment_sum(values, seg, len(lens), lens, how)
    ref = torch.stack([part.sum(0) for part in values.split(lens)])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_segment_sum_names_what_is_missing():
    with pytest.raises(ValueError, match="host ints"):
        segment_sum(torch.ones(3, 2), segment_ids([3]), 1, None, "splits")
    with pytest.raises(ValueError, match="how must be"):
        segment_sum(torch.ones(3, 2), segment_ids([3]), 1, [3], "scatter")


def test_unknown_segment_sum_setting_is_refused(monkeypatch):
    monkeypatch.setattr(packing, "_segment_sum_route", lambda: "sort")
    with pytest.raises(ValueError, match="segment sum route must be one of"):
        segment_rows(torch.ones(2, 3), PackSegments.build([1, 2], "cpu"))


def test_pack_segments_describe_the_pack_and_order_real_text_first():
    mask = torch.tensor([[True, True, False, False], [False, False, False, False], [True, False, True, True]])
    s = PackSegments.build([3, 1, 2], "cpu", mask, 4, varlen_text=True)
    assert s.lens == (3, 1, 2) and s.max_len == 3 and s.num_samples == 3
    assert s.seg.tolist() == [0, 0, 0, 1, 2, 2] and s.cu.tolist() == cu_seqlens([3, 1, 2]).tolist()
    assert s.cu.dtype == torch.int32 and s.text_cu.dtype == torch.int32
    assert s.text_cu.tolist() == [0, 2, 2, 5]
    # Real tokens of sample 0, none of 1, those of 2 (positions 8, 10, 11 of the flattened 3 x 4), then padding.
    assert s.text_order[:5].tolist() == [0, 1, 8, 10, 11]
    assert sorted(s.text_order.tolist()) == list(range(12))
    assert s.has_text.tolist() == [True, True, True, False, True, True]
    plain = PackSegments.build([3, 1], "cpu", None, 4, varlen_text=True)
    assert plain.text_cu.tolist() == [0, 4, 8] and plain.has_text is None
    assert PackSegments.build([3, 1], "cpu").text_cu is None  # no varlen kernel: nothing to build


def _qkv(lens, heads=2, d=8, text=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    s, n = sum(lens), len(lens)
    q, k, v = (torch.randn(1, heads, s, d, generator=g) for _ in range(3))
    tk, tv = (torch.randn(n, heads, text, d, generator=g) for _ in range(2))
    mask = torch.rand(n, text, generator=g) > 0.4
    mask[1] = False  # one sample without text
    return q, k, v, tk, tv, mask


def _attend(q, k, v, mask):
    from lightning_adaptiveload.models.layers import CrossAttention

    return CrossAttention._attend(type("A", (), {"query_splits": 1, "backends": None})(), q, k, v, mask)


@pytest.mark.parametrize("lens", [[5, 3, 9], [1, 12, 2, 2]])
def test_mask_paths_used_under_compile_equal_the_per_sample_loops(lens, monkeypatch):
    # Inside torch.compile (off the varlen kernel) attention takes block-diagonal masks, not a loop over
    # samples; checked here in eager mode by making the code believe it is compiling.
    q, k, v, tk, tv, mask = _qkv(lens)
    segments = PackSegments.build(lens, "cpu", mask, mask.shape[1])
    leaves = [t.clone().requires_grad_() for t in (q, k, v, tk, tv)]

    def run():
        a = segment_self_attention(*leaves[:3], segments)
        c = segment_cross_attention(leaves[0], leaves[3], leaves[4], mask, segments, _attend)
        out = a.square().sum() + (c * torch.linspace(-1, 1, c.numel()).view_as(c)).sum()
        return [a, c, *torch.autograd.grad(out, leaves)]

    ref = run()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    got = run()
    for r, o in zip(ref, got):
        torch.testing.assert_close(o, r, rtol=1e-5, atol=1e-5)
    # The sample without text gets zeros from both paths.
    start, end = lens[0], lens[0] + lens[1]
    assert torch.count_nonzero(got[1][:, :, start:end]) == 0


def test_segment_attention_batches_runs_of_equal_lengths_exactly():
    import torch.nn.functional as F

    from lightning_adaptiveload.models import packing

    assert equal_runs([3, 3, 5, 3, 3, 3]) == [(3, 2), (5, 1), (3, 3)]
    g = torch.Generator().manual_seed(0)
    lens = [4, 4, 4, 7, 2, 2]
    s = sum(lens)
    q, k, v = (torch.randn(1, 3, s, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = packing.segment_attention(q, k, v, packing.cu_seqlens(lens), lens, varlen=False)
    start, ref = 0, []
    for n in lens:
        sl = slice(start, start + n)
        ref.append(F.scaled_dot_product_attention(q[:, :, sl], k[:, :, sl], v[:, :, sl]))
        start += n
    torch.testing.assert_close(out, torch.cat(ref, dim=2), rtol=1e-12, atol=1e-12)
