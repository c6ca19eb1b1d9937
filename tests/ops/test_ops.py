"""CPU tests of layer_norm_modulate: the reference, the layouts, the op's registration and the build loader."""

from __future__ import annotations

import importlib
import re
import shutil
import warnings

import pytest
import torch

from lightning_adaptiveload.cli.build_ops import main as build_ops_main
from lightning_adaptiveload.ops import (
    FusedOpUnavailable,
    _build,
    fused_op_paths,
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
    assert build_ops_main(["--arch", "9.0"]) == 1
    assert "CPU-only build" in capsys.readouterr().err
    ok, reason = fused_op_status()
    assert not ok and reason


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    with pytest.raises(_build.FusedOpUnavailable, match="nvcc was not found.*CUDA_HOME"):
        _build._check_toolchain()


def test_cached_build_loads_without_the_toolchain(tmp_path, monkeypatch):
    """A build in the (shared) cache loads on a node without nvcc: the toolchain is checked only to build."""
    monkeypatch.setenv("LIGHTNING_ADAPTIVELOAD_CACHE", str(tmp_path))
    archs = ["9.0"]
    key = _build.build_key(_build.find_csrc(), archs)
    library = tmp_path / "torch_extensions" / key / f"{_build._library_name(key)}.so"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"stand-in for the shared library")

    def no_toolchain():
        raise _build.FusedOpUnavailable("nvcc was not found (stand-in)")

    loaded = []
    monkeypatch.setattr(_build, "_check_toolchain", no_toolchain)
    monkeypatch.setattr(_build, "_load_library", loaded.append)
    path, build_dir = _build.load_extension(archs=archs)
    assert path == library and loaded == [library] and build_dir == library.parent
    # Without the cached file the toolchain is needed, and its absence is the error.
    library.unlink()
    with pytest.raises(_build.FusedOpUnavailable, match="nvcc was not found"):
        _build.load_extension(archs=archs)


def test_a_library_without_a_python_module_leaves_the_checked_path(tmp_path, caplog):
    bogus = tmp_path / "adaptiveload_ln_modulate_000000000000.so"
    bogus.write_bytes(b"not a shared library")
    with caplog.at_level("WARNING", logger="lightning_adaptiveload.ops"):
        assert _build.python_entry(bogus) is None
    assert "did not import" in caplog.text and bogus.name in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the library loads where a GPU is visible")
def test_without_the_library_there_is_no_fast_path():
    # No GPU: the ops take their checked path, which is what the CPU tests above exercise.
    assert not _impl._KERNELS_LOADED and _impl._cfast is None


def test_require_fused_makes_the_fallback_an_error(monkeypatch):
    x, shift, scale = torch.randn(2, 5, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    monkeypatch.setenv("LIGHTNING_ADAPTIVELOAD_REQUIRE_FUSED", "1")
    with pytest.raises(FusedOpUnavailable, match="x is on cpu.*LIGHTNING_ADAPTIVELOAD_REQUIRE_FUSED=1"):
        layer_norm_modulate(x, shift, scale)
    monkeypatch.setenv("LIGHTNING_ADAPTIVELOAD_REQUIRE_FUSED", "0")
    _impl._warned.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(
            layer_norm_modulate(x, shift, scale), layer_norm_modulate_reference(x, shift, scale)
        )


def test_fused_op_paths_says_which_implementation_ran(monkeypatch):
    monkeypatch.setattr(_impl, "_paths", {})
    assert fused_op_paths() == "not called"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layer_norm_modulate(torch.randn(2, 5, 16), torch.randn(2, 1, 16), torch.randn(2, 1, 16))
    assert fused_op_paths() == "PyTorch fallback (x is on cpu; the fused kernels need CUDA)"


@pytest.mark.parametrize("m_shape, group_size", [((2, 1, 16), 0), ((2, 0, 16), 1)])
def test_no_rows_give_an_empty_result(m_shape, group_size):
    """x of shape (B, 0, D): an empty y and zero modulation gradients, from the reference and the op."""
    x = torch.randn(2, 0, 16, requires_grad=True)
    shift, scale = torch.randn(m_shape, requires_grad=True), torch.randn(m_shape, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = layer_norm_modulate(x, shift, scale)
    assert y.shape == (2, 0, 16)
    dx, dshift, dscale = torch.autograd.grad(y.sum(), (x, shift, scale))
    assert dx.shape == x.shape and not dshift.any() and not dscale.any()
    table_sh, g = _impl._as_groups(shift, x)
    table_sc, _ = _impl._as_groups(scale, x)
    assert g == group_size
    torch.library.opcheck(_fwd_op, (x, table_sh, table_sc, None, None, g, 1e-6))


def test_python_schemas_are_the_cpp_ones():
    """Where the library is not loaded, the operator is defined from copies of its schemas: the same text."""
    cpp = (_build.find_csrc() / "ln_modulate_binding.cpp").read_text()
    block = cpp[cpp.index("TORCH_LIBRARY(lightning_adaptiveload") :]
    defs = ["".join(re.findall(r'"([^"]*)"', d)) for d in re.findall(r"m\.def\((.*?)\);", block, re.S)]
    # The private benchmark operators (a leading underscore) exist only where the library is loaded.
    public = [d for d in defs if not d.startswith("_")]
    assert public == [name + schema for name, schema in _impl._SCHEMAS.items()]
    assert {"layer_norm_modulate", "rms_norm_modulate"} <= set(_impl._SCHEMAS)
    for name, schema in _impl._SCHEMAS.items():
        op = getattr(torch.ops.lightning_adaptiveload, name).default
        assert str(op._schema) == f"lightning_adaptiveload::{name}{schema}"


def test_monitor_summary_says_which_path_ran(monkeypatch):
    from lightning_adaptiveload.callbacks.load_balance import LoadBalanceMonitor, _norm_modulate_path

    monkeypatch.setattr(_impl, "_paths", {"reference": "x is on cpu; the fused kernels need CUDA"})
    assert _norm_modulate_path() == fused_op_paths()
    monitor = LoadBalanceMonitor()
    meta = {"num_steps": 0, "world_size": 1, "device": "cpu", "timing_method": "step", "flops_source": "none"}
    monitor.summary = {
        "meta": {**meta, "norm_modulate_path": _norm_modulate_path()},
        "overall": {},
        "table": {},
    }
    assert "layer_norm_modulate (rank 0): PyTorch fallback (x is on cpu" in monitor._format_summary()
