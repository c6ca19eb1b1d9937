"""Equal-length packs run dense batched SDPA, mixed packs the segment path; both equal per-sample (CPU, fp32)."""

import logging

import pytest
import torch

from lightning_adaptiveload.models import packing
from lightning_adaptiveload.models.packing import attention_route
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

# Three grids of 24 tokens each (patch 1x2x2): equal lengths, different shapes, so RoPE still differs.
EQUAL = [(16, 1, 8, 12), (16, 1, 12, 8), (16, 2, 6, 8)]
MIXED = [(16, 1, 8, 12), (16, 3, 10, 10), (16, 1, 10, 10)]
TEXT_LENS = [5, 0, 3]  # unequal text lengths, one sample without text


def _model() -> VideoDiT:
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    with torch.no_grad():  # the zero-initialised head would hide every difference upstream of it
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.train()


def _inputs(model, shapes):
    g = torch.Generator().manual_seed(1)
    latents = [torch.randn(s, generator=g) for s in shapes]
    t = torch.rand(len(shapes), generator=g) * 1000
    d = model.config.text_dim
    text = torch.zeros(len(shapes), max(TEXT_LENS), d)
    mask = torch.zeros(len(shapes), max(TEXT_LENS), dtype=torch.bool)
    for i, n in enumerate(TEXT_LENS):
        text[i, :n] = torch.randn(n, d, generator=g)
        mask[i, :n] = True
    return latents, t, text, mask


def test_route_is_dense_only_for_equal_lengths():
    assert attention_route([24, 24, 24]) == "dense"
    assert attention_route([7]) == "dense"
    assert attention_route([24, 24, 25]) == "segments"
    assert attention_route([100, 24]) == "segments"
    with pytest.raises(ValueError, match="at least one sample"):
        attention_route([])


@pytest.mark.parametrize("shapes, route", [(EQUAL, "dense"), (MIXED, "segments")])
def test_both_routes_equal_per_sample_forward_and_backward(shapes, route, monkeypatch, caplog):
    model = _model()
    latents, t, text, mask = _inputs(model, shapes)
    lens = [s[1] * (s[2] // 2) * (s[3] // 2) for s in shapes]
    assert attention_route(lens) == route

    calls = []
    original = packing.segment_self_attention
    monkeypatch.setattr(packing, "segment_self_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    monkeypatch.setattr(packing, "_logged_routes", set())
    with caplog.at_level(logging.INFO, logger=packing.__name__):
        preds = model.forward_packed(latents, t, text, mask)
        loss = sum(p.square().sum() for p in preds) / 64  # per token, as the flow loss
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
        model.forward_packed(latents, t, text, mask)  # a second step logs nothing more
    # The dense route never enters the segment path; the segment route does once per block.
    assert len(calls) == (0 if route == "dense" else 2 * model.config.num_layers)
    lines = [r.getMessage() for r in caplog.records if r.name == packing.__name__]
    assert len(lines) == 1
    assert ("batched SDPA" in lines[0]) == (route == "dense")

    ref_preds = []
    for i, x in enumerate(latents):
        n = max(TEXT_LENS[i], 1)
        ref_preds.append(model(x[None], t[i : i + 1], text[i : i + 1, :n], mask[i : i + 1, :n])[0])
    ref_loss = sum(p.square().sum() for p in ref_preds) / 64
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()), allow_unused=True)
    for p, r in zip(preds, ref_preds):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        if r is None:
            assert g is None or torch.count_nonzero(g) == 0, name
            continue
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.cuda
@pytest.mark.parametrize("shapes, route", [(EQUAL, "dense"), (MIXED, "segments")])
def test_routes_on_cuda_under_bf16_autocast(shapes, route, monkeypatch):
    # Equal lengths take batched SDPA, mixed lengths the segment path (varlen_attn where torch has it);
    # both stay within bf16 rounding of the per-sample computation.
    model = _model().cuda()
    latents, t, text, mask = _inputs(model, shapes)
    latents, t, text, mask = [x.cuda() for x in latents], t.cuda(), text.cuda(), mask.cuda()
    calls = []
    original = packing.segment_self_attention
    monkeypatch.setattr(packing, "segment_self_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        preds = model.forward_packed(latents, t, text, mask)
        refs = [
            model(x[None], t[i : i + 1], text[i : i + 1], mask[i : i + 1])[0] for i, x in enumerate(latents)
        ]
    assert (len(calls) == 0) == (route == "dense")
    for p, r in zip(preds, refs):
        rel = (p.float() - r.float()).norm() / r.float().norm()
        assert rel < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("how", ["auto", "matmul", "index_add"])
@pytest.mark.parametrize("self_attention", ["auto", "varlen"])
def test_mixed_pack_gradients_on_cuda_under_bf16_autocast(how, self_attention, monkeypatch):
    # The segments route on CUDA: self-attention as one dense call per run of equal lengths ("auto") or
    # through the varlen kernel ("varlen"); cross-attention through varlen (text keys reordered, one sample
    # without text); per-token rows with a segment-sum backward; gradients within bf16 rounding of per sample.
    from lightning_adaptiveload.models import pack_attention
    from lightning_adaptiveload.models.packing import varlen_attention_available

    monkeypatch.setattr(packing, "_segment_sum_route", lambda: how)
    monkeypatch.setattr(packing, "_segment_attention_route", lambda: self_attention)
    model = _model().cuda()
    latents, t, text, mask = _inputs(model, MIXED)
    latents, t, text, mask = [x.cuda() for x in latents], t.cuda(), text.cuda(), mask.cuda()
    calls, runs_calls = [], []
    original, original_runs = packing._varlen, pack_attention.pack_runs_attention
    monkeypatch.setattr(packing, "_varlen", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr(
        pack_attention, "pack_runs_attention", lambda *a, **k: runs_calls.append(1) or original_runs(*a, **k)
    )

    def grads(run):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            preds = run()
        sum(p.float().square().sum() for p in preds).backward()
        return preds, {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    preds, got = grads(lambda: model(latents, t, text, mask))
    layers = model.config.num_layers
    if varlen_attention_available():
        if self_attention == "varlen":  # self- and cross-attention of every block
            assert (len(calls), len(runs_calls)) == (2 * layers, 0)
        else:  # self-attention per run of equal lengths (a dense kernel), cross-attention varlen
            assert (len(calls), len(runs_calls)) == (layers, layers)
    refs, want = grads(
        lambda: [
            model(x[None], t[i : i + 1], text[i : i + 1], mask[i : i + 1])[0] for i, x in enumerate(latents)
        ]
    )
    for p, r in zip(preds, refs):
        assert (p.float() - r.float()).norm() / r.float().norm() < 2e-2
    for name, r in want.items():
        rel = (got[name] - r).norm() / r.norm().clamp_min(1e-12)
        assert rel < 5e-2, (name, float(rel))
