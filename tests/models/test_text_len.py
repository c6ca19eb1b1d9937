"""``VideoDiTConfig.text_len``: the text padded with masked-out rows to one length, so that cuDNN attention
builds one execution graph per batch shape and not one per prompt length. Same result, the FLOPs of the
padded length, clear errors."""

from __future__ import annotations

import pytest
import torch

from lightning_adaptiveload.models.config import TEXT_ALIGN, VideoDiTConfig, forward_flops, padded_text_len
from lightning_adaptiveload.models.video_dit import VideoDiT

_CFG = dict(dim=32, num_layers=2, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=32)


def test_padded_text_len():
    wan = VideoDiTConfig.preset("wan-1.3b")
    assert wan.text_len == 512 and VideoDiTConfig.preset("wan-14b").text_len == 512
    assert VideoDiTConfig.preset("tiny").text_len is None
    assert [padded_text_len(wan, n) for n in (0, 1, 77, 512)] == [0, 512, 512, 512]
    assert padded_text_len(wan, 513) == 520  # longer text: a multiple of TEXT_ALIGN, never cut
    tiny = VideoDiTConfig.preset("tiny")
    assert [padded_text_len(tiny, n) for n in (0, 1, 8, 9)] == [0, TEXT_ALIGN, 8, 16]
    # A text_len off the alignment is rounded up to it (aligned rows for the kernels).
    assert padded_text_len(VideoDiTConfig.preset("tiny", text_len=10), 3) == 16


@pytest.mark.parametrize("bad", [0, -5, 2.5, "512", True])
def test_text_len_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match=r"VideoDiTConfig.text_len must be a positive int or None, got"):
        VideoDiTConfig.preset("tiny", text_len=bad)


def _pair(seed: int = 0):
    models = []
    for text_len in (None, 24):
        torch.manual_seed(seed)
        m = VideoDiT(VideoDiTConfig.preset("tiny", **_CFG, text_len=text_len)).train()
        torch.nn.init.normal_(m.head.head.weight, std=0.02)
        models.append(m)
    return models


def test_padding_to_text_len_changes_nothing_but_the_key_length():
    plain, padded = _pair()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 2, 4, 4, generator=g)
    t = torch.rand(2, generator=g) * 1000
    ctx = torch.randn(2, 5, _CFG["text_dim"], generator=g)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    seen = []
    hook = padded.blocks[0].cross_attn.k.register_forward_hook(lambda mod, inp, out: seen.append(out.shape[1]))
    grads = []
    outs = []
    for m in (plain, padded):
        m.zero_grad(set_to_none=True)
        out = m(x, t, ctx, mask)
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    hook.remove()
    assert seen == [24]  # the keys the cross-attention ran on
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)
    # The FLOPs count the rows that ran.
    assert padded.flops(2, 32, 5) == 2 * forward_flops(padded.config, 32, 24)
    assert plain.flops(2, 32, 5) == 2 * forward_flops(plain.config, 32, 8)


def test_packs_pad_to_text_len_too():
    plain, padded = _pair(seed=3)
    g = torch.Generator().manual_seed(2)
    lat = [torch.randn(16, 1, 4, 4, generator=g), torch.randn(16, 2, 4, 4, generator=g)]
    t = torch.rand(2, generator=g) * 1000
    ctx = torch.randn(2, 7, _CFG["text_dim"], generator=g)
    got = [m(lat, t, ctx) for m in (plain, padded)]
    for a, b in zip(got[0], got[1]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_compiled_blocks_with_text_len_match_eager_across_prompt_lengths():
    import torch._dynamo
    from _tiny_models import assert_same_steps

    from lightning_adaptiveload.models.acceleration import MAX_GRAPHS_PER_MODE, compile_blocks

    def model():
        torch.manual_seed(0)
        m = VideoDiT(VideoDiTConfig.preset("tiny", **_CFG, text_len=24)).train()
        torch.nn.init.normal_(m.head.head.weight, std=0.02)
        return m

    def grads(m, x, t, ctx):
        m.zero_grad(set_to_none=True)
        out = m(x, t, ctx)
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    def inputs(b, frames, text):
        g = torch.Generator().manual_seed(b * 100 + text)
        return (
            torch.randn(b, 16, frames, 4, 4, generator=g),
            torch.rand(b, generator=g) * 1000,
            torch.randn(b, text, _CFG["text_dim"], generator=g),
        )

    eager, compiled = model(), model()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_blocks(compiled, backend="aot_eager") == 2
    # Prompt lengths on and off the alignment, all padded to 24: the blocks see one text length.
    cases = [(1, 2, 5), (1, 2, 17), (2, 1, 8), (2, 1, 11), (1, 2, 24)]
    assert_same_steps(eager, compiled, (inputs(*c) for c in cases), grads)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= MAX_GRAPHS_PER_MODE, graphs
