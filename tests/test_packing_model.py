"""A pack through the tiny VideoDiT equals the per-sample computation, forward and backward (CPU, fp32)."""

import pytest
import torch

from lightning_adaptiveload.models.packing import cu_seqlens, flow_loss_packed, segment_ids
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

SHAPES = [(16, 1, 8, 12), (16, 3, 10, 10), (16, 5, 12, 8), (16, 1, 10, 10)]
TEXT_LENS = [5, 9, 0, 3]  # 0: a sample without text (all-False mask row)


def _model(seed: int = 0) -> VideoDiT:
    torch.manual_seed(seed)
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    # The zero-initialised head would hide every difference upstream of it.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.double().float()


def _inputs(model: VideoDiT, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(s, generator=g) for s in SHAPES]
    t = torch.rand(len(SHAPES), generator=g)
    d = model.config.text_dim
    text = torch.zeros(len(SHAPES), max(TEXT_LENS), d)
    mask = torch.zeros(len(SHAPES), max(TEXT_LENS), dtype=torch.bool)
    for i, n in enumerate(TEXT_LENS):
        text[i, :n] = torch.randn(n, d, generator=g)
        mask[i, :n] = True
    noise = [torch.randn(s, generator=g) for s in SHAPES]
    return latents, t, text, mask, noise


def _per_sample(model, latents, t, text, mask, noise):
    cfg = model.config
    elems = cfg.in_channels * cfg.patch_volume
    preds, err = [], 0.0
    for i, x0 in enumerate(latents):
        n = TEXT_LENS[i]
        ctx = text[i : i + 1, : max(n, 1)]
        m = mask[i : i + 1, : max(n, 1)]
        x_t = (1 - t[i]) * x0 + t[i] * noise[i]
        pred = model(x_t[None], (t[i] * 1000)[None], ctx, m)[0]
        preds.append(pred)
        err = err + (pred - (noise[i] - x0)).square().sum() / elems
    return preds, err


def test_offsets_and_segments():
    assert cu_seqlens([3, 2]).tolist() == [0, 3, 5]
    assert segment_ids([3, 2]).tolist() == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_forward_and_backward_equal_per_sample(checkpointing):
    model = _model()
    model.train()
    model.set_activation_checkpointing(checkpointing)
    latents, t, text, mask, noise = _inputs(model)
    ref_preds, ref_err = _per_sample(model, latents, t, text, mask, noise)
    ref_grads = torch.autograd.grad(ref_err, list(model.parameters()), allow_unused=True)

    x_t = [(1 - ti) * a + ti * z for a, z, ti in zip(latents, noise, t)]
    preds = model.forward_packed(x_t, t * 1000, text, mask)
    for p, r in zip(preds, ref_preds):
        assert p.shape == r.shape
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    err, tokens = flow_loss_packed(model, latents, t, noise, 1000, text, mask)
    assert tokens == sum(s[1] * (s[2] // 2) * (s[3] // 2) for s in SHAPES)
    torch.testing.assert_close(err, ref_err, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(err, list(model.parameters()), allow_unused=True)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        if r is None:
            assert g is None or torch.count_nonzero(g) == 0, name
            continue
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_samples_do_not_mix():
    # Changing one sample's latent or text changes only that sample's prediction.
    model = _model().eval()
    latents, t, text, mask, _ = _inputs(model)
    with torch.no_grad():
        before = model.forward_packed(latents, t * 1000, text, mask)
        latents[1] = latents[1] + 1.0
        text[0, :2] += 1.0
        after = model.forward_packed(latents, t * 1000, text, mask)
    assert not torch.allclose(before[0], after[0]) and not torch.allclose(before[1], after[1])
    torch.testing.assert_close(before[2], after[2], rtol=0, atol=0)
    torch.testing.assert_close(before[3], after[3], rtol=0, atol=0)
