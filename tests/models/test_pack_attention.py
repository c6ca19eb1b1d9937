"""A mixed pack's self-attention as one dense kernel call per run of equal lengths (models/pack_attention.py):
equal to SDPA on each sample alone in value and gradient, opaque to torch.compile (a bounded number of graphs
over changing compositions), kept by the "save_attention" checkpoint policy."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from lightning_adaptiveload.models import checkpointing
from lightning_adaptiveload.models.pack_attention import (
    equal_runs,
    pack_runs_attention,
    pack_runs_op,
    runs_kernel,
    runs_tensor,
)


def _pack(lens, heads=3, dim=8, dtype=torch.float32, device="cpu", seed=0):
    """q, k, v of a pack as the layers make them: (1, S, H, d) storage seen as (1, H, S, d)."""
    g = torch.Generator().manual_seed(seed)
    s = sum(lens)
    return [
        torch.randn(1, s, heads, dim, generator=g, dtype=torch.float32).to(device, dtype).transpose(1, 2)
        for _ in range(3)
    ]


def _per_sample(q, k, v, lens):
    outs, start = [], 0
    for n in lens:
        end = start + n
        outs.append(F.scaled_dot_product_attention(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]))
        start = end
    return torch.cat(outs, dim=2)


def _value_and_grads(fn, base, lens, grad_seed=1):
    q, k, v = (x.detach().clone().requires_grad_() for x in base)
    out = fn(q, k, v, lens)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out)
    (out * g).sum().backward()
    return out.detach(), [x.grad for x in (q, k, v)]


def test_equal_runs_and_the_runs_tensor():
    assert equal_runs([3, 3, 5, 3, 3, 3]) == [(3, 2), (5, 1), (3, 3)]
    assert equal_runs([7]) == [(7, 1)]
    r = runs_tensor([4, 4, 9])
    assert r.dtype == torch.int64 and r.device.type == "cpu" and r.tolist() == [[4, 2], [9, 1]]
    with pytest.raises(ValueError, match="positive"):
        equal_runs([3, 0])


@pytest.mark.parametrize("seed", range(6))
def test_runs_equal_per_sample_sdpa_in_value_and_gradient(seed):
    rng = random.Random(seed)
    lens = [rng.choice([1, 2, 5, 5, 9, 16]) for _ in range(rng.randint(2, 7))]
    base = _pack(lens, seed=seed)
    out, grads = _value_and_grads(lambda q, k, v, n: pack_runs_attention(q, k, v, runs_tensor(n), "cpu"), base, lens)
    ref, ref_grads = _value_and_grads(_per_sample, base, lens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    # The output keeps the input's memory layout: (1, S, H, d) storage, so the output projection reads it as is.
    assert out.stride() == base[0].stride()


def test_bad_inputs_are_refused_with_what_was_given():
    q, k, v = _pack([4, 4])
    with pytest.raises(ValueError, match="kernel 'tpu'"):
        pack_runs_attention(q, k, v, runs_tensor([4, 4]), "tpu")
    with pytest.raises(ValueError, match=r"CPU int64 \(R, 2\).*torch.int32"):
        pack_runs_attention(q, k, v, runs_tensor([4, 4]).int(), "cpu")
    with pytest.raises(ValueError, match="cover 12 tokens, the pack holds 8"):
        pack_runs_attention(q, k, v, runs_tensor([4, 8]), "cpu")


def test_the_kernel_follows_the_device_and_the_backend_order():
    assert runs_kernel(torch.device("cpu"), None) == "cpu"
    assert runs_kernel(torch.device("meta"), None) is None
    if torch.cuda.is_available():
        assert runs_kernel(torch.device("cuda"), [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]) == "flash"
        assert runs_kernel(torch.device("cuda"), [SDPBackend.CUDNN_ATTENTION]) == "cudnn"
        assert runs_kernel(torch.device("cuda"), [SDPBackend.MATH]) is None


def test_save_attention_keeps_the_op_output():
    assert pack_runs_op() in checkpointing._ATTENTION_OPS


def test_compiled_compositions_share_graphs_and_equal_eager():
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    fn = torch.compile(
        lambda q, k, v, runs: pack_runs_attention(q, k, v, runs, "cpu"),
        backend="aot_eager",
        fullgraph=True,
        dynamic=True,
    )
    rng = random.Random(0)
    for i in range(12):
        lens = [rng.choice([3, 4, 5, 9]) for _ in range(rng.randint(2, 6))]
        if len(set(lens)) == 1:
            lens.append(7)
        base = _pack(lens, seed=i)
        out, grads = _value_and_grads(lambda q, k, v, n: fn(q, k, v, runs_tensor(n)), base, lens)
        ref, ref_grads = _value_and_grads(_per_sample, base, lens)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    # One graph for every composition of two or more runs (a single run would specialise R = 1).
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
def test_cuda_kernels_equal_per_sample_sdpa(kernel):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lens = [1560, 1560, 1560, 17160, 4680, 4680]
    base = _pack(lens, heads=12, dim=128, dtype=torch.bfloat16, device="cuda")
    out, grads = _value_and_grads(lambda q, k, v, n: pack_runs_attention(q, k, v, runs_tensor(n), kernel), base, lens)
    ref, ref_grads = _value_and_grads(_per_sample, base, lens)
    for a, b in [(out, ref), *zip(grads, ref_grads)]:
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < 2e-2, (kernel, float(rel))


def test_a_failing_cudnn_kernel_falls_back_to_flash_with_one_warning(monkeypatch, caplog):
    from lightning_adaptiveload.models import pack_attention as pa

    real_fwd, real_bwd = pa._forward_run, pa._backward_run

    def fwd(q, k, v, kernel):
        if kernel == "cudnn":
            raise RuntimeError("cuDNN Frontend error: no engine for this shape")
        return real_fwd(q, k, v, "cpu" if kernel == "flash" else kernel)

    def bwd(go, q, k, v, out, lse, kernel):
        assert kernel != "cudnn"
        return real_bwd(go, q, k, v, out, lse, "cpu" if kernel == "flash" else kernel)

    monkeypatch.setattr(pa, "_forward_run", fwd)
    monkeypatch.setattr(pa, "_backward_run", bwd)
    monkeypatch.setattr(pa, "_FAILED", set())
    lens = [4, 4, 9]
    base = _pack(lens)
    with caplog.at_level("WARNING", logger=pa.__name__):
        for _ in range(2):
            out, grads = _value_and_grads(lambda q, k, v, n: pack_runs_attention(q, k, v, runs_tensor(n), "cudnn"), base, lens)
    ref, ref_grads = _value_and_grads(_per_sample, base, lens)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    warnings = [r for r in caplog.records if "falls back to FlashAttention" in r.getMessage()]
    assert len(warnings) == 1 and "no engine for this shape" in warnings[0].getMessage()
