"""CPU tests of rms_norm_modulate: the reference, the op's registration and math, the fallback, and both
references under torch.compile (inductor on CPU) at batch 1 and 2."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

import lightning_adaptiveload
from lightning_adaptiveload import ops
from lightning_adaptiveload.ops import (
    FusedOpUnavailable,
    layer_norm_modulate_reference,
    rms_norm_modulate,
    rms_norm_modulate_reference,
)

_ln = importlib.import_module("lightning_adaptiveload.ops.layer_norm_modulate")
_rms = importlib.import_module("lightning_adaptiveload.ops.rms_norm_modulate")
_fwd_op = torch.ops.lightning_adaptiveload.rms_norm_modulate.default
_bwd_op = torch.ops.lightning_adaptiveload.rms_norm_modulate_backward.default


def _manual(x, shift, scale, weight=None, bias=None, eps=1e-6):
    """The float64 formula written out, with the modulation already broadcastable to x."""
    x = x.double()
    n = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    if weight is not None:
        n = n * weight.double()
    if bias is not None:
        n = n + bias.double()
    return n * (1 + scale.double()) + shift.double()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


CASES = {
    # name: (x shape, modulation shape, modulation shape broadcastable to x for _manual)
    "sample_b1d": ((3, 7, 16), (3, 1, 16), (3, 1, 16)),
    "sample_bd": ((3, 7, 16), (3, 16), (3, 1, 16)),
    "token": ((2, 5, 16), (2, 5, 16), (2, 5, 16)),
    "frame": ((2, 3, 4, 16), (2, 3, 1, 16), (2, 3, 1, 16)),
    "one_vector": ((2, 3, 16), (16,), (16,)),
    "batch1": ((1, 9, 16), (1, 1, 16), (1, 1, 16)),
}


def test_exported_from_ops_not_from_the_top_level():
    assert "rms_norm_modulate" in ops.__all__ and "rms_norm_modulate_reference" in ops.__all__
    assert "rms_norm_modulate" not in lightning_adaptiveload.__all__


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_reference_matches_formula(case, affine):
    x_shape, m_shape, b_shape = CASES[case]
    x = torch.randn(x_shape, dtype=torch.float64)
    shift, scale = torch.randn(m_shape, dtype=torch.float64), torch.randn(m_shape, dtype=torch.float64)
    w = torch.randn(16, dtype=torch.float64) if affine != "none" else None
    b = torch.randn(16, dtype=torch.float64) if affine == "both" else None
    y = rms_norm_modulate_reference(x, shift, scale, w, b)
    assert y.shape == x.shape
    assert _rel(y, _manual(x, shift.reshape(b_shape), scale.reshape(b_shape), w, b)) < 1e-12


def test_reference_matches_diffusers_rmsnorm():
    """diffusers' RMSNorm (fp32 variance, no affine) then the modulation, as LTX-Video's blocks write it."""
    from diffusers.models.normalization import RMSNorm

    norm = RMSNorm(32, eps=1e-6, elementwise_affine=False)
    x = torch.randn(2, 11, 32)
    shift, scale = torch.randn(2, 1, 32), torch.randn(2, 1, 32)
    inline = norm(x) * (1 + scale) + shift
    assert _rel(rms_norm_modulate_reference(x, shift, scale), inline) < 1e-6
    norm_w = RMSNorm(32, eps=1e-5, elementwise_affine=True)
    with torch.no_grad():
        norm_w.weight.normal_()
    inline = norm_w(x) * (1 + scale) + shift
    assert _rel(rms_norm_modulate_reference(x, shift, scale, norm_w.weight, eps=1e-5), inline) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_keeps_x_dtype_with_fp32_modulation(dtype):
    x = torch.randn(2, 9, 32).to(dtype)
    shift, scale = torch.randn(2, 32), torch.randn(2, 32)
    y = rms_norm_modulate_reference(x, shift, scale)
    assert y.dtype == dtype
    assert _rel(y, _manual(x, shift[:, None], scale[:, None])) < 1e-2


@pytest.mark.parametrize("reference", [rms_norm_modulate_reference, layer_norm_modulate_reference])
@pytest.mark.parametrize("case", ["sample_b1d", "token", "batch1", "one_vector"])
def test_gradcheck_of_the_reference_in_float64(reference, case):
    x_shape, m_shape, _ = CASES[case]
    args = [
        torch.randn(x_shape, dtype=torch.float64, requires_grad=True),
        torch.randn(m_shape, dtype=torch.float64, requires_grad=True),
        torch.randn(m_shape, dtype=torch.float64, requires_grad=True),
        torch.randn(16, dtype=torch.float64, requires_grad=True),
        torch.randn(16, dtype=torch.float64, requires_grad=True),
    ]
    assert torch.autograd.gradcheck(lambda *a: reference(*a, eps=1e-6), args)


def test_cpu_uses_the_reference_and_warns_once_saying_why():
    x, shift, scale = torch.randn(2, 5, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    _ln._warned.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y = rms_norm_modulate(x, shift, scale)
        rms_norm_modulate(x, shift, scale)
    msgs = [str(r.message) for r in rec if "rms_norm_modulate" in str(r.message)]
    assert len(msgs) == 1 and "cpu" in msgs[0] and "reference" in msgs[0]
    assert rec[0].filename == __file__  # the warning points at the caller
    assert torch.equal(y, rms_norm_modulate_reference(x, shift, scale))


def test_cpu_fallback_gradients_are_the_references():
    x, shift, scale, w = (
        torch.randn(s, requires_grad=True) for s in ((2, 5, 16), (2, 1, 16), (2, 1, 16), (16,))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = rms_norm_modulate(x, shift, scale, w)
    g = torch.autograd.grad(y.sum(), (x, shift, scale, w))
    g_ref = torch.autograd.grad(rms_norm_modulate_reference(x, shift, scale, w).sum(), (x, shift, scale, w))
    for a, b in zip(g, g_ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"shift": torch.randn(2, 1, 8)}, "rms_norm_modulate: shift .* must end in D = 16"),
        ({"shift": torch.randn(3, 16)}, "per sample"),
        ({"scale": torch.randn(2, 4, 16)}, "does not broadcast"),
        ({"weight": torch.randn(8)}, r"rms_norm_modulate: weight must have shape \(16,\)"),
        ({"x": torch.tensor(1.0)}, "at least one dim"),
    ],
)
def test_bad_input_names_the_op_and_the_argument(kwargs, match):
    args = {"x": torch.randn(2, 5, 16), "shift": torch.randn(2, 1, 16), "scale": torch.randn(2, 1, 16)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        rms_norm_modulate(**args)
    with pytest.raises(ValueError, match=match):
        rms_norm_modulate_reference(**args)


def test_require_fused_makes_the_fallback_an_error(monkeypatch):
    monkeypatch.setenv("LIGHTNING_ADAPTIVELOAD_REQUIRE_FUSED", "1")
    with pytest.raises(FusedOpUnavailable, match="rms_norm_modulate: x is on cpu.*REQUIRE_FUSED=1"):
        rms_norm_modulate(torch.randn(2, 5, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16))


def _op_inputs(per_token: bool, affine: str, requires_grad: bool = True, D: int = 24):
    x = torch.randn(2, 5, D)
    rows = 10 if per_token else 2
    shift, scale = torch.randn(rows, D), torch.randn(rows, D)
    w = torch.randn(D) if affine != "none" else None
    b = torch.randn(D) if affine == "both" else None
    ts = [t.requires_grad_(requires_grad) if t is not None else None for t in (x, shift, scale, w, b)]
    return (*ts, 1 if per_token else 5, 1e-6)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_opcheck_forward_op_on_cpu(per_token, affine):
    torch.library.opcheck(_fwd_op, _op_inputs(per_token, affine))


def test_opcheck_backward_op_on_cpu():
    x, shift, scale, w, b, g, eps = _op_inputs(False, "both", requires_grad=False)
    _, rstd = _fwd_op(x, shift, scale, w, b, g, eps)
    torch.library.opcheck(_bwd_op, (torch.randn_like(x), x, scale, w, b, rstd, g))


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("affine", ["none", "weight", "both"])
def test_op_gradients_match_float64_formula(per_token, affine):
    x, shift, scale, w, b, g, eps = _op_inputs(per_token, affine)
    leaves = [t for t in (x, shift, scale, w, b) if t is not None]
    y, rstd = _fwd_op(x, shift, scale, w, b, g, eps)
    assert not rstd.requires_grad and rstd.shape == x.shape[:-1]
    m_shape = (2, 5, 24) if per_token else (2, 1, 24)
    refs = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(refs)
    rx, rsh, rsc = next(it), next(it), next(it)
    rw = next(it) if w is not None else None
    rb = next(it) if b is not None else None
    y_ref = _manual(rx, rsh.reshape(m_shape), rsc.reshape(m_shape), rw, rb, eps)
    assert _rel(y, y_ref) < 1e-5
    dy = torch.randn_like(y)
    for got, want in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, refs, dy.double())):
        assert _rel(got, want) < 1e-5


def test_op_traces_as_one_node_under_torch_compile():
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm

    def f(x, shift, scale):
        return rms_norm_modulate(x, shift, scale) * 2

    torch._dynamo.reset()
    x, shift, scale = torch.randn(2, 5, 24), torch.randn(2, 1, 24), torch.randn(2, 1, 24)
    out = torch.compile(f, backend=backend, fullgraph=True)(x, shift, scale)
    assert any("rms_norm_modulate" in str(t) for t in seen)
    assert torch.equal(out, rms_norm_modulate_reference(x, shift, scale) * 2)


def test_op_under_aot_autograd_matches_eager():
    x, shift, scale, w, b, g, eps = _op_inputs(False, "both")

    def f(*args):
        return _fwd_op(*args, g, eps)[0].sum()

    torch._dynamo.reset()
    leaves = (x, shift, scale, w, b)
    grads = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves), leaves)
    for a, c in zip(grads, torch.autograd.grad(f(*leaves), leaves)):
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m_shape, group_size", [((2, 1, 16), 0), ((2, 0, 16), 1)])
def test_no_rows_give_an_empty_result(m_shape, group_size):
    x = torch.randn(2, 0, 16, requires_grad=True)
    shift, scale = torch.randn(m_shape, requires_grad=True), torch.randn(m_shape, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = rms_norm_modulate(x, shift, scale)
    assert y.shape == (2, 0, 16)
    dx, dshift, dscale = torch.autograd.grad(y.sum(), (x, shift, scale))
    assert dx.shape == x.shape and not dshift.any() and not dscale.any()
    table_sh, g = _ln._as_groups(shift, x)
    table_sc, _ = _ln._as_groups(scale, x)
    assert g == group_size
    torch.library.opcheck(_fwd_op, (x, table_sh, table_sc, None, None, g, 1e-6))


@pytest.mark.parametrize("reference", [rms_norm_modulate_reference, layer_norm_modulate_reference])
@pytest.mark.parametrize("B", [1, 2])
def test_references_compile_forward_and_backward(reference, B):
    """torch.compile (inductor on CPU) of each reference, per-sample modulation, batch 1 and 2."""
    torch._dynamo.reset()
    x = torch.randn(B, 33, 64, dtype=torch.bfloat16, requires_grad=True)
    shift = torch.randn(B, 1, 64, requires_grad=True)
    scale = torch.randn(B, 1, 64, requires_grad=True)
    y = torch.compile(reference)(x, shift, scale)
    grads = torch.autograd.grad(y.float().sum(), (x, shift, scale))
    grads_e = torch.autograd.grad(reference(x, shift, scale).float().sum(), (x, shift, scale))
    for g, ge, t in zip(grads, grads_e, (x, shift, scale)):
        assert g.shape == t.shape
        assert _rel(g, ge) < 2e-2


def test_rms_autograd_formula_is_registered_where_the_library_is_not():
    if _ln._KERNELS_LOADED:
        pytest.skip("the library's C++ autograd formula is registered instead")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(_fwd_op.name(), "Autograd")
    assert _rms._RMS.min_capability == (9, 0)
