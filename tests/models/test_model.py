"""The reference video DiT: shapes, Wan 2.1 structure, NormModulate switch, masking, RoPE, FLOPs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_adaptiveload.models import NormModulate, VideoDiT, VideoDiTConfig
from lightning_adaptiveload.models.layers import apply_rope, rope_3d


def _tiny(seed: int = 0, **overrides) -> VideoDiT:
    torch.manual_seed(seed)
    model = VideoDiT(VideoDiTConfig.preset("tiny", **overrides))
    # The head starts at zero (Wan's init); give it weights so outputs depend on the input.
    torch.nn.init.normal_(model.head.head.weight, std=0.05)
    return model


def _inputs(b=2, t=3, h=8, w=12, text_len=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, 16, t, h, w, generator=g)
    ts = torch.rand(b, generator=g) * 1000
    ctx = torch.randn(b, text_len, 32, generator=g) if text_len else None
    return x, ts, ctx


# ---------------------------------------------------------------------------------------------- config


def test_presets_match_wan21_sizes():
    # Parameter counts of the published checkpoints: 1.3B and 14B (built on meta, no memory).
    counts = {}
    for name in ("wan-1.3b", "wan-14b"):
        with torch.device("meta"):
            counts[name] = VideoDiT(VideoDiTConfig.preset(name)).num_parameters()
    assert 1.35e9 < counts["wan-1.3b"] < 1.5e9
    assert 13.8e9 < counts["wan-14b"] < 14.8e9
    cfg = VideoDiTConfig.preset("wan-14b")
    assert (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.ffn_dim) == (5120, 40, 40, 13824)
    cfg = VideoDiTConfig.preset("wan-1.3b")
    assert (cfg.dim, cfg.num_layers, cfg.num_heads, cfg.ffn_dim, cfg.text_dim) == (1536, 30, 12, 8960, 4096)
    assert cfg.patch_size == (1, 2, 2) and cfg.in_channels == 16


def test_state_dict_uses_wan_names():
    keys = set(_tiny().state_dict())
    for key in (
        "patch_embedding.weight",
        "text_embedding.0.weight",
        "time_embedding.2.weight",
        "time_projection.1.weight",
        "blocks.0.self_attn.q.weight",
        "blocks.0.self_attn.norm_q.weight",
        "blocks.0.cross_attn.norm_k.weight",
        "blocks.0.norm3.weight",
        "blocks.0.ffn.2.weight",
        "blocks.1.modulation",
        "head.head.weight",
        "head.modulation",
    ):
        assert key in keys, key
    assert not any(k.startswith(("blocks.0.norm1", "blocks.0.norm2", "head.norm")) for k in keys)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dim=65), "divisible by num_heads"),
        (dict(dim=20, num_heads=4), "must be even"),
        (dict(patch_size=(1, 2)), "patch_size"),
        (dict(num_layers=0), "num_layers"),
    ],
)
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        VideoDiTConfig.preset("tiny", **kwargs)


def test_preset_errors_name_the_choices():
    with pytest.raises(ValueError, match="wan-1.3b"):
        VideoDiTConfig.preset("wan-2b")
    with pytest.raises(ValueError, match="num_layer"):
        VideoDiTConfig.preset("tiny", num_layer=3)


# --------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("shape", [(1, 8, 12), (3, 12, 8), (5, 10, 10)])
def test_forward_shape_and_finite(shape):
    model = _tiny()
    x, ts, ctx = _inputs(t=shape[0], h=shape[1], w=shape[2])
    out = model(x, ts, ctx)
    assert out.shape == x.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_untrained_model_predicts_zero():
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    x, ts, ctx = _inputs()
    assert torch.count_nonzero(model(x, ts, ctx)) == 0


def test_rejects_bad_inputs():
    model = _tiny()
    x, ts, ctx = _inputs()
    with pytest.raises(ValueError, match="in_channels"):
        model(x[:, :8], ts, ctx)
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        model(x[..., :7], ts, ctx)
    with pytest.raises(ValueError, match="text_dim"):
        model(x, ts, torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match="timestep"):
        model(x, ts[:1], ctx)


def test_padded_text_positions_are_ignored():
    model = _tiny()
    x, ts, ctx = _inputs(text_len=6)
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, 3:] = False
    out = model(x, ts, ctx, mask)
    ctx2 = ctx.clone()
    ctx2[0, 3:] = 100.0 * torch.randn(3, 32)
    torch.testing.assert_close(model(x, ts, ctx2, mask), out)
    # ... and equal to giving sample 0 only its real tokens.
    torch.testing.assert_close(model(x[:1], ts[:1], ctx[:1, :3]), out[:1], rtol=1e-5, atol=1e-5)


def test_sample_without_text_equals_no_text():
    model = _tiny()
    x, ts, ctx = _inputs()
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False  # sample 1 has no text at all
    out = model(x, ts, ctx, mask)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1:], model(x[1:], ts[1:], None), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out[:1], model(x[:1], ts[:1], None))


def test_text_changes_the_output():
    model = _tiny()
    x, ts, ctx = _inputs()
    assert not torch.allclose(model(x, ts, ctx), model(x, ts, ctx + 1.0))


def test_activation_checkpointing_gives_the_same_gradients():
    x, ts, ctx = _inputs()
    grads = []
    for ckpt in (False, True):
        model = _tiny()
        model.set_activation_checkpointing(ckpt)
        model(x, ts, ctx).square().mean().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_keeps_modulation_and_stream_fp32():
    model = _tiny()
    x, ts, ctx = _inputs()
    seen = {}
    model.blocks[0].register_forward_hook(
        lambda m, args, out: seen.update(stream=out.dtype, e0=args[1].dtype)
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, ts, ctx)
    assert seen == {"stream": torch.float32, "e0": torch.float32}
    ref = model(x, ts, ctx)
    assert (out.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_unpatchify_inverts_the_patch_layout():
    model = _tiny()
    b, c, (pt, ph, pw) = 2, 16, model.config.patch_size
    x = torch.randn(b, c, 3, 8, 12)
    f, h, w = 3 // pt, 8 // ph, 12 // pw
    # Tokens in Conv3d raster order (F, H, W), channels laid out (pt, ph, pw, C) as Wan's head.
    tokens = x.view(b, c, f, pt, h, ph, w, pw).permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, f * h * w, -1)
    torch.testing.assert_close(model.unpatchify(tokens, (f, h, w)), x)


# ------------------------------------------------------------------------------------------- NormModulate


def test_norm_modulate_eager_form():
    torch.manual_seed(0)
    x, shift, scale = torch.randn(2, 7, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    nm = NormModulate(16)
    expected = F.layer_norm(x, (16,), eps=1e-6) * (1 + scale) + shift
    torch.testing.assert_close(nm(x, shift, scale), expected)
    affine = NormModulate(16, elementwise_affine=True)
    with torch.no_grad():
        affine.weight.normal_()
        affine.bias.normal_()
    expected = F.layer_norm(x, (16,), affine.weight, affine.bias, eps=1e-6) * (1 + scale) + shift
    torch.testing.assert_close(affine(x, shift, scale), expected)
    # bf16 in, bf16 out; computed in fp32.
    assert nm(x.bfloat16(), shift, scale).dtype == torch.bfloat16


def test_fused_switch_keeps_outputs_and_state_dict(monkeypatch):
    model = _tiny()
    x, ts, ctx = _inputs()
    keys = list(model.state_dict())
    sites = [m for m in model.modules() if isinstance(m, NormModulate)]
    assert len(sites) == 2 * model.config.num_layers + 1
    eager = model(x, ts, ctx)

    calls = []
    from lightning_adaptiveload import ops

    real = ops.layer_norm_modulate
    monkeypatch.setattr(ops, "layer_norm_modulate", lambda *a, **k: calls.append(1) or real(*a, **k))
    for m in sites:
        m.fused = True
    fused = model(x, ts, ctx)
    assert len(calls) == len(sites)
    assert list(model.state_dict()) == keys
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------- RoPE


def test_rope_split_and_relative_positions():
    head_dim = 16
    grid = (3, 4, 5)
    cos, sin = rope_3d(grid, head_dim)
    assert cos.shape == (60, head_dim // 2)
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, head_dim), torch.randn(1, 1, 1, head_dim)

    def score(i, j):
        qi = apply_rope(q, cos[i : i + 1], sin[i : i + 1])
        kj = apply_rope(k, cos[j : j + 1], sin[j : j + 1])
        return (qi * kj).sum()

    def idx(f, h, w):
        return (f * grid[1] + h) * grid[2] + w

    # The score depends on the offset between positions only, on every axis.
    torch.testing.assert_close(score(idx(0, 0, 0), idx(1, 2, 3)), score(idx(1, 1, 1), idx(2, 3, 4)))
    assert not torch.allclose(score(idx(0, 0, 0), idx(1, 2, 3)), score(idx(0, 0, 0), idx(2, 2, 3)))
    assert not torch.allclose(score(idx(0, 0, 0), idx(0, 1, 0)), score(idx(0, 0, 0), idx(0, 0, 1)))
    # Rotation keeps norms.
    torch.testing.assert_close(
        apply_rope(q.expand(1, 60, 1, head_dim), cos, sin).norm(dim=-1), q.norm().expand(1, 60, 1)
    )


# ------------------------------------------------------------------------------------------------ FLOPs


@pytest.mark.parametrize("text_len", [0, 5])
def test_flops_match_flop_counter(text_len):
    model = _tiny()
    x, ts, ctx = _inputs(text_len=text_len)
    # The math SDPA backend decomposes into matmuls the counter sees (the CPU flash kernel is not counted).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, ts, ctx)
    seq_len = 3 * 4 * 6
    assert model.flops(2, seq_len, text_len) == counter.get_total_flops()


def test_flops_match_flop_counter_at_wan_width():
    # One Wan 2.1 1.3B block at a real 480p shape, on the meta device (no memory, no compute).
    with torch.device("meta"):
        model = VideoDiT(VideoDiTConfig.preset("wan-1.3b", num_layers=1))
        x, ctx = torch.empty(1, 16, 5, 60, 104), torch.empty(1, 512, 4096)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(x, torch.empty(1), ctx)
    assert model.flops(1, 5 * 30 * 52, 512) == counter.get_total_flops()


def test_every_parameter_gets_a_gradient_without_text():
    # DDP needs a gradient for every parameter at every step, also for a batch without any text.
    model = _tiny()
    x, ts, _ = _inputs()
    model(x, ts, None).square().mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []
    assert all(torch.count_nonzero(p.grad) == 0 for n, p in model.named_parameters() if ".cross_attn." in n)


def test_meta_device_materialisation_gives_wan_init():
    # What FSDP does with a model built on the meta device: allocate, then call reset_parameters() on every
    # module that holds parameters of its own. Every such module must know its part of Wan's init.
    with torch.device("meta"):
        model = VideoDiT(VideoDiTConfig.preset("tiny", dim=128, num_heads=4))
    model.to_empty(device="cpu")
    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)):
            assert hasattr(m, "reset_parameters"), type(m).__name__
            m.reset_parameters()
    d = model.config.dim
    assert torch.count_nonzero(model.head.head.weight) == 0
    assert torch.all(model.blocks[0].self_attn.norm_q.weight == 1)
    assert torch.all(model.blocks[0].norm3.weight == 1) and torch.all(model.blocks[0].norm3.bias == 0)
    assert torch.all(model.blocks[0].ffn[0].bias == 0)
    bound = (6 / (d + model.config.ffn_dim)) ** 0.5  # Xavier-uniform
    w = model.blocks[0].ffn[0].weight
    assert w.abs().max() <= bound and w.std() > 0.5 * bound / 3**0.5
    assert abs(model.text_embedding[0].weight.std().item() - 0.02) < 0.004
    assert abs(model.blocks[1].modulation.std().item() - d**-0.5) < 0.2 * d**-0.5
    x, ts, ctx = _inputs()
    assert torch.isfinite(model(x, ts, ctx)).all()


@pytest.mark.cuda
def test_bf16_training_step_on_cuda_matches_fp32():
    model = _tiny().cuda()
    x, ts, ctx = (t.cuda() for t in _inputs(t=9, h=8, w=12, text_len=7))
    mask = torch.ones(2, 7, dtype=torch.bool, device="cuda")
    mask[0, 4:] = False
    ref = model(x, ts, ctx, mask)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x, ts, ctx, mask)
    out.float().square().mean().backward()
    assert out.dtype == torch.bfloat16
    assert (out.float() - ref).abs().max() < 0.05 * ref.abs().max()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
