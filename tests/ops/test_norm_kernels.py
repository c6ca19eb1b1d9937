"""The Triton norm kernels (ops.norm_kernels) and the layers' use of them.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the variable must be
set before Triton is imported) where Triton is installed; on a GPU they run for real. Both compare against
the plain-PyTorch forms: the kernels alone (LayerNorm-affine per sample and shared, RMSNorm with and without
RoPE, fp32 and bf16 inputs) and a whole DiTBlock with the kernel path forced on, eager and compiled in one
graph."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from _paths import ROOT, TESTS

from lightning_adaptiveload.models import VideoDiT, VideoDiTConfig, layers
from lightning_adaptiveload.models.compile_check import relative_difference
from lightning_adaptiveload.ops import norm_kernels

HERE = str(TESTS)  # the helper scripts these tests run or import
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _check(results: dict) -> None:
    assert results["graph_targets"] == [
        "autograd_function_apply",
        "lightning_adaptiveload.rms_norm_rope.default",
    ]
    for key, value in results.items():
        if key == "graph_targets":
            continue
        # fp32 everywhere: rounding-order differences only. bf16 anywhere: bf16's resolution (2^-8 = 3.9e-3
        # per rounding) on outputs and gradients; a wrong formula is off by O(1).
        strict = "bfloat16" not in key and "/bf16/" not in key
        bound = 2e-5 if strict else (2e-2 if not key.startswith("block/bf16") else 6e-2)
        assert value < bound, f"{key}: relative difference {value:.2e} over {bound:.0e}"


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (CUDA builds of PyTorch bring it)")
@pytest.mark.parametrize("shape", [(3, 37, 96, 3), (1, 70, 48, 2)])
def test_kernels_match_pytorch_under_the_triton_interpreter(shape):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_norm_kernel_checks.py"), "cpu", *map(str, shape)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    _check(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.cuda
def test_on_the_gpu_kernels_match_pytorch():
    if not torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("needs a CUDA GPU and Triton")
    sys.path.insert(0, HERE)
    import _norm_kernel_checks

    # Wan's width and heads; more rows than one program takes, and a ragged last program.
    _check(_norm_kernel_checks.run("cuda", 2, 1001, 1536, 12))


@pytest.mark.cuda
def test_on_the_gpu_a_compiled_block_runs_the_kernels_and_matches_eager(monkeypatch):
    if not torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("needs a CUDA GPU and Triton")
    from lightning_adaptiveload.models.layers import rope_3d
    from lightning_adaptiveload.models.video_dit import DiTBlock

    monkeypatch.setattr(norm_kernels, "ENABLED", dict.fromkeys(norm_kernels.ENABLED, True))
    cfg = VideoDiTConfig(dim=256, num_heads=2, num_layers=1, ffn_dim=512, text_dim=256)
    torch.manual_seed(0)
    block = DiTBlock(cfg).cuda()
    grid = (3, 8, 10)
    S = grid[0] * grid[1] * grid[2]
    x = torch.randn(2, S, 256, device="cuda", requires_grad=True)
    e0 = 0.3 * torch.randn(2, 6, 256, device="cuda")
    ctx = torch.randn(2, 9, 256, device="cuda")
    cos, sin = rope_3d(grid, 128, device="cuda")
    dy = torch.randn(2, S, 256, device="cuda")
    compiled = torch.compile(block, fullgraph=True, dynamic=True)

    def grads(fn):
        x.grad = None
        block.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, e0, cos, sin, ctx, None)
        y.backward(dy)
        return [y.detach().float(), x.grad.clone()] + [p.grad.clone() for p in block.parameters()]

    ref = grads(block)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        got = grads(compiled)
    kernels = {e.name for e in prof.events()}
    assert any("_ln_affine_bwd_kernel" in k for k in kernels), sorted(kernels)
    assert any("_rms_rope_fwd_kernel" in k for k in kernels)
    assert any("_rms_rope_bwd_kernel" in k for k in kernels)
    names = ["out", "x"] + [n for n, _ in block.named_parameters()]
    for name, a, b in zip(names, got, ref):
        if name.endswith("k.bias"):
            continue
        rel = relative_difference(a, b)
        assert rel < 6e-2, f"{name}: {rel:.2e}"


def test_the_kernel_path_is_off_on_cpu_and_in_eager_mode():
    x = torch.randn(2, 3, 8)
    assert not any(layers._norm_kernels_on(x, site) for site in norm_kernels.ENABLED)  # CPU, eager
    seen = []

    def probe(t):
        seen.append(any(layers._norm_kernels_on(t, site) for site in norm_kernels.ENABLED))
        return t * 2

    torch.compile(probe, backend="aot_eager", fullgraph=True)(x)
    assert seen == [False]  # compiling, but on CPU


def test_the_model_marks_the_norms_that_feed_one_matmul():
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    block = model.blocks[0]
    # norm2 feeds the FFN, norm3 the cross-attention's q, the head's norm the head: one matmul each. norm1
    # feeds q, k and v, whose gradients add up at the residual's width.
    assert block.norm2.feeds_matmul and block.norm3.feeds_matmul and model.head.norm.feeds_matmul
    assert not block.norm1.feeds_matmul


def test_rms_norm_rope_rejects_mismatched_tables():
    x = torch.randn(1, 5, 8)
    with pytest.raises(ValueError, match="both cos and sin"):
        norm_kernels.rms_norm_rope(x, torch.ones(8), torch.ones(5, 2), None, 1e-6)
    with pytest.raises(ValueError, match="cos has 4 rows for 5 tokens"):
        norm_kernels.rms_norm_rope(x, torch.ones(8), torch.ones(4, 2), torch.zeros(4, 2), 1e-6)
    with pytest.raises(ValueError, match=r"multiple of d"):
        norm_kernels.rms_norm_rope(x, torch.ones(8), torch.ones(5, 3), torch.zeros(5, 3), 1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("feeds_matmul", [False, True])
def test_on_the_gpu_a_compiled_norm_site_matches_eager(batch, kernels, feeds_matmul, monkeypatch):
    """One adaLN site as a block has it (shift and scale sliced from a (B, 6, D) table), compiled with
    dynamic shapes, against eager mode: the output and the gradients of x and of the table. With a batch of
    one the table's gradient is a sum over all tokens into a (1, 6, D) tensor."""
    if not torch.cuda.is_available() or (kernels and not HAS_TRITON):
        pytest.skip("needs a CUDA GPU (and Triton for the kernels)")
    monkeypatch.setattr(norm_kernels, "ENABLED", dict.fromkeys(norm_kernels.ENABLED, kernels))
    D, S = 256, 777
    norm = layers.NormModulate(D).cuda()
    norm.feeds_matmul = feeds_matmul

    def site(x, mod):
        shift, scale = mod.chunk(6, 1)[:2]
        return norm(x, shift, scale)

    torch.manual_seed(0)
    x = torch.randn(batch, S, D, device="cuda", requires_grad=True)
    mod = (0.3 * torch.randn(batch, 6, D, device="cuda")).requires_grad_()
    dy = torch.randn(batch, S, D, device="cuda")

    def grads(fn):
        x.grad = mod.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = fn(x, mod)
        y.backward(dy.to(y.dtype))
        return y.detach().float(), x.grad.clone(), mod.grad.clone()

    ref = grads(site)
    torch._dynamo.reset()
    got = grads(torch.compile(site, dynamic=True))
    for name, a, b in zip(("out", "x", "mod"), got, ref):
        rel = relative_difference(a, b)
        assert rel < 2e-2, f"{name}: relative difference {rel:.2e} (batch {batch}, kernels {kernels})"


@pytest.mark.cuda
@pytest.mark.parametrize("setting", ["default", "none"])
def test_on_the_gpu_a_compiled_wan_block_at_one_clip_matches_eager(tmp_path, setting):
    """The case that inductor's own LayerNorm backward got wrong with torch 2.11 (the modulation's gradient
    at one 32,760-token sample): one wan-1.3b block, compiled as compile_blocks compiles it, against eager
    mode (benchmarks/checks/check_block_grads.py, about a minute on an H100). "default": the library's norm
    kernels; "none": inductor's own norms, right only with compile_blocks' safe reductions (run 22)."""
    if not torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("needs a CUDA GPU and Triton")
    script = str(ROOT / "benchmarks" / "checks" / "check_block_grads.py")
    proc = subprocess.run(
        [sys.executable, script, "--settings", setting, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (result,) = [json.load(open(tmp_path / f)) for f in os.listdir(tmp_path)]
    diffs = result["settings"][setting]["rel_diff"]
    bad = {k: v for k, v in diffs.items() if v > 3e-2}
    assert not bad, f"compiled block differs from eager mode: {bad}"
