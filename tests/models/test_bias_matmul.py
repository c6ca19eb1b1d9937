"""``layers.MatmulBiasLinear``: a Linear whose bias gradient is a matmul under ``torch.compile`` (issue 17,
run 17: inductor fused the FFN's bias gradient into the GELU backward, a slow mixed kernel)."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

from lightning_adaptiveload.models import VideoDiT, VideoDiTConfig
from lightning_adaptiveload.models.layers import Linear, MatmulBiasLinear


def _pair(seed=0):
    torch.manual_seed(seed)
    plain = Linear(16, 40)
    special = MatmulBiasLinear(16, 40)
    special.load_state_dict(plain.state_dict())
    for p in (plain.bias, special.bias):
        with torch.no_grad():
            p.copy_(torch.linspace(-1, 1, 40))
    return plain, special


def _ffn(lin):
    return lambda x: F.gelu(lin(x), approximate="tanh").square().sum()


def _grads(fn, lin, x):
    x = x.detach().requires_grad_(True)
    lin.zero_grad(set_to_none=True)
    out = fn(x)
    out.backward()
    return out.detach(), x.grad, lin.weight.grad, lin.bias.grad


def test_eager_is_a_plain_linear():
    plain, special = _pair()
    x = torch.randn(2, 7, 16)
    for a, b in zip(_grads(_ffn(plain), plain, x), _grads(_ffn(special), special, x)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_matches_eager_over_several_lengths(backend):
    plain, special = _pair()
    torch._dynamo.reset()
    compiled = torch.compile(_ffn(special), backend=backend, fullgraph=True, dynamic=True)
    for b, s in [(1, 7), (3, 5), (2, 11)]:
        x = torch.randn(b, s, 16, generator=torch.Generator().manual_seed(s))
        ref = _grads(_ffn(plain), plain, x)
        got = _grads(compiled, special, x)
        for name, a, r in zip(("out", "dx", "dw", "db"), got, ref):
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5, msg=name)


def _backward_mms(lin, x) -> int:
    graphs = []
    backend = aot_autograd(
        fw_compiler=lambda gm, _: make_boxed_func(gm.forward),
        bw_compiler=lambda gm, _: graphs.append(gm) or make_boxed_func(gm.forward),
    )
    torch._dynamo.reset()
    _grads(torch.compile(_ffn(lin), backend=backend, fullgraph=True), lin, x)
    (graph,) = graphs
    return sum(n.op == "call_function" and n.target == torch.ops.aten.mm.default for n in graph.graph.nodes)


def test_under_compile_the_bias_gradient_is_a_matmul_and_the_switch_turns_it_off():
    _, special = _pair()
    x = torch.randn(2, 7, 16)
    assert _backward_mms(special, x) == 3  # dx, dW and the bias gradient
    special.bias_grad_by_matmul = False
    assert _backward_mms(special, x) == 2  # dx and dW; the bias gradient is a sum again


def test_without_bias_it_stays_a_linear():
    _, special = _pair()
    special.register_parameter("bias", None)
    torch._dynamo.reset()
    x = torch.randn(3, 16)
    out = torch.compile(special, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(out, x @ special.weight.T)


def test_bf16_autocast_keeps_dtypes():
    plain, special = _pair()
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: F.gelu(special(x), approximate="tanh"), backend="aot_eager")
    x = torch.randn(2, 5, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = compiled(x)
        ref = F.gelu(plain(x), approximate="tanh")
    assert got.dtype == ref.dtype == torch.bfloat16
    got.float().sum().backward()
    assert special.bias.grad.dtype == torch.float32
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_videodit_uses_it_for_the_ffn_input_only_and_keeps_the_checkpoint_keys():
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    block = model.blocks[0]
    assert type(block.ffn[0]) is MatmulBiasLinear and isinstance(block.ffn[0], Linear)
    assert type(block.ffn[2]) is Linear and type(block.self_attn.q) is Linear
    keys = model.state_dict().keys()
    assert {"blocks.0.ffn.0.weight", "blocks.0.ffn.0.bias", "blocks.0.ffn.2.weight"} <= set(keys)


@pytest.mark.cuda
def test_on_the_gpu_inductor_matches_eager_under_bf16_autocast():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    plain, special = (m.cuda() for m in _pair())
    torch._dynamo.reset()
    compiled = torch.compile(_ffn(special), fullgraph=True, dynamic=True)
    for b, s in [(1, 4096), (3, 1000)]:
        x = torch.randn(b, s, 16, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref = _grads(_ffn(plain), plain, x)
            got = _grads(compiled, special, x)
        for name, a, r in zip(("out", "dx", "dw", "db"), got, ref):
            rel = (a.float() - r.float()).norm() / r.float().norm().clamp_min(1e-12)
            assert rel < 2e-2, (name, float(rel))
