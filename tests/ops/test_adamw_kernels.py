"""The master-weight AdamW kernel (ops.adamw_kernels) behind MasterWeightAdamW's "triton" implementation.

On CPU the kernel runs under Triton's interpreter (TRITON_INTERPRET=1, in a subprocess: the variable must be
set before Triton is imported) where Triton is installed; on a GPU it runs for real. Both compare it with
PyTorch's AdamW on fp32 copies of the parameters (bf16, fp16 and fp32 parameters; two groups, one with
weight decay; a learning rate that changes; a step without one tensor's gradient; unaligned gradients) and
check that a state dict moves between the kernel and the PyTorch implementation without changing training."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from _paths import TESTS

from lightning_adaptiveload.models.master_weights import MasterWeightAdamW
from lightning_adaptiveload.ops import adamw_kernels

HERE = str(TESTS)  # the helper scripts these tests run or import
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _check(results: dict, rounding: float) -> None:
    """fp32 arithmetic in both: the masters agree to fp32 rounding; a wrong formula is off by O(lr)/|w|,
    about 1e-3 here. Each parameter is its master rounded (exactly on a GPU; the interpreter's bf16 cast
    truncates, one bf16 unit at most)."""
    for key, value in results.items():
        bound = 1e-6
        if key.endswith("params_vs_rounded_masters"):  # fp32 and fp16 round exactly in the interpreter too
            bound = rounding if key.startswith("bfloat16/") else 0.0
        assert value <= bound, f"{key}: {value:.2e} over {bound:.0e}"


@pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed (CUDA builds of PyTorch bring it)")
def test_kernel_matches_torch_adamw_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "_adamw_kernel_checks.py"), "cpu"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 10
    _check(results, rounding=2.0**-7)


def test_a_wrong_update_is_caught():
    # The bound of _check is tight enough to see a real error: a learning rate 1% off.
    good = {"bfloat16/masters": 3e-8, "bfloat16/params_vs_rounded_masters": 0.0}
    _check(good, rounding=0.0)
    torch.manual_seed(0)
    ref = [torch.randn(64)]
    off = [ref[0].clone()]
    opts = [torch.optim.AdamW(ref, lr=1e-3), torch.optim.AdamW(off, lr=1.01e-3)]
    for p in (ref[0], off[0]):
        p.grad = torch.ones(64)
    for o in opts:
        o.step()
    sys.path.insert(0, HERE)
    import _adamw_kernel_checks

    with pytest.raises(AssertionError, match="masters"):
        _check({"bfloat16/masters": _adamw_kernel_checks._worst(off, ref)}, rounding=0.0)


@pytest.mark.cuda
def test_on_the_gpu_kernel_matches_torch_adamw():
    if not torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("needs a CUDA GPU and Triton")
    sys.path.insert(0, HERE)
    import _adamw_kernel_checks

    _check(_adamw_kernel_checks.run("cuda", scale=3000), rounding=0.0)


@pytest.mark.cuda
def test_on_the_gpu_auto_picks_the_kernel():
    if not torch.cuda.is_available() or not HAS_TRITON:
        pytest.skip("needs a CUDA GPU and Triton")
    model = torch.nn.Linear(8, 8).cuda().to(torch.bfloat16)
    assert MasterWeightAdamW(model.parameters()).implementation == "triton"


def test_auto_falls_back_to_torch_on_cpu_and_triton_is_refused_there(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = torch.nn.Linear(8, 8).to(torch.bfloat16)
    assert MasterWeightAdamW(model.parameters()).implementation == "torch"
    with pytest.raises(ValueError, match="implementation='triton' is not usable here"):
        MasterWeightAdamW(model.parameters(), implementation="triton")
    with pytest.raises(ValueError, match="implementation must be"):
        MasterWeightAdamW(model.parameters(), implementation="cuda")


def test_masters_are_views_of_one_flat_buffer_per_group():
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)).to(torch.bfloat16)
    opt = MasterWeightAdamW(
        [{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias, model[1].bias]}]
    )
    for flat, group, inner in zip(opt._flat, opt.param_groups, opt.inner.param_groups):
        assert len({m.untyped_storage().data_ptr() for m in inner["params"]}) == 1
        for offset, m, p in zip(flat.offsets, inner["params"], group["params"]):
            assert offset % adamw_kernels.SEGMENT_ALIGN == 0
            assert m.dtype == torch.float32 and torch.equal(m, p.float())
    with pytest.raises(NotImplementedError, match="cannot be added"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})


def test_segment_offsets_pad_every_segment():
    offsets, total = adamw_kernels.segment_offsets([1, 64, 65, 0, 3])
    assert offsets == [0, 64, 128, 256, 256] and total == 320
