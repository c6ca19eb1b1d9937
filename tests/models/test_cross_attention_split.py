"""The cross-attention's query split (attention.sdpa_split_queries): the same attention with one long sample's
queries cut into chunks, so that the backward has enough thread blocks to fill a GPU.

Checked on CPU: the split equals plain SDPA (outputs and gradients of q, k, v; with a text mask; lengths that
the split count divides and lengths it does not), the device rule, the model's switch, and a compiled model
with the split forced on: it matches eager mode and compiles no more graphs than without the split."""

from __future__ import annotations

import types

import pytest
import torch
import torch._dynamo
from _tiny_models import assert_same_steps

from lightning_adaptiveload.models import attention
from lightning_adaptiveload.models.acceleration import MAX_GRAPHS_PER_MODE, compile_blocks
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

_CFG = dict(dim=32, num_layers=2, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=32)


def _qkv(b, s, keys, h=3, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Laid out as the model makes them: (B, S, H, d) projections viewed as (B, H, S, d).
    q, k, v = (torch.randn(b, n, h, d, generator=g, dtype=torch.float64) for n in (s, keys, keys))
    return [t.transpose(1, 2).requires_grad_(True) for t in (q, k, v)]


def _run(fn, q, k, v):
    out = fn(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out) + out.detach())
    return out.detach(), grads


@pytest.mark.parametrize("b,s,keys", [(1, 40, 7), (2, 37, 5), (1, 5, 9)])
@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("masked", [False, True])
def test_split_equals_plain_attention(b, s, keys, splits, masked):
    q, k, v = _qkv(b, s, keys)
    mask = None
    if masked:
        mask = torch.rand(b, 1, 1, keys, generator=torch.Generator().manual_seed(1)) > 0.4
        mask[..., 0] = True  # every row attends somewhere
    ref_out, ref_grads = _run(lambda a, b_, c: attention.sdpa(a, b_, c, mask), q, k, v)
    out, grads = _run(lambda a, b_, c: attention.sdpa_split_queries(a, b_, c, mask, None, splits), q, k, v)
    assert out.shape == ref_out.shape == (b, 3, s, 8)
    torch.testing.assert_close(out, ref_out, rtol=1e-12, atol=1e-12)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"d{name}")


def test_one_split_is_plain_sdpa_and_a_per_query_mask_is_refused():
    q, k, v = _qkv(1, 6, 4)
    assert torch.equal(attention.sdpa_split_queries(q, k, v, None, None, 1), attention.sdpa(q, k, v))
    for per_query in (torch.ones(1, 1, 6, 4, dtype=torch.bool), torch.ones(6, 4, dtype=torch.bool)):
        with pytest.raises(ValueError, match="must not vary over the queries"):
            attention.sdpa_split_queries(q, k, v, per_query, None, 2)
    # A mask over the keys alone, in fewer dimensions, is taken as (1, 1, 1, L).
    keys = torch.tensor([True, False, True, True])
    torch.testing.assert_close(
        attention.sdpa_split_queries(q, k, v, keys, None, 4),
        attention.sdpa(q, k, v, keys.view(1, 1, 1, 4)),
        rtol=1e-12,
        atol=1e-12,
    )


def test_the_model_splits_only_when_training():
    model = _model(3)
    x, t, ctx = _inputs(1, 3)
    calls = []
    real = attention.sdpa_split_queries

    def spy(q, k, v, mask, backends, splits):
        calls.append(splits)
        return real(q, k, v, mask, backends, splits)

    attention.sdpa_split_queries, saved = spy, attention.sdpa_split_queries
    try:
        model(x, t, ctx)
        with torch.no_grad():
            model(x, t, ctx)
    finally:
        attention.sdpa_split_queries = saved
    assert calls == [3, 3, 1, 1]  # two blocks with grad, two without


def test_the_rule_fills_the_sms_and_is_off_without_cuda(monkeypatch):
    assert attention.query_splits("cpu", heads=12) == 1
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(multi_processor_count=132)
    )
    waves, sms = attention.SPLIT_WAVES, 132
    # wan-1.3b: 12 heads x 4 blocks of 128 text tokens = 48 thread blocks per split.
    assert attention.query_splits("cuda:0", heads=12, keys=512) == round(waves * sms / 48)
    assert attention.query_splits("cuda:0", heads=40, keys=512) == round(waves * sms / 160)  # Wan 14B
    assert attention.query_splits("cuda:0", heads=1, keys=128) == attention.SPLIT_MAX
    assert attention.query_splits("cuda:0", heads=400, keys=4096) == 1


def _model(splits):
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig.preset("tiny", **_CFG)).train()
    torch.nn.init.normal_(model.head.head.weight, std=0.02)
    model.set_cross_attention_splits(splits)
    return model


def _inputs(b, t, h=4, w=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, 16, t, h, w, generator=g),
        torch.rand(b, generator=g) * 1000,
        torch.randn(b, 5, _CFG["text_dim"], generator=g),
    )


def _grads(model, x, t, ctx, mask=None):
    model.zero_grad(set_to_none=True)
    out = model(x, t, ctx, mask)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_model_switch_reaches_the_blocks_and_validates():
    model = _model("auto")
    x, t, ctx = _inputs(1, 2)
    model(x, t, ctx)
    assert {b.cross_attn.query_splits for b in model.blocks} == {1}  # CPU: "auto" is off
    model.set_cross_attention_splits(5)
    model(x, t, ctx)
    assert {b.cross_attn.query_splits for b in model.blocks} == {5}
    for bad in (0, -2, 2.5, "fast", True):
        with pytest.raises(ValueError, match="cross-attention splits"):
            model.set_cross_attention_splits(bad)


@pytest.mark.parametrize("masked", [False, True])
def test_model_with_the_split_forced_matches_no_split(masked):
    plain, split = _model(1), _model(3)
    for b, t in [(1, 3), (2, 1)]:  # B = 1 is split, B = 2 is not
        x, ts, ctx = _inputs(b, t)
        mask = None
        if masked:
            mask = torch.ones(b, 5, dtype=torch.bool)
            mask[0, 3:] = False
        out_p, g_p = _grads(plain, x, ts, ctx, mask)
        out_s, g_s = _grads(split, x, ts, ctx, mask)
        torch.testing.assert_close(out_s, out_p, rtol=1e-5, atol=1e-6)
        for name in g_p:
            torch.testing.assert_close(g_s[name], g_p[name], rtol=1e-4, atol=1e-6, msg=name)


def test_compiled_model_with_the_split_matches_eager_without_more_graphs():
    eager, compiled = _model(1), _model(8)
    for m in (eager, compiled):
        m.set_activation_checkpointing(True, "save_matmuls")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_blocks(compiled, backend="aot_eager")
    # Lengths the 8 splits divide (16, 48) and lengths they do not (12, 18, 45), B = 1 and B > 1.
    shapes = [
        (1, 3, 4, 4),
        (3, 1, 4, 4),
        (1, 2, 6, 6),
        (1, 5, 6, 6),
        (2, 2, 4, 4),
        (1, 4, 4, 4),
        (1, 3, 8, 8),
    ]
    assert_same_steps(eager, compiled, (_inputs(*shape) for shape in shapes), _grads)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= MAX_GRAPHS_PER_MODE, graphs


def _gpu_backends() -> list[str]:
    names = ["cudnn"]
    if attention.fa4_installed() and torch.cuda.get_device_capability()[0] in (9, 10):
        names.append("fa4")
    return names


@pytest.mark.cuda
def test_on_the_gpu_the_split_matches_plain_attention_for_each_kernel():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert attention.query_splits("cuda", heads=12) == max(
        1, min(16, round(attention.SPLIT_WAVES * sms / 48))
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 3001, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k, v = (
        torch.randn(1, 512, 12, 128, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
        for _ in "kv"
    )
    for name in _gpu_backends():
        order = attention.resolve_attention_backends(name, "cuda")
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        ref, ref_grads = _run(lambda a, b_, c, o=order: attention.sdpa(a, b_, c, None, o), *leaves)
        leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out, grads = _run(
            lambda a, b_, c, o=order: attention.sdpa_split_queries(a, b_, c, None, o, 8), *leaves
        )
        for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads)):
            rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert rel < 1e-2, (name, what, rel)  # bf16 rounding; dk and dv are summed in another order


@pytest.mark.cuda
def test_on_the_gpu_a_compiled_model_with_the_split_matches_eager_without():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    cfg = VideoDiTConfig.preset("tiny", **{**_CFG, "dim": 256, "num_heads": 2})  # head dim 128
    for name in _gpu_backends():
        torch.manual_seed(0)
        eager = VideoDiT(cfg).cuda().train()
        torch.nn.init.normal_(eager.head.head.weight, std=0.02)
        compiled = VideoDiT(cfg).cuda().train()
        compiled.load_state_dict(eager.state_dict())
        eager.set_cross_attention_splits(1)
        compiled.set_cross_attention_splits(4)
        for m in (eager, compiled):
            m.set_activation_checkpointing(True, "save_matmuls")
            m.set_attention_backend(name)
        compile_blocks(compiled, dynamic=True)
        x, ts, ctx = (t.cuda() for t in _inputs(1, 3, h=8, w=10))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out_e, g_e = _grads(eager, x, ts, ctx)
            out_c, g_c = _grads(compiled, x, ts, ctx)
        assert {b.cross_attn.query_splits for b in compiled.blocks} == {4}
        torch.testing.assert_close(out_c.float(), out_e.float(), rtol=5e-2, atol=5e-2)
        for pname in g_e:
            rel = (g_c[pname] - g_e[pname]).norm() / g_e[pname].norm().clamp_min(1e-12)
            assert rel < 5e-2, (name, pname, float(rel))
