"""Step-speed switches: attention kernel choice, checkpoint policies, regional compile, bf16 master weights.

Compilation uses the ``aot_eager`` backend (Dynamo + AOTAutograd, the parts that decide graph breaks,
recompiles and what a checkpoint keeps) so the tests stay within seconds on a 2-core CPU; inductor adds
code generation only.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch._dynamo
from _tiny_models import assert_same_steps, tiny_wan
from torch.nn.attention import SDPBackend

from lightning_adaptiveload.fusion import fuse_norm_modulate
from lightning_adaptiveload.models import attention
from lightning_adaptiveload.models.acceleration import (
    MAX_GRAPHS_PER_MODE,
    RECOMPILE_LIMIT,
    checkpoint_blocks_for_budget,
    compile_blocks,
    ensure_recompile_limit,
    repeated_blocks,
)
from lightning_adaptiveload.models.master_weights import MasterWeightAdamW
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig, _spread

_CFG = dict(dim=32, num_layers=2, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=32)


def _model(seed: int = 0, **overrides) -> VideoDiT:
    torch.manual_seed(seed)
    model = VideoDiT(VideoDiTConfig.preset("tiny", **{**_CFG, **overrides})).train()
    torch.nn.init.normal_(model.head.head.weight, std=0.02)  # non-zero gradients everywhere
    return model


def _inputs(b: int, t: int, h: int = 4, w: int = 4, text: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, 16, t, h, w, generator=g),
        torch.rand(b, generator=g) * 1000,
        torch.randn(b, text, _CFG["text_dim"], generator=g),
    )


def _grads(model: VideoDiT, x, t, ctx) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(x, t, ctx)
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# -- attention kernel choice -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cudnn", "flash", "efficient", "math"])
def test_named_backend_comes_first_and_math_is_the_fallback(name):
    order = attention.resolve_attention_backends(name, "cuda")
    assert order[0] == attention._KERNELS[name]
    assert order[-1] == SDPBackend.MATH or name == "math"
    assert SDPBackend.MATH in order and len(set(order)) == len(order) == 4
    assert all(isinstance(b, SDPBackend) for b in order)


def test_auto_and_default_leave_pytorch_choice_off_cuda():
    assert attention.resolve_attention_backends("auto", "cpu") is None
    assert attention.resolve_attention_backends("default", "cpu") is None
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        attention.resolve_attention_backends("flash3", "cpu")


@pytest.mark.parametrize("name", attention.ATTENTION_BACKENDS)
def test_every_backend_runs_and_agrees_with_math(name):
    # On CPU only math and the CPU flash kernel exist: the fallback order must still reach one that runs.
    q, k, v = (torch.randn(2, 2, 7, 8) for _ in range(3))
    mask = torch.rand(2, 1, 1, 7) > 0.3
    mask[..., 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = attention.sdpa(q, k, v, mask, attention.resolve_attention_backends(name, "cpu"))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert attention.attention_kernel_name(q, k, v, mask, None) == "PyTorch SDPA on cpu"


def test_flash_impl_activation_reports_instead_of_raising():
    ok, detail = attention.activate_flash_impl("FA3")
    if ok:  # the package is installed: leave the process as it was
        torch.nn.attention.restore_flash_attention_impl()
    assert isinstance(detail, str) and detail


@pytest.fixture
def fake_fa4(monkeypatch):
    """A stand-in flash-attn-4 whose forward returns five values (as 4.0.0b36 does) and backward three; the
    FA4 registry entry, the adapter module and torch's FA4 import cache are restored afterwards."""
    import types

    calls = []
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd = lambda *a, **k: calls.append(("fwd", k)) or ("out", "lse", "p", "max", "lo")
    interface._flash_attn_bwd = lambda *a, **k: calls.append(("bwd", k)) or ("dq", "dk", "dv")
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    pkg = types.ModuleType("flash_attn")
    pkg.cute = cute
    for name, mod in (
        ("flash_attn", pkg),
        ("flash_attn.cute", cute),
        ("flash_attn.cute.interface", interface),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, attention._FA4_ADAPTER, raising=False)
    registry = pytest.importorskip("torch.nn.attention._registry")
    fa4 = pytest.importorskip("torch.nn.attention._fa4")
    original = dict(registry._FLASH_ATTENTION_IMPLS)
    yield calls
    if torch.nn.attention.current_flash_attention_impl() is not None:
        torch.nn.attention.restore_flash_attention_impl()
    registry._FLASH_ATTENTION_IMPLS.clear()
    registry._FLASH_ATTENTION_IMPLS.update(original)
    fa4._fa4_import_module.cache_clear()
    fa4._FA4_MODULE_PATH = None
    sys.modules.pop(attention._FA4_ADAPTER, None)


def test_fa4_adapter_returns_what_torch_unpacks(fake_fa4):
    import importlib

    adapter = importlib.import_module(attention._FA4_ADAPTER)
    assert adapter._flash_attn_fwd("q", "k", "v", return_lse=True) == ("out", "lse")
    assert adapter._flash_attn_bwd("q", "k", "v", "o", "do", "lse", causal=False) == ("dq", "dk", "dv")
    assert fake_fa4 == [("fwd", {"return_lse": True}), ("bwd", {"causal": False})]  # kwargs passed through


def test_activating_fa4_routes_torch_registry_through_the_adapter(fake_fa4):
    from torch.nn.attention import _fa4

    assert attention.activate_flash_impl("FA4") == (True, "FA4")
    assert torch.nn.attention.current_flash_attention_impl() == "FA4"
    assert _fa4._FA4_MODULE_PATH == attention._FA4_ADAPTER
    torch.nn.attention.restore_flash_attention_impl()
    q = torch.randn(1, 2, 8, 16)  # CPU attention is untouched by the CUDA registration
    assert torch.nn.functional.scaled_dot_product_attention(q, q, q).shape == q.shape


def test_fa4_missing_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn -> ImportError
    monkeypatch.delitem(sys.modules, attention._FA4_ADAPTER, raising=False)
    ok, why = attention.activate_flash_impl("FA4")
    assert not ok and "FA4 unavailable" in why
    assert attention.fa4_installed() is False


def _fake_gpu(monkeypatch, major: int):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    monkeypatch.setattr(attention, "_FLASH_READY", {})


@pytest.mark.parametrize("name, major", [("fa4", 8), ("fa4", 12), ("fa3", 10)])
def test_flash_impl_on_an_unsupported_gpu_falls_back_with_one_warning(monkeypatch, caplog, name, major):
    _fake_gpu(monkeypatch, major)
    with caplog.at_level("WARNING", logger=attention.__name__):
        order = attention.resolve_attention_backends(name, "cuda")
        again = attention.resolve_attention_backends(name, "cuda")
    auto_first = SDPBackend.CUDNN_ATTENTION if major >= 9 else SDPBackend.FLASH_ATTENTION
    assert order == again and order[0] == auto_first and order[-1] == SDPBackend.MATH
    warnings_ = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings_) == 1 and "compute capability" in warnings_[0].getMessage()
    assert name in warnings_[0].getMessage()
    assert torch.nn.attention.current_flash_attention_impl() is None  # nothing was activated


def test_auto_prefers_fa4_where_it_is_installed_and_routed(monkeypatch):
    _fake_gpu(monkeypatch, 9)
    monkeypatch.setattr(attention, "fa4_installed", lambda: False)
    assert attention.resolve_attention_backends("auto", "cuda")[0] == SDPBackend.CUDNN_ATTENTION
    monkeypatch.setattr(attention, "fa4_installed", lambda: True)
    monkeypatch.setattr(attention, "flash_impl_ready", lambda name, device: (False, "broken"))
    assert attention.resolve_attention_backends("auto", "cuda")[0] == SDPBackend.CUDNN_ATTENTION
    monkeypatch.setattr(attention, "flash_impl_ready", lambda name, device: (True, "FA4"))
    assert attention.resolve_attention_backends("auto", "cuda")[0] == SDPBackend.FLASH_ATTENTION
    assert attention.resolve_attention_backends("fa4", "cuda")[0] == SDPBackend.FLASH_ATTENTION
    _fake_gpu(monkeypatch, 8)  # FA4 does not run on Ampere: auto keeps FlashAttention-2 first, not FA4
    monkeypatch.setattr(attention, "flash_impl_ready", lambda name, device: pytest.fail("must not activate"))
    assert attention.resolve_attention_backends("auto", "cuda")[0] == SDPBackend.FLASH_ATTENTION


def test_model_attention_backend_is_validated_and_applied():
    model = _model()
    with pytest.raises(ValueError, match="attention_backend"):
        model.set_attention_backend("fastest")
    model.set_attention_backend("math")
    x, t, ctx = _inputs(1, 2)
    model(x, t, ctx)
    assert model.blocks[0].self_attn.backends[0] == SDPBackend.MATH
    assert model.blocks[1].cross_attn.backends[0] == SDPBackend.MATH


# -- checkpoint policies -----------------------------------------------------------------------------------


def test_spread_picks_evenly_spaced_blocks():
    assert _spread(0, 30) == []
    assert _spread(30, 30) == list(range(30))
    assert _spread(2, 6) == [0, 3]
    assert len(_spread(7, 30)) == 7


def test_checkpoint_settings_per_block():
    model = _model(num_layers=4)
    model.set_activation_checkpointing(True, "save_attention", num_blocks=2)
    assert [b.checkpoint_policy for b in model.blocks] == ["save_attention", None, "save_attention", None]
    assert model.gradient_checkpointing
    model.gradient_checkpointing = False
    assert all(b.checkpoint_policy is None for b in model.blocks) and not model.gradient_checkpointing
    model.gradient_checkpointing = True
    assert all(b.checkpoint_policy == "full" for b in model.blocks)
    with pytest.raises(ValueError, match="checkpoint policy"):
        model.set_activation_checkpointing(True, "everything")
    with pytest.raises(ValueError, match="num_blocks"):
        model.set_activation_checkpointing(True, "full", num_blocks=5)


@pytest.mark.parametrize(
    "policy,num_blocks", [("full", None), ("save_attention", None), ("save_matmuls", None), ("full", 1)]
)
def test_checkpoint_policies_give_the_same_gradients(policy, num_blocks):
    model = _model()
    x, t, ctx = _inputs(2, 2)
    out_ref, ref = _grads(model, x, t, ctx)
    model.set_activation_checkpointing(True, policy, num_blocks)
    out, got = _grads(model, x, t, ctx)
    torch.testing.assert_close(out, out_ref)
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], msg=name)


def test_checkpoint_blocks_for_budget():
    gib = 2**30
    # 30 blocks; all checkpointed 40 GiB, none 100 GiB: 2 GiB per un-checkpointed block.
    assert checkpoint_blocks_for_budget(30, 65520, 70 * gib, 40 * gib, 100 * gib) == 15
    assert checkpoint_blocks_for_budget(30, 65520, 100 * gib, 40 * gib, 100 * gib) == 0
    assert checkpoint_blocks_for_budget(30, 65520, 40 * gib, 40 * gib, 100 * gib) == 30
    assert checkpoint_blocks_for_budget(30, 65520, 41.9 * gib, 40 * gib, 100 * gib) == 30
    with pytest.raises(ValueError, match="lower max_tokens"):
        checkpoint_blocks_for_budget(30, 131040, 39 * gib, 40 * gib, 100 * gib)


# -- regional compile --------------------------------------------------------------------------------------


def test_repeated_blocks_finds_the_block_list():
    model = _model(num_layers=3)
    assert repeated_blocks(model) == list(model.blocks)
    with pytest.raises(ValueError, match="no repeated blocks"):
        compile_blocks(torch.nn.Linear(2, 2))


def test_block_graph_has_no_break_and_keeps_the_fused_op_as_one_node():
    model = _model(num_layers=1)
    fuse_norm_modulate(model, verify=False)
    model.set_activation_checkpointing(True, "save_attention")
    block = model.blocks[0]
    x, t, ctx = _inputs(1, 2)
    b, s, d = 1, 2 * 2 * 2, _CFG["dim"]
    h = torch.randn(b, s, d)
    e0 = torch.randn(b, 6, d)
    cos, sin = model._rope((2, 2, 2), h.device)
    ctx_emb = torch.randn(b, 5, d)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explained = torch._dynamo.explain(block)(h, e0, cos, sin, ctx_emb, None)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    text = "\n".join(str(g.graph) for g in explained.graphs)
    # Two NormModulate sites per block, each one node of the custom op (inside the checkpoint's body).
    assert "lightning_adaptiveload.layer_norm_modulate" in text or any(
        "layer_norm_modulate" in str(n.target)
        for g in explained.graphs
        for m in g.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
    )


def test_compiled_model_matches_eager_with_bounded_recompiles():
    eager = _model()
    compiled = _model()
    for m in (eager, compiled):
        fuse_norm_modulate(m, verify=False)
        m.set_activation_checkpointing(True, "save_attention")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    assert compile_blocks(compiled, backend="aot_eager") == 2
    # The mix's layouts: one long clip (B = 1), batches of images and of short clips (B > 1), new lengths.
    shapes = [(1, 3), (3, 1), (2, 2), (1, 2)]
    assert_same_steps(eager, compiled, (_inputs(b, t) for b, t in shapes), _grads)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= MAX_GRAPHS_PER_MODE, graphs


def test_compile_blocks_raises_the_recompile_limit_and_never_lowers_it(caplog):
    # PyTorch's default of 8 graphs per code object was hit with fullgraph=True in the middle of an epoch on
    # the GPU (inductor's size guards: 9 graphs over the wan21_480p mix with FlashAttention-4, run 12).
    import torch._dynamo.config as dynamo_config

    saved = dynamo_config.recompile_limit  # (monkeypatch would delattr a config entry on undo)
    try:
        dynamo_config.recompile_limit = 8
        with caplog.at_level("INFO", logger="lightning_adaptiveload.models.acceleration"):
            compile_blocks(_model(), backend="aot_eager")
        assert dynamo_config.recompile_limit == RECOMPILE_LIMIT >= 16
        assert f"recompile_limit 8 -> {RECOMPILE_LIMIT}" in caplog.text
        dynamo_config.recompile_limit = 500
        assert ensure_recompile_limit(RECOMPILE_LIMIT) == 500 and dynamo_config.recompile_limit == 500
    finally:
        dynamo_config.recompile_limit = saved


def test_compile_blocks_passes_inductor_options_to_each_block(monkeypatch):
    import torch._inductor.config as inductor_config

    from lightning_adaptiveload.models.acceleration import SAFE_REDUCTIONS

    seen = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: seen.append(kw))
    options = {"triton.tile_reductions": True}
    assert compile_blocks(_model(), options=options, safe_reductions=False) == 2
    assert [kw["options"] for kw in seen] == [options, options]
    assert compile_blocks(_model(), safe_reductions=False) == 2 and seen[-1]["options"] is None
    if not hasattr(inductor_config.triton, "mix_order_reduction"):
        pytest.skip("this torch has no mix-order reductions")
    # By default the mix-order reductions are off (pytorch/pytorch#193061), the caller's options on top.
    compile_blocks(_model(), options=options)
    assert seen[-1]["options"] == {**SAFE_REDUCTIONS, **options} and seen[-1]["mode"] is None
    compile_blocks(_model(), options={"triton.mix_order_reduction": True})
    assert seen[-1]["options"] == {"triton.mix_order_reduction": True}
    # A mode travels as its own settings (torch.compile takes a mode or options, not both).
    compile_blocks(_model(), mode="max-autotune-no-cudagraphs")
    assert seen[-1]["mode"] is None
    assert seen[-1]["options"] == {
        **torch._inductor.list_mode_options("max-autotune-no-cudagraphs"),
        **SAFE_REDUCTIONS,
    }
    # Other backends get what they were given.
    compile_blocks(_model(), backend="aot_eager")
    assert seen[-1]["options"] is None and seen[-1]["backend"] == "aot_eager"


def test_compile_blocks_says_when_fused_sites_are_compiled(caplog):
    fused, plain = _model(), _model()
    fuse_norm_modulate(fused, verify=False)
    with caplog.at_level("INFO", logger="lightning_adaptiveload.models.acceleration"):
        compile_blocks(plain, backend="aot_eager")
        assert "fused op" not in caplog.text
        compile_blocks(fused, backend="aot_eager")
    assert "4 norm-modulate sites use the fused op" in caplog.text  # two per block, two blocks


# -- bf16 weights with fp32 master ---------------------------------------------------------------------------


def _train(model, opt, steps=3):
    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i), dtype=torch.float32)
        loss = model(x.to(next(model.parameters()).dtype)).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_master_weights_match_adamw_in_fp32():
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    b = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    b.load_state_dict(a.state_dict())
    _train(a, torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1))
    _train(b, MasterWeightAdamW(b.parameters(), lr=1e-2, weight_decay=0.1))
    for pa, pb in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(pb, pa)


def test_master_weights_keep_small_updates_that_bf16_would_lose():
    # lr 1e-4 on weights of size ~1: one bf16 ulp there is 2^-8 or 2^-7, so plain bf16 AdamW rounds every
    # update away, while the fp32 master accumulates them (Adam's steps are about lr each).
    torch.manual_seed(0)
    init = torch.nn.Linear(8, 2)
    with torch.no_grad():
        init.weight.copy_(torch.randn(2, 8).sign() * (1.0 + torch.rand(2, 8)))
    w16 = torch.nn.Linear(8, 2).to(torch.bfloat16)
    plain16 = torch.nn.Linear(8, 2).to(torch.bfloat16)
    with torch.no_grad():
        for m in (w16, plain16):
            m.weight.copy_(init.weight)
            m.bias.copy_(init.bias)
    start = w16.weight.detach().float().clone()
    opt = MasterWeightAdamW(w16.parameters(), lr=1e-4, weight_decay=0.0)
    _train(w16, opt, steps=20)
    _train(plain16, torch.optim.AdamW(plain16.parameters(), lr=1e-4, weight_decay=0.0), steps=20)
    master = opt.inner.param_groups[0]["params"][0]
    assert w16.weight.dtype == torch.bfloat16 and master.dtype == torch.float32
    assert (master - start).abs().mean().item() > 5e-4  # the master moved by many lr-sized steps
    assert torch.equal(plain16.weight.float(), start)  # plain bf16 lost every one of them
    torch.testing.assert_close(w16.weight, master.to(torch.bfloat16), rtol=0, atol=0)


def test_master_weights_state_dict_round_trip_and_scheduler():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    opt = MasterWeightAdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    _train_lin = lambda: model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()  # noqa: E731
    _train_lin()
    opt.step()
    sched.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(1e-3)  # copied at the next step
    _train_lin()
    opt.step()
    assert opt.inner.param_groups[0]["lr"] == pytest.approx(5e-4)
    state = opt.state_dict()
    clone = MasterWeightAdamW(model.parameters(), lr=1e-3)
    clone.load_state_dict(state)
    for a, b in zip(clone.inner.param_groups[0]["params"], opt.inner.param_groups[0]["params"]):
        torch.testing.assert_close(a, b)
    assert clone.inner.state_dict()["state"].keys() == opt.inner.state_dict()["state"].keys()


# -- the module's switches and users' diffusers models -------------------------------------------------------


def test_module_switches_reach_the_model_and_optimizer():
    from lightning_adaptiveload.models.module import MemorySettings, OptimizerSettings, VideoDiTModule

    module = VideoDiTModule(
        preset="tiny",
        model_overrides={"num_layers": 2},
        memory=MemorySettings(
            activation_checkpointing=True, checkpoint_policy="save_attention", checkpoint_blocks=1
        ),
        attention_backend="math",
        optimizer=OptimizerSettings(weight_dtype="bf16"),
    )
    module.configure_model()
    assert [b.checkpoint_policy for b in module.model.blocks] == ["save_attention", None]
    assert module.model.attention_backend == "math"
    assert {p.dtype for p in module.model.parameters()} == {torch.bfloat16}
    assert isinstance(module.configure_optimizers()["optimizer"], MasterWeightAdamW)
    with pytest.raises(ValueError, match="weight_dtype"):
        VideoDiTModule(preset="tiny", optimizer=OptimizerSettings(weight_dtype="fp16"))


def _tiny_diffusers_wan():
    return tiny_wan(attention_head_dim=16, text_dim=8, qk_norm="rms_norm_across_heads", eps=1e-6)


def test_diffusers_wan_gets_its_own_backend_setting_and_block_list():
    from lightning_adaptiveload.models.acceleration import set_attention_backend

    model = _tiny_diffusers_wan()
    assert repeated_blocks(model) == list(model.blocks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert set_attention_backend(model, "math") == "_native_math"
        assert set_attention_backend(model, "auto", "cpu") == "native"  # PyTorch's choice off CUDA
    with pytest.raises(ValueError, match="no set_attention_backend"):
        set_attention_backend(torch.nn.Linear(2, 2), "cudnn")


@pytest.mark.cuda
def test_fa4_on_the_gpu_matches_cudnn_in_a_compiled_model():
    # Runs where flash-attn-4 is installed on a GPU it supports (the H100 machine with benchmarks/model/gpu_fa4.sh's
    # packages); elsewhere it is skipped, not passed.
    if not attention.fa4_installed() or torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("needs flash-attn-4 on compute capability 9.x or 10.x")
    q, k, v = (torch.randn(2, 4, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    ref = attention.sdpa(q, k, v, None, [SDPBackend.CUDNN_ATTENTION])
    order = attention.resolve_attention_backends("fa4", "cuda")
    assert order[0] == SDPBackend.FLASH_ATTENTION, order
    assert "FA4" in attention.attention_kernel_name(q, k, v, None, order)
    assert attention.resolve_attention_backends("auto", "cuda")[0] == SDPBackend.FLASH_ATTENTION
    torch.testing.assert_close(attention.sdpa(q, k, v, None, order), ref, rtol=2e-2, atol=2e-2)
    eager, compiled = _model(dim=256, num_heads=2).cuda(), _model(dim=256, num_heads=2).cuda()  # head dim 128
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        m.set_activation_checkpointing(True, "save_matmuls")
    eager.set_attention_backend("cudnn")
    compiled.set_attention_backend("fa4")
    compile_blocks(compiled, dynamic=True)
    x, ts, ctx = (t.cuda() for t in _inputs(2, 3, h=8, w=8))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out_e, g_e = _grads(eager, x, ts, ctx)
        out_c, g_c = _grads(compiled, x, ts, ctx)
    torch.testing.assert_close(out_c.float(), out_e.float(), rtol=5e-2, atol=5e-2)
    for name in g_e:
        rel = (g_c[name] - g_e[name]).norm() / g_e[name].norm().clamp_min(1e-12)
        assert rel < 5e-2, (name, float(rel))


@pytest.mark.cuda
def test_expandable_segments_apply_at_runtime():
    # In a fresh process: the allocator has made no segment yet, and the setting must reach new ones.
    code = (
        "import torch\n"
        "from lightning_adaptiveload.models.acceleration import use_expandable_segments\n"
        "before = torch.empty(1 << 20, device='cuda')\n"
        "print(use_expandable_segments())\n"
        "after = torch.empty(64 << 20, device='cuda')\n"
        "segs = torch.cuda.memory._snapshot()['segments']\n"
        "print(sorted({bool(s.get('is_expandable')) for s in segs}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split("\n")
    assert lines[0] == "on" and "True" in lines[1], out.stdout
