"""The RoPE table cache of VideoDiT must not leak inference tensors into training."""

from __future__ import annotations

import torch

from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig


def test_training_after_inference_mode_forward():
    # trainer.validate / test / predict run under torch.inference_mode; a later fit on the same model
    # must still train (the cached RoPE tables of the first forward were inference tensors).
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    x = torch.randn(2, 16, 1, 4, 4)
    t = torch.tensor([100.0, 500.0])
    with torch.inference_mode():
        ref = model(x, t)
    out = model(x, t)  # same shape: the cached tables of the inference pass would be reused
    out.square().mean().backward()
    assert model.head.head.weight.grad is not None
    torch.testing.assert_close(out.detach(), ref)
