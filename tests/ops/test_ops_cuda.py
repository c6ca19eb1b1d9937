"""GPU tests of the fused LayerNorm-Modulate kernels against a float64 reference.

Every check draws fresh random inputs, poisons the memory the outputs will be allocated from (NaN), and
compares with the float64 reference by relative L2 error: forward under 1e-2 for 16-bit and 1e-5 for fp32,
gradients under 1e-2 for 16-bit (1e-4 for fp32); never a NaN.
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch

from lightning_adaptiveload.ops import (
    fused_op_paths,
    fused_op_status,
    layer_norm_modulate,
    layer_norm_modulate_reference,
)

pytestmark = pytest.mark.cuda

_impl = importlib.import_module("lightning_adaptiveload.ops.layer_norm_modulate")

FWD_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
BWD_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@pytest.fixture(scope="module", autouse=True)
def _fused_available():
    ok, info = fused_op_status()
    assert ok, f"the fused kernels must build on a CUDA machine: {info}"


def _poison(numel_bytes: int) -> None:
    # Fill a block the caching allocator will hand out again with NaN: unwritten outputs then show.
    blk = torch.empty(max(numel_bytes // 4, 1) + 1024, device="cuda", dtype=torch.float32)
    blk.fill_(float("nan"))
    del blk


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert not torch.isnan(a).any(), "NaN in the fused result"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _make(x_shape, mod_shape, dtype, mod_dtype, affine, x_scale=1.0, x_offset=0.0):
    D = x_shape[-1]
    x = (torch.randn(x_shape, device="cuda", dtype=torch.float32) * x_scale + x_offset).to(dtype)
    shift = (0.5 * torch.randn(mod_shape, device="cuda")).to(mod_dtype)
    scale = (0.5 * torch.randn(mod_shape, device="cuda")).to(mod_dtype)
    w = b = None
    if affine:
        w = 1.0 + 0.3 * torch.randn(D, device="cuda")
        b = 0.3 * torch.randn(D, device="cuda")
    return x, shift, scale, w, b


def _check(x, shift, scale, w=None, b=None, backward=True, eps=1e-6, bwd_tol=None):
    dtype = x.dtype
    leaves = [t for t in (x, shift, scale, w, b) if t is not None]
    ins = [t.detach().clone().requires_grad_(backward) for t in leaves]
    ref_ins = [t.detach().double().requires_grad_(backward) for t in leaves]

    def unpack(ts):
        it = iter(ts)
        return [next(it) if t is not None else None for t in (x, shift, scale, w, b)]

    _poison(x.numel() * x.element_size() * 4)
    y = layer_norm_modulate(*unpack(ins), eps=eps)
    y_ref = layer_norm_modulate_reference(*unpack(ref_ins), eps=eps)
    assert y.dtype == dtype and y.shape == x.shape
    err = _rel(y, y_ref)
    assert err < FWD_TOL[dtype], f"forward rel err {err:.3g}"
    if not backward:
        return
    dy = torch.randn_like(y)
    _poison(x.numel() * x.element_size() * 8)
    grads = torch.autograd.grad(y, ins, dy)
    grads_ref = torch.autograd.grad(y_ref, ref_ins, dy.double())
    names = [
        n for n, t in zip(("x", "shift", "scale", "weight", "bias"), (x, shift, scale, w, b)) if t is not None
    ]
    for name, g, gr, t in zip(names, grads, grads_ref, leaves):
        assert g.dtype == t.dtype and g.shape == t.shape, name
        e = _rel(g, gr)
        assert e < (bwd_tol or BWD_TOL[dtype]), f"d{name} rel err {e:.3g}"


LAYOUTS = {
    # name: (x shape, modulation shape)
    "sample_b1d": ((3, 257, 1536), (3, 1, 1536)),
    "sample_bd": ((2, 129, 1536), (2, 1536)),
    "token": ((2, 65, 1536), (2, 65, 1536)),
    "frame": ((2, 5, 37, 1536), (2, 5, 1, 1536)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("mod_fp32", [True, False])
@pytest.mark.parametrize("affine", [False, True])
def test_layouts_dtypes_affine(layout, dtype, mod_fp32, affine):
    x_shape, m_shape = LAYOUTS[layout]
    _check(*_make(x_shape, m_shape, dtype, torch.float32 if mod_fp32 else dtype, affine))


@pytest.mark.parametrize("D", [8, 24, 136, 1536, 3072, 5120, 8200, 16384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_feature_sizes(D, dtype):
    _check(*_make((2, 33, D), (2, 1, D), dtype, torch.float32, affine=D % 3 == 0))


@pytest.mark.parametrize("rows", [1, 7, 1000003])
def test_odd_row_counts(rows):
    for layout in ("sample", "token"):
        m_shape = (1, 1, 64) if layout == "sample" else (1, rows, 64)
        _check(*_make((1, rows, 64), m_shape, torch.bfloat16, torch.float32, affine=rows == 7))


@pytest.mark.parametrize("B", [1, 2, 5, 16])
def test_batch_sizes(B):
    S = 1 + 97 * B
    _check(*_make((B, S, 1536), (B, 1, 1536), torch.bfloat16, torch.float32, affine=False))
    _check(*_make((B, 3, 1536), (B, 1536), torch.bfloat16, torch.bfloat16, affine=True))


def test_many_small_groups():
    # More groups than resident CTAs: CTAs loop over groups.
    _check(*_make((2000, 4, 256), (2000, 1, 256), torch.bfloat16, torch.float32, affine=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_magnitudes(dtype):
    _check(*_make((2, 100, 1536), (2, 1, 1536), dtype, torch.float32, affine=True, x_scale=1e4))
    if dtype == torch.float32:
        # Far from zero with unit spread: the corrected two-pass statistics keep the forward at fp32
        # accuracy; the backward reads the saved fp32 mean, rounded to ~5e-4 at 1e4, hence 1e-3.
        _check(
            *_make((2, 100, 1536), (2, 1, 1536), dtype, torch.float32, affine=False, x_offset=1e4),
            bwd_tol=1e-3,
        )


def test_constant_rows():
    x, shift, scale, w, b = _make((2, 64, 1536), (2, 1, 1536), torch.bfloat16, torch.float32, affine=False)
    x[:, ::3] = 3.0
    x[1, 5] = 0.0
    _check(x, shift, scale, w, b)


def test_strided_and_misaligned_inputs():
    D = 1536
    table = torch.randn(2, 6, D, device="cuda")
    shift, scale = table[:, 0:1], table[:, 1:2]  # Wan's chunk of a (B, 6, D) table: strided rows
    base = torch.randn(2 * 50 * D + 3, device="cuda", dtype=torch.bfloat16)
    x = base[3:].view(2, 50, D)  # storage offset of 6 bytes: not 16-byte aligned
    _check(x, shift, scale)


def test_mixed_modulation_dtypes_and_layouts():
    x, shift, _, _, _ = _make((2, 40, 512), (2, 1, 512), torch.bfloat16, torch.bfloat16, affine=False)
    scale = 0.5 * torch.randn(2, 40, 512, device="cuda")  # per token and fp32, shift per sample and bf16
    _check(x, shift, scale)


def test_backward_is_deterministic():
    x, shift, scale, w, b = _make((1, 20000, 1536), (1, 1, 1536), torch.bfloat16, torch.float32, affine=True)
    ins = [t.clone().requires_grad_() for t in (x, shift, scale, w, b)]
    dy = torch.randn_like(x)
    first = torch.autograd.grad(layer_norm_modulate(*ins), ins, dy)
    for _ in range(3):
        again = torch.autograd.grad(layer_norm_modulate(*ins), ins, dy)
        for a, c in zip(first, again):
            assert torch.equal(a, c)


def test_unsupported_feature_size_falls_back_with_one_warning():
    x, shift, scale, _, _ = _make((2, 9, 100), (2, 1, 100), torch.bfloat16, torch.float32, affine=False)
    _impl._warned.clear()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        y1 = layer_norm_modulate(x, shift, scale)
        layer_norm_modulate(x, shift, scale)
    msgs = [str(r.message) for r in rec if "layer_norm_modulate" in str(r.message)]
    assert len(msgs) == 1 and "D = 100" in msgs[0]
    assert _rel(y1, layer_norm_modulate_reference(x.double(), shift.double(), scale.double())) < 1e-2


@pytest.mark.parametrize("affine", [False, True])
@pytest.mark.parametrize("group", ["sample", "token"])
def test_opcheck_cuda(affine, group):
    D = 64
    x = torch.randn(2, 6, D, device="cuda", requires_grad=True)
    rows = 2 if group == "sample" else 12
    shift = torch.randn(rows, D, device="cuda", requires_grad=True)
    scale = torch.randn(rows, D, device="cuda", requires_grad=True)
    w = torch.randn(D, device="cuda", requires_grad=True) if affine else None
    b = torch.randn(D, device="cuda", requires_grad=True) if affine else None
    torch.library.opcheck(
        torch.ops.lightning_adaptiveload.layer_norm_modulate.default,
        (x, shift, scale, w, b, 6 if rows == 2 else 1, 1e-6),
    )


def test_torch_compile_keeps_one_op_without_graph_breaks():
    torch._dynamo.reset()
    x, shift, scale, w, b = _make((2, 256, 1536), (2, 1536), torch.bfloat16, torch.float32, affine=True)

    def block(x, shift, scale, w, b):
        return layer_norm_modulate(x, shift, scale, w, b) * 2.0

    compiled = torch.compile(block, fullgraph=True)
    ins = [t.clone().requires_grad_() for t in (x, shift, scale, w, b)]
    ins_e = [t.clone().requires_grad_() for t in (x, shift, scale, w, b)]
    y = compiled(*ins)
    y_e = block(*ins_e)
    assert torch.equal(y, y_e)
    dy = torch.randn_like(y)
    for g, ge in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(y_e, ins_e, dy)):
        assert torch.allclose(g.float(), ge.float(), rtol=1e-3, atol=1e-3)


def test_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    x, shift, scale, _, _ = _make((2, 128, 1536), (2, 1, 1536), torch.bfloat16, torch.float32, affine=False)
    ins = [t.clone().requires_grad_() for t in (x, shift, scale)]
    ins_c = [t.clone().requires_grad_() for t in (x, shift, scale)]
    y = layer_norm_modulate(*ins)
    y_c = checkpoint(layer_norm_modulate, *ins_c, use_reentrant=False)
    dy = torch.randn_like(y)
    for g, gc in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(y_c, ins_c, dy)):
        assert torch.equal(g, gc)


# ---------------------------------------------------------------------------------------------------------
# The one path: registration, eager calls through the operator, opcheck on what eager training passes


_FWD_OP = torch.ops.lightning_adaptiveload.layer_norm_modulate.default
_BWD_OP = torch.ops.lightning_adaptiveload.layer_norm_modulate_backward.default


def test_the_library_registered_the_operator_and_its_cuda_kernels():
    for op, name in ((_FWD_OP, "layer_norm_modulate"), (_BWD_OP, "layer_norm_modulate_backward")):
        assert str(op._schema) == f"lightning_adaptiveload::{name}{_impl._SCHEMAS[name]}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA")
    assert _impl._KERNELS_LOADED


class _OpRecorder(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_eager_calls_and_their_backward_go_through_the_operator():
    x, shift, scale, w, b = _make((2, 64, 256), (2, 1, 256), torch.bfloat16, torch.float32, affine=True)
    ins = [t.clone().requires_grad_() for t in (x, shift, scale, w, b)]
    with _OpRecorder() as rec:
        y = layer_norm_modulate(*ins)
        torch.autograd.grad(y, ins, torch.randn_like(y))
    assert _FWD_OP in rec.ops and _BWD_OP in rec.ops
    assert "fused CUDA kernel" in fused_op_paths()


def _eager_inputs(kind: str):
    """The operator's inputs as layer_norm_modulate prepares them from the layouts eager training uses.

    opcheck needs leaf tensors, so strided tables and misaligned x become contiguous copies here; the
    gradient checks above (``_check``) run those through the same operator."""
    D = 256
    if kind == "sample_bf16_fp32":  # Wan 2.1: bf16 x, (B, 1, D) fp32 chunks of the modulation table
        x = torch.randn(2, 40, D, device="cuda", dtype=torch.bfloat16)
        shift = scale = torch.randn(2, 6, D, device="cuda")[:, 0:1]
    elif kind == "token_bf16":  # Wan 2.2 TI2V: per-token modulation in x's dtype
        x = torch.randn(2, 24, D, device="cuda", dtype=torch.bfloat16)
        shift = scale = torch.randn(2, 24, D, device="cuda", dtype=torch.bfloat16)
    else:  # "empty": no rows
        x = torch.randn(2, 0, D, device="cuda")
        shift = scale = torch.randn(2, 1, D, device="cuda")
    (t_sh, group), (t_sc, _) = _impl._as_groups(shift, x), _impl._as_groups(scale, x)
    w = 1.0 + 0.3 * torch.randn(D, device="cuda")  # weight without bias: the kernels get a zero bias
    leaves = [t.detach().clone().requires_grad_() for t in (x, t_sh, t_sc, w)]
    return (*leaves, None, group, 1e-6)


@pytest.mark.parametrize("kind", ["sample_bf16_fp32", "token_bf16", "empty"])
def test_opcheck_on_the_inputs_of_eager_training(kind):
    torch.library.opcheck(_FWD_OP, _eager_inputs(kind))


def test_empty_rows_give_an_empty_result_on_cuda():
    x = torch.randn(3, 0, 1536, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    shift = torch.randn(3, 1, 1536, device="cuda", requires_grad=True)
    scale = torch.randn(3, 1, 1536, device="cuda", requires_grad=True)
    y = layer_norm_modulate(x, shift, scale)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_cuda
    dx, dshift, dscale = torch.autograd.grad(y.sum(), (x, shift, scale))
    assert dx.shape == x.shape and not dshift.any() and not dscale.any()


def test_require_fused_passes_where_the_kernels_run_and_raises_where_not(monkeypatch):
    monkeypatch.setenv("LIGHTNING_ADAPTIVELOAD_REQUIRE_FUSED", "1")
    x, shift, scale, _, _ = _make((2, 9, 256), (2, 1, 256), torch.bfloat16, torch.float32, affine=False)
    layer_norm_modulate(x, shift, scale)
    with pytest.raises(RuntimeError, match="D = 100.*REQUIRE_FUSED=1"):
        layer_norm_modulate(*_make((2, 9, 100), (2, 1, 100), torch.bfloat16, torch.float32, affine=False)[:3])
