"""CPU tests of layer_norm_modulate: the reference, the layouts, the op's registration and the build loader."""

from __future__ import annotations

import importlib
import shutil
import warnings

import pytest
import torch

from lightning_adaptiveload.ops import (
    _build,
    fused_op_status,
    layer_norm_modulate,
    layer_norm_modulate_reference,
)

_impl = importlib.import_module("lightning_adaptiveload.ops.layer_norm_modulate")
_fwd_op = torch.ops.lightning_adaptiveload.layer_norm_modulate.default
_bwd_op = torch.ops.lightning_adaptiveload.layer_norm_modulate_backward.default


def _manual(x, shift, scale, weight=None, bias=None, eps=1e-6):
    """float64 formula written out, with the modulation already broadcastable to x."""
    x = x.double()
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    n = (x - mean) / torch.sqrt(var + eps)
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
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("affine", [False, True])
def test_reference_matches_formula(case, affine):
    x_shape, m_shape, b_shape = CASES[case]
    x = torch.randn(x_shape, dtype=torch.float64)
    shift, scale = torch.randn(m_shape, dtype=torch.float64), torch.randn(m_shape, dtype=torch.float64)
    w = torch.randn(16, dtype=torch.float64) if affine else None
    b = torch.randn(16, dtype=torch.float64) if affine else None
    y = layer_norm_modulate_reference(x, shift, scale, w, b)
    y_ref = _manual(x, shift.reshape(b_shape), scale.reshape(b_shape), w, b)
    assert _rel(y, y_ref) < 1e-12  # fp64 inputs: the reference computes in fp64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_keeps_x_dtype_with_fp32_modulation(dtype):
    x = torch.randn(2, 9, 32).to(dtype)
    shift, scale = torch.randn(2, 32), torch.randn(2, 32)
    y = layer_norm_modulate_reference(x, shift, scale)
    assert y.dtype == dtype
    assert _rel(y, _manual(x, shift[:, None], scale[:, None])) < 1e-2


def test_cpu_uses_the_reference_and_warns_once_saying_why():
    x, shift, scale = torch.randn(2, 5, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    _impl._warned.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y = layer_norm_modulate(x, shift, scale)
        layer_norm_modulate(x, shift, scale)
    msgs = [str(r.message) for r in rec if "layer_norm_modulate" in str(r.message)]
    assert len(msgs) == 1 and "cpu" in msgs[0] and "reference" in msgs[0]
    assert torch.equal(y, layer_norm_modulate_reference(x, shift, scale))


@pytest.mark.parametrize(
    "x_shape, m_shape, groups, group_size",
    [
        ((3, 7, 16), (3, 1, 16), 3, 7),
        ((3, 7, 16), (3, 16), 3, 7),
        ((2, 5, 16), (2, 5, 16), 10, 1),
        ((2, 3, 4, 16), (2, 3, 1, 16), 6, 4),
        ((2, 3, 4, 16), (2, 1, 1, 16), 2, 12),
        ((2, 3, 16), (16,), 1, 6),
        ((1, 7, 16), (1, 1, 16), 1, 7),
    ],
)
def test_modulation_layouts_map_to_groups(x_shape, m_shape, groups, group_size):
    x, m = torch.randn(x_shape), torch.randn(m_shape)
    table, g = _impl._as_groups(m, x)
    assert table.shape == (groups, 16) and g == group_size
    # Row r of x (flattened) uses table row r // group_size, exactly as broadcasting does.
    full = _impl._expand_modulation(m, x).expand(x.shape).reshape(-1, 16)
    assert torch.equal(full, table.repeat_interleave(group_size, 0))


def test_broadcast_inside_the_varying_dims_is_not_a_kernel_layout():
    assert _impl._as_groups(torch.randn(1, 5, 16), torch.randn(3, 5, 16)) is None


def test_chunk_of_a_modulation_table_is_read_without_a_copy():
    x = torch.randn(2, 7, 16)
    table = torch.randn(2, 6, 16)
    shift = table[:, 2:3]  # (B, 1, D) with row stride 6 * D, as Wan's .chunk(6, dim=1) gives
    t, g = _impl._as_groups(shift, x)
    assert t.data_ptr() == shift.data_ptr() and t.stride() == (96, 1) and g == 7


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"shift": torch.randn(2, 1, 8)}, "must end in D = 16"),
        ({"shift": torch.randn(3, 16)}, "per sample"),
        ({"scale": torch.randn(2, 4, 16)}, "does not broadcast"),
        ({"weight": torch.randn(8)}, r"weight must have shape \(16,\)"),
        ({"x": torch.tensor(1.0)}, "at least one dim"),
    ],
)
def test_bad_input_names_the_argument(kwargs, match):
    args = {"x": torch.randn(2, 5, 16), "shift": torch.randn(2, 1, 16), "scale": torch.randn(2, 1, 16)}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        layer_norm_modulate(**args)
    with pytest.raises(ValueError, match=match):
        layer_norm_modulate_reference(**args)


def test_non_tensor_input_is_a_type_error():
    with pytest.raises(TypeError, match="shift must be a torch.Tensor"):
        layer_norm_modulate(torch.randn(2, 16), [0.0] * 16, torch.randn(2, 16))


def _op_inputs(per_token: bool, affine: bool, requires_grad: bool = True, D: int = 24):
    x = torch.randn(2, 5, D)
    rows = 10 if per_token else 2
    shift, scale = torch.randn(rows, D), torch.randn(rows, D)
    w = torch.randn(D) if affine else None
    b = torch.randn(D) if affine else None
    ts = [t.requires_grad_(requires_grad) if t is not None else None for t in (x, shift, scale, w, b)]
    return (*ts, 1 if per_token else 5, 1e-6)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_opcheck_forward_op_on_cpu(per_token, affine):
    torch.library.opcheck(_fwd_op, _op_inputs(per_token, affine))


def test_opcheck_backward_op_on_cpu():
    x, shift, scale, w, b, g, eps = _op_inputs(False, True, requires_grad=False)
    _, mean, rstd = _fwd_op(x, shift, scale, w, b, g, eps)
    torch.library.opcheck(_bwd_op, (torch.randn_like(x), x, scale, w, b, mean, rstd, g))


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("affine", [False, True])
def test_op_gradients_match_float64_reference(per_token, affine):
    x, shift, scale, w, b, g, eps = _op_inputs(per_token, affine)
    leaves = [t for t in (x, shift, scale, w, b) if t is not None]
    y, mean, rstd = _fwd_op(x, shift, scale, w, b, g, eps)
    assert not mean.requires_grad and not rstd.requires_grad
    m_shape = (2, 5, 24) if per_token else (2, 1, 24)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    it = iter(ref_leaves)
    rx, rsh, rsc = next(it), next(it), next(it)
    rw, rb = (next(it), next(it)) if affine else (None, None)
    y_ref = _manual(rx, rsh.reshape(m_shape), rsc.reshape(m_shape), rw, rb, eps)
    assert _rel(y, y_ref) < 1e-5
    dy = torch.randn_like(y)
    for gr, gref in zip(
        torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_ref, ref_leaves, dy.double())
    ):
        assert _rel(gr, gref) < 1e-5


def test_op_traces_as_one_node_under_torch_compile():
    counts = {"graphs": 0}

    def backend(gm, example_inputs):
        counts["graphs"] += 1
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert _fwd_op in targets or torch.ops.lightning_adaptiveload.layer_norm_modulate in targets
        return gm

    def f(x, shift, scale):
        y, _, _ = torch.ops.lightning_adaptiveload.layer_norm_modulate(x, shift, scale, None, None, 5, 1e-6)
        return y * 2

    torch._dynamo.reset()
    x, shift, scale = torch.randn(2, 5, 24), torch.randn(2, 24), torch.randn(2, 24)
    out = torch.compile(f, backend=backend, fullgraph=True)(x, shift, scale)
    assert counts["graphs"] == 1
    assert torch.equal(out, f(x, shift, scale))


def test_op_under_aot_autograd_matches_eager():
    x, shift, scale, w, b, g, eps = _op_inputs(False, True)

    def f(*args):
        return _fwd_op(*args, g, eps)[0].sum()

    torch._dynamo.reset()
    leaves = (x, shift, scale, w, b)
    grads = torch.autograd.grad(torch.compile(f, backend="aot_eager", fullgraph=True)(*leaves), leaves)
    grads_e = torch.autograd.grad(f(*leaves), leaves)
    for a, c in zip(grads, grads_e):
        assert torch.allclose(a, c, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------
# Build loader


def test_find_csrc_finds_the_checkout_sources():
    csrc = _build.find_csrc()
    for name in _build.SOURCES + _build.HEADERS:
        assert (csrc / name).is_file()


def test_missing_sources_are_reported_with_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_ADAPTIVELOAD_CSRC", str(tmp_path / "nowhere"))
    monkeypatch.setattr(_build, "__file__", str(tmp_path / "pkg" / "ops" / "_build.py"))
    with pytest.raises(_build.FusedOpUnavailable, match="were not found; looked in: .*nowhere"):
        _build.find_csrc()


def test_build_key_tracks_sources_and_architecture(tmp_path):
    src = _build.find_csrc()
    copy = tmp_path / "csrc"
    shutil.copytree(src, copy)
    k1 = _build.build_key(copy, ["9.0"])
    assert k1 == _build.build_key(copy, ["9.0"])
    assert k1 != _build.build_key(copy, ["8.0"])
    assert torch.__version__.replace("+", "_") in k1
    kernels = copy / "ln_modulate_kernels.cuh"
    kernels.write_text(kernels.read_text() + "\n// changed\n")
    assert _build.build_key(copy, ["9.0"]) != k1


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the CPU-only torch message")
def test_cpu_torch_reports_why_the_kernels_are_unavailable(capsys):
    with pytest.raises(_build.FusedOpUnavailable, match="CPU-only build"):
        _build.load_extension(archs=["9.0"])
    assert _build.main(["--arch", "9.0"]) == 1
    assert "CPU-only build" in capsys.readouterr().err
    ok, reason = fused_op_status()
    assert not ok and reason


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(_build.FusedOpUnavailable, match="nvcc was not found.*CUDA_HOME"):
        _build._check_toolchain()


class _StandInExtension:
    """Checks the arguments the CUDA kernels get, and computes with the math implementation."""

    def __init__(self):
        self.calls = []

    def forward(self, x, shift, scale, w, b, group_size, eps, warps_per_row, rows_per_cta):
        self.calls.append(("forward", x, shift, scale, w, b))
        return _impl._fwd_math(x, shift, scale, w, b, group_size, eps)

    def backward(self, dy, x, scale, w, b, mean, rstd, group_size, vpt, slots):
        self.calls.append(("backward", dy, x, scale, w, b))
        return _impl._bwd_math(dy, x, scale, w, b, mean, rstd, group_size)


def test_cuda_implementation_prepares_kernel_arguments(monkeypatch):
    """The CUDA kernel's Python side, exercised on CPU tensors with a stand-in for the extension."""
    ext = _StandInExtension()
    monkeypatch.setattr(_build, "get_extension", lambda: (ext, None))
    base = torch.randn(2 * 5 * 24 + 1, dtype=torch.bfloat16)
    x = base[1:].view(2, 5, 24)  # 2-byte storage offset: not 16-byte aligned
    table = torch.randn(2, 6, 24)
    shift = table[:, 0]  # strided rows, 16-byte aligned (row stride 6 * 24 * 4 bytes)
    scale = torch.randn(2, 24, dtype=torch.bfloat16)  # another dtype than shift
    bias = torch.randn(24)
    y, mean, rstd = _impl._fwd_cuda(x, shift, scale, None, bias, 5, 1e-6)
    _, kx, ksh, ksc, kw, kb = ext.calls[-1]
    assert kx.data_ptr() % 16 == 0 and kx.is_contiguous()
    assert ksh.dtype == ksc.dtype == torch.float32  # mixed modulation dtypes are computed in fp32
    assert torch.equal(kw, torch.ones(24)) and torch.equal(kb, bias)  # bias alone: weight of ones
    y_ref, _, _ = _impl._fwd_math(x, shift, scale.float(), None, bias, 5, 1e-6)
    assert torch.equal(y, y_ref)
    dy = torch.randn_like(x)
    dx, dshift, dscale, dweight, dbias = _impl._bwd_cuda(dy, x, scale, None, bias, mean, rstd, 5)
    assert dscale.dtype == torch.bfloat16 and dshift.dtype == torch.bfloat16  # the scale table's dtype
    assert dweight.numel() == 0 and dbias.shape == (24,)
    assert ext.calls[-1][0] == "backward"


def test_cuda_implementation_falls_back_with_one_warning_when_the_build_fails(monkeypatch):
    monkeypatch.setattr(_build, "get_extension", lambda: (None, "nvcc was not found (stand-in)"))
    _impl._warned.clear()
    x, shift, scale = torch.randn(2, 5, 24), torch.randn(2, 24), torch.randn(2, 24)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = _impl._fwd_cuda(x, shift, scale, None, None, 5, 1e-6)
        _impl._fwd_cuda(x, shift, scale, None, None, 5, 1e-6)
    msgs = [str(r.message) for r in rec]
    assert len(msgs) == 1 and "nvcc was not found" in msgs[0]
    assert torch.equal(out[0], _impl._fwd_math(x, shift, scale, None, None, 5, 1e-6)[0])


@pytest.mark.parametrize("affine", [False, True])
def test_eager_autograd_path_matches_the_op(affine):
    """The eager path (autograd.Function around the extension) and the custom op give the same gradients."""
    ext = _StandInExtension()
    x, shift, scale, w, b, g, eps = _op_inputs(False, affine)
    leaves = [t for t in (x, shift, scale, w, b) if t is not None]
    y = _impl._EagerFused.apply(x, shift, scale, w, b, g, eps, ext)
    y_op, _, _ = _fwd_op(x, shift, scale, w, b, g, eps)
    assert torch.equal(y, y_op)
    dy = torch.randn_like(y)
    for a, c in zip(torch.autograd.grad(y, leaves, dy), torch.autograd.grad(y_op, leaves, dy)):
        assert torch.equal(a, c)
    assert [c[0] for c in ext.calls] == ["forward", "backward"]
