"""GPU tests of the fused norm-modulate kernels (LayerNorm and RMSNorm) against a float64 reference.

Every check draws fresh random inputs, poisons the memory the outputs will be allocated from (NaN), and
compares with the float64 reference by relative L2 error: forward under 1e-2 for 16-bit and 1e-5 for fp32,
gradients under 1e-2 for 16-bit (1e-4 for fp32); never a NaN. Most tests run for both ops (``norm``).
"""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch.utils.checkpoint

from lightning_adaptiveload.ops import (
    fused_op_paths,
    fused_op_status,
    layer_norm_modulate,
    layer_norm_modulate_reference,
    rms_norm_modulate,
    rms_norm_modulate_reference,
)

pytestmark = pytest.mark.cuda

_impl = importlib.import_module("lightning_adaptiveload.ops.layer_norm_modulate")

NORMS = {
    "ln": (layer_norm_modulate, layer_norm_modulate_reference),
    "rms": (rms_norm_modulate, rms_norm_modulate_reference),
}
FWD_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-5}
BWD_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


@pytest.fixture(scope="module", autouse=True)
def _fused_available():
    ok, info = fused_op_status()
    assert ok, f"the fused kernels must build on a CUDA machine: {info}"


@pytest.fixture(params=sorted(NORMS))
def norm(request):
    if request.param == "rms" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the RMSNorm kernels need compute capability 9.0")
    return request.param


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


def _check(x, shift, scale, w=None, b=None, backward=True, eps=1e-6, bwd_tol=None, norm="ln"):
    fused, reference = NORMS[norm]
    dtype = x.dtype
    leaves = [t for t in (x, shift, scale, w, b) if t is not None]
    ins = [t.detach().clone().requires_grad_(backward) for t in leaves]
    ref_ins = [t.detach().double().requires_grad_(backward) for t in leaves]

    def unpack(ts):
        it = iter(ts)
        return [next(it) if t is not None else None for t in (x, shift, scale, w, b)]

    _poison(x.numel() * x.element_size() * 4)
    y = fused(*unpack(ins), eps=eps)
    y_ref = reference(*unpack(ref_ins), eps=eps)
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
def test_layouts_dtypes_affine(layout, dtype, mod_fp32, affine, norm):
    x_shape, m_shape = LAYOUTS[layout]
    _check(*_make(x_shape, m_shape, dtype, torch.float32 if mod_fp32 else dtype, affine), norm=norm)


@pytest.mark.parametrize("D", [8, 24, 136, 1536, 3072, 5120, 8200, 16384])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_feature_sizes(D, dtype, norm):
    _check(*_make((2, 33, D), (2, 1, D), dtype, torch.float32, affine=D % 3 == 0), norm=norm)
    # Per token too: the modulation rows travel with x's in the bulk-copy kernels (or through L1 where a
    # stage of three rows would not fit twice).
    _check(*_make((1, 9, D), (1, 9, D), dtype, torch.float32, affine=False), norm=norm)


@pytest.mark.parametrize("rows", [1, 7, 1000003])
def test_odd_row_counts(rows, norm):
    for layout in ("sample", "token"):
        m_shape = (1, 1, 64) if layout == "sample" else (1, rows, 64)
        _check(*_make((1, rows, 64), m_shape, torch.bfloat16, torch.float32, affine=rows == 7), norm=norm)


@pytest.mark.parametrize("B", [1, 2, 5, 16])
def test_batch_sizes(B, norm):
    S = 1 + 97 * B
    _check(*_make((B, S, 1536), (B, 1, 1536), torch.bfloat16, torch.float32, affine=False), norm=norm)
    _check(*_make((B, 3, 1536), (B, 1536), torch.bfloat16, torch.bfloat16, affine=True), norm=norm)


def test_many_small_groups(norm):
    # More groups than resident CTAs: CTAs loop over groups.
    _check(*_make((2000, 4, 256), (2000, 1, 256), torch.bfloat16, torch.float32, affine=True), norm=norm)
    _check(*_make((6000, 3, 1536), (6000, 1, 1536), torch.bfloat16, torch.float32, affine=False), norm=norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_magnitudes(dtype, norm):
    _check(*_make((2, 100, 1536), (2, 1, 1536), dtype, torch.float32, affine=True, x_scale=1e4), norm=norm)
    if norm == "rms":
        _check(
            *_make((2, 100, 1536), (2, 1, 1536), dtype, torch.float32, affine=False, x_offset=1e4), norm=norm
        )
    if dtype == torch.float32 and norm == "ln":
        # Far from zero with unit spread: the corrected two-pass statistics keep the forward at fp32
        # accuracy; the backward reads the saved fp32 mean, rounded to ~5e-4 at 1e4, hence 1e-3.
        _check(
            *_make((2, 100, 1536), (2, 1, 1536), dtype, torch.float32, affine=False, x_offset=1e4),
            bwd_tol=1e-3,
        )


def test_constant_rows(norm):
    x, shift, scale, w, b = _make((2, 64, 1536), (2, 1, 1536), torch.bfloat16, torch.float32, affine=False)
    x[:, ::3] = 3.0
    if norm == "ln":
        x[1, 5] = 0.0  # a zero row of an RMSNorm has no direction; its gradient is eps-bound, not compared
    _check(x, shift, scale, w, b, norm=norm)


def test_strided_and_misaligned_inputs(norm):
    D = 1536
    table = torch.randn(2, 6, D, device="cuda")
    shift, scale = table[:, 0:1], table[:, 1:2]  # Wan's chunk of a (B, 6, D) table: strided rows
    base = torch.randn(2 * 50 * D + 3, device="cuda", dtype=torch.bfloat16)
    x = base[3:].view(2, 50, D)  # storage offset of 6 bytes: not 16-byte aligned
    _check(x, shift, scale, norm=norm)
    # LTX-Video's per-token modulation: (B, S, D) views of a (B, S, 6, D) table (row stride 6 D).
    table = torch.randn(2, 50, 6, D, device="cuda")
    _check(x, table[:, :, 0], table[:, :, 1], norm=norm)


def test_mixed_modulation_dtypes_and_layouts(norm):
    x, shift, _, _, _ = _make((2, 40, 512), (2, 1, 512), torch.bfloat16, torch.bfloat16, affine=False)
    scale = 0.5 * torch.randn(2, 40, 512, device="cuda")  # per token and fp32, shift per sample and bf16
    _check(x, shift, scale, norm=norm)


def test_backward_is_deterministic(norm):
    fused = NORMS[norm][0]
    x, shift, scale, w, b = _make((1, 20000, 1536), (1, 1, 1536), torch.bfloat16, torch.float32, affine=True)
    ins = [t.clone().requires_grad_() for t in (x, shift, scale, w, b)]
    dy = torch.randn_like(x)
    first = torch.autograd.grad(fused(*ins), ins, dy)
    for _ in range(3):
        again = torch.autograd.grad(fused(*ins), ins, dy)
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
def test_opcheck_cuda(affine, group, norm):
    D = 64
    x = torch.randn(2, 6, D, device="cuda", requires_grad=True)
    rows = 2 if group == "sample" else 12
    shift = torch.randn(rows, D, device="cuda", requires_grad=True)
    scale = torch.randn(rows, D, device="cuda", requires_grad=True)
    w = torch.randn(D, device="cuda", requires_grad=True) if affine else None
    b = torch.randn(D, device="cuda", requires_grad=True) if affine else None
    op = getattr(
        torch.ops.lightning_adaptiveload, "rms_norm_modulate" if norm == "rms" else "layer_norm_modulate"
    )
    torch.library.opcheck(op.default, (x, shift, scale, w, b, 6 if rows == 2 else 1, 1e-6))


def test_torch_compile_keeps_one_op_without_graph_breaks(norm):
    torch._dynamo.reset()
    fused = NORMS[norm][0]
    x, shift, scale, w, b = _make((2, 256, 1536), (2, 1536), torch.bfloat16, torch.float32, affine=True)

    def block(x, shift, scale, w, b):
        return fused(x, shift, scale, w, b) * 2.0

    compiled = torch.compile(block, fullgraph=True)
    ins = [t.clone().requires_grad_() for t in (x, shift, scale, w, b)]
    ins_e = [t.clone().requires_grad_() for t in (x, shift, scale, w, b)]
    y = compiled(*ins)
    y_e = block(*ins_e)
    assert torch.equal(y, y_e)
    dy = torch.randn_like(y)
    for g, ge in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(y_e, ins_e, dy)):
        assert torch.allclose(g.float(), ge.float(), rtol=1e-3, atol=1e-3)


def test_activation_checkpointing(norm):
    from torch.utils.checkpoint import checkpoint

    fused = NORMS[norm][0]
    x, shift, scale, _, _ = _make((2, 128, 1536), (2, 1, 1536), torch.bfloat16, torch.float32, affine=False)
    ins = [t.clone().requires_grad_() for t in (x, shift, scale)]
    ins_c = [t.clone().requires_grad_() for t in (x, shift, scale)]
    y = fused(*ins)
    y_c = checkpoint(fused, *ins_c, use_reentrant=False)
    dy = torch.randn_like(y)
    for g, gc in zip(torch.autograd.grad(y, ins, dy), torch.autograd.grad(y_c, ins_c, dy)):
        assert torch.equal(g, gc)


# ---------------------------------------------------------------------------------------------------------
# The one path: registration, eager calls through the operator, opcheck on what eager training passes


_FWD_OP = torch.ops.lightning_adaptiveload.layer_norm_modulate.default
_BWD_OP = torch.ops.lightning_adaptiveload.layer_norm_modulate_backward.default


def test_the_library_registered_the_operators_their_cuda_kernels_and_autograd():
    for name, schema in _impl._SCHEMAS.items():
        op = getattr(torch.ops.lightning_adaptiveload, name).default
        assert str(op._schema) == f"lightning_adaptiveload::{name}{schema}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CUDA")
    # The autograd formula of both forwards is the library's (C++), not a Python registration.
    for name in ("layer_norm_modulate", "rms_norm_modulate"):
        op = getattr(torch.ops.lightning_adaptiveload, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Autograd")
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


# ---------------------------------------------------------------------------------------------------------
# The launchers' plans and variants (through the library's private benchmark operators), and the eager
# fast path


def _plans(x, scale, group, rms, **kw):
    args = dict(fwd_path=0, threads=0, fwd_stages=0, bwd_path=0, vpt=0, bwd_rows=0, bwd_stages=0)
    args.update(kw)
    return list(
        torch.ops.lightning_adaptiveload._norm_modulate_plans(
            x,
            scale,
            group,
            rms,
            False,
            args["fwd_path"],
            args["threads"],
            args["fwd_stages"],
            args["bwd_path"],
            args["vpt"],
            args["bwd_rows"],
            args["bwd_stages"],
        )
    )


@pytest.mark.parametrize("D", [1152, 1536, 5120])
def test_auto_plans_take_the_bulk_copy_kernels_but_layernorm_forward_per_sample(D):
    # The host's auto choice: the bulk-copy kernels for both norms' backward and for RMSNorm's forward;
    # LayerNorm's forward per sample or per frame takes the register-fed version 4 where it fits (faster on
    # an H200), and per token the bulk-copy kernel.
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("bulk copies need compute capability 9.0")
    x = torch.randn(1, 4096, D, device="cuda", dtype=torch.bfloat16)
    scale = torch.randn(1, D, device="cuda")
    for rms in (False, True):
        for group, s in ((4096, scale), (1, torch.randn(4096, D, device="cuda"))):
            p = _plans(x, s, group, rms)
            fwd_bulk = 1 if (rms or group == 1) else 0
            assert p[0] == fwd_bulk and p[9] == 1, (rms, group, p)
            if fwd_bulk:
                assert p[3] >= 1 and p[8] >= 1  # stages, and at least one CTA per SM


# forward: (path, threads, stages); backward: (path, vectors per thread, rows per iteration, stages)
VARIANTS_FWD = [(4, 0, 2), (4, 0, 5), (4, 96, 3), (4, 160, 2), (4, 320, 2), (1, 0, 0), (2, 0, 0)]
VARIANTS_BWD = [
    (2, 1, 1, 2),
    (2, 1, 2, 3),
    (2, 1, 4, 2),
    (2, 2, 2, 3),
    (2, 2, 4, 2),
    (2, 4, 1, 4),
    (1, 0, 0, 0),
]


@pytest.mark.parametrize("D", [1536, 5120])
@pytest.mark.parametrize("layout", ["sample", "token"])
def test_every_launch_variant_computes_the_same_function(D, layout, norm):
    """Threads, stages and (LayerNorm) the register-fed kernels: each against the float64 reference."""
    ns = torch.ops.lightning_adaptiveload
    rms = norm == "rms"
    B, S = 2, 777
    x = torch.randn(B, S, D, device="cuda").to(torch.bfloat16)
    rows = B if layout == "sample" else B * S
    group = S if layout == "sample" else 1
    t_sh = 0.5 * torch.randn(rows, D, device="cuda")
    t_sc = 0.5 * torch.randn(rows, D, device="cuda")
    dy = torch.randn_like(x)
    ref = NORMS[norm][1]
    m_shape = (B, 1, D) if layout == "sample" else (B, S, D)
    leaves = [t.detach().double().requires_grad_() for t in (x, t_sh.reshape(m_shape), t_sc.reshape(m_shape))]
    y_ref = ref(*leaves)
    g_ref = torch.autograd.grad(y_ref, leaves, dy.double())
    for path, threads, stages in VARIANTS_FWD:
        if rms and path in (1, 2):
            continue
        _poison(x.numel() * 8)
        y, mean, rstd = ns._norm_modulate_tuned(
            x, t_sh, t_sc, None, None, group, 1e-6, rms, path, threads, stages
        )
        assert _rel(y, y_ref) < 1e-2, (path, threads, stages)
    _, mean, rstd = ns._norm_modulate_tuned(x, t_sh, t_sc, None, None, group, 1e-6, rms, 0, 0, 0)
    for path, vpt, rows_per_iter, stages in VARIANTS_BWD:
        if rms and path == 1:
            continue
        _poison(x.numel() * 8)
        dx, dsh, dsc, _, _ = ns._norm_modulate_backward_tuned(
            dy, x, t_sc, None, None, None if rms else mean, rstd, group, rms, path, vpt, rows_per_iter, stages
        )
        for name, got, want in (("dx", dx, g_ref[0]), ("dshift", dsh, g_ref[1]), ("dscale", dsc, g_ref[2])):
            assert _rel(got.reshape(want.shape), want) < 1e-2, (name, path, vpt, rows_per_iter, stages)


def test_repeated_eager_calls_take_the_cached_path_and_agree(norm, monkeypatch):
    fused = NORMS[norm][0]
    assert _impl._cfast is not None, "the library's fast path must import where the library loads"
    _impl._cfast.clear()
    x, shift, scale, w, b = _make((2, 300, 1536), (2, 1, 1536), torch.bfloat16, torch.float32, affine=True)
    y1 = fused(x, shift, scale, w, b)
    assert _impl._cfast.size() == 1  # the first call checked the input and remembered its signature
    # The second call must not reach the Python checks: make them fail, and it still runs (and agrees).
    with monkeypatch.context() as m:
        m.setattr(_impl, "_check_inputs", _must_not_run)
        y2 = fused(x, shift, scale, w, b)
        assert torch.equal(y1, y2)
        # Gradients through the fast path equal those of the checked path.
        ins = [t.detach().clone().requires_grad_() for t in (x, shift, scale, w, b)]
        dy = torch.randn_like(x)
        g_fast = torch.autograd.grad(fused(*ins), ins, dy)
    _impl._cfast.clear()
    g_checked = torch.autograd.grad(fused(*ins), ins, dy)
    for a, c in zip(g_fast, g_checked):
        assert torch.equal(a, c)
    # Another x shape is another signature, and goes through the checks first.
    with monkeypatch.context() as m:
        m.setattr(_impl, "_check_inputs", _must_not_run)
        with pytest.raises(AssertionError, match="checked path"):
            fused(x[:, :200], shift, scale, w, b)
    # Another shape, another entry; a layout needing an expanded copy is not remembered, and still right.
    _check(*_make((3, 5, 1536), (3, 1, 1536), torch.bfloat16, torch.float32, affine=False), norm=norm)
    _check(*_make((3, 5, 1536), (3, 1, 1536), torch.bfloat16, torch.float32, affine=False), norm=norm)
    x2, shift2, _, _, _ = _make((2, 40, 512), (2, 1, 512), torch.bfloat16, torch.bfloat16, affine=False)
    scale2 = 0.5 * torch.randn(2, 40, 512, device="cuda")
    _check(x2, shift2, scale2, norm=norm)
    _check(x2, shift2, scale2, norm=norm)
    # A modulation on another device is still an error naming the argument.
    with pytest.raises((RuntimeError, ValueError), match="shift"):
        fused(x, shift.cpu(), scale, w, b)


@pytest.mark.parametrize(
    "x_shape, layout",
    [
        ((2, 96, 512), "chunk"),  # (B, 1, D) chunks of a (B, 6, D) table, strided (Wan's)
        ((2, 96, 512), "2d"),  # (B, D)
        ((1, 3, 40, 512), "frame"),  # (B, F, 1, D)
        ((2, 96, 512), "token"),  # (B, S, D)
    ],
)
def test_the_fast_path_gives_the_checked_paths_gradients_in_each_layout(norm, x_shape, layout, monkeypatch):
    fused = NORMS[norm][0]
    D = x_shape[-1]
    x = torch.randn(x_shape, device="cuda").to(torch.bfloat16)
    if layout == "chunk":
        table = torch.randn(x_shape[0], 6, D, device="cuda")
        shift, scale = table[:, 1:2], table[:, 4:5]
    elif layout == "2d":
        shift, scale = torch.randn(2, x_shape[0], D, device="cuda").unbind(0)
    elif layout == "frame":
        shift, scale = torch.randn(2, 1, 3, 1, D, device="cuda").unbind(0)
    else:
        shift, scale = torch.randn(2, *x_shape, device="cuda").unbind(0)
    dy = torch.randn_like(x)

    def grads(checkpointed: bool):
        ins = [t.detach().clone().requires_grad_() for t in (x, shift, scale)]

        def f(*a):
            return fused(*a) * 2.0

        y = torch.utils.checkpoint.checkpoint(f, *ins, use_reentrant=False) if checkpointed else f(*ins)
        return (y, *torch.autograd.grad(y, ins, dy))

    _impl._cfast.clear()
    want = grads(False)  # the checked path (and it remembers the signature)
    assert _impl._cfast.size() == 1
    monkeypatch.setattr(_impl, "_check_inputs", _must_not_run)
    for checkpointed in (False, True):
        got = grads(checkpointed)
        for a, b in zip(got, want):
            assert a.shape == b.shape and torch.equal(a, b), (layout, checkpointed)


def test_the_fast_paths_graph_node_behaves_as_autograd_expects(norm, monkeypatch):
    """The fast path builds its own graph node: freed graphs, retained graphs, in-place changes, no_grad."""
    fused = NORMS[norm][0]
    x, shift, scale, w, b = _make((2, 64, 512), (2, 1, 512), torch.bfloat16, torch.float32, affine=True)
    ins = [t.detach().clone().requires_grad_() for t in (x, shift, scale, w, b)]
    _impl._cfast.clear()
    fused(*ins)  # the checked path remembers the signature
    monkeypatch.setattr(_impl, "_check_inputs", _must_not_run)
    dy = torch.randn_like(x)
    y = fused(*ins)
    assert y.grad_fn is not None and "NormModulateBackward" in y.grad_fn.name()
    g1 = torch.autograd.grad(y, ins, dy, retain_graph=True)
    g2 = torch.autograd.grad(y, ins, dy)  # the retained graph gives the same gradients
    assert all(torch.equal(a, c) for a, c in zip(g1, g2))
    with pytest.raises(RuntimeError, match="second time"):
        torch.autograd.grad(y, ins, dy)
    # Only the inputs that require grad get an edge; the others get None.
    part = [ins[0], shift, scale, w, b]
    y = fused(*part)
    (dx,) = torch.autograd.grad(y, [ins[0]], dy)
    assert torch.equal(dx, g1[0])
    # x changed in place after the forward: the saved x is stale, and backward says so.
    xc = ins[0].detach().clone().requires_grad_()
    xi = xc * 1.0
    y = fused(xi, *ins[1:])
    xi.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)
    with torch.no_grad():
        assert fused(*ins).grad_fn is None
    assert not fused(*(t.detach() for t in ins)).requires_grad


def _must_not_run(*args, **kwargs):
    raise AssertionError("the checked path ran")


class _Tagged(torch.Tensor):
    """A tensor subclass (may mean something else to its owner): never served by the fast path."""


def test_the_fast_path_leaves_subclasses_modes_and_odd_arguments_to_the_checks(norm, monkeypatch):
    fused, reference = NORMS[norm]
    x, shift, scale, _, _ = _make((2, 64, 512), (2, 1, 512), torch.bfloat16, torch.float32, affine=False)
    _impl._cfast.clear()
    fused(x, shift, scale)  # remembered
    rms = norm == "rms"
    assert _impl._cfast.forward(rms, x, shift, scale, None, None, 1e-6) is not None
    # The other norm's signature is its own: the same shapes under the other op are not served.
    assert _impl._cfast.forward(not rms, x, shift, scale, None, None, 1e-6) is None
    calls = []

    def counting(*args, **kwargs):
        calls.append(1)

    monkeypatch.setattr(_impl, "_check_inputs", counting)
    # A subclass, a torch-function mode and a non-number eps: each goes through the checks.
    y_sub = fused(x.as_subclass(_Tagged), shift, scale)
    assert len(calls) == 1
    assert torch.equal(y_sub.as_subclass(torch.Tensor), fused(x, shift, scale))

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        fused(x, shift, scale)
    assert len(calls) == 2
    assert _impl._cfast.forward(rms, x, shift, scale, None, None, "1e-6") is None
    # Modulation on another device: the shapes match, the signature does not; the checks name it.
    monkeypatch.undo()
    with pytest.raises((RuntimeError, ValueError), match="shift"):
        fused(x, shift.cpu(), scale)
    # eps is passed on every call, not remembered with the signature.
    assert _rel(fused(x, shift, scale, eps=0.5), reference(x, shift, scale, eps=0.5)) < 1e-2


def test_rms_norm_modulate_matches_the_diffusers_form():
    """LTX-Video's block: RMSNorm without affine, then ``* (1 + scale) + shift`` (fp32 modulation)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the RMSNorm kernels need compute capability 9.0")
    x = torch.randn(2, 300, 2048, device="cuda").to(torch.bfloat16)
    table = torch.randn(2, 1, 6, 2048, device="cuda")
    shift, scale = table[:, :, 0], table[:, :, 1]
    xf = x.float()
    inline = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * (1 + scale) + shift
    y = rms_norm_modulate(x, shift, scale, eps=1e-6)
    assert _rel(y, inline) < 1e-2


def _launches() -> tuple[int, int]:
    return tuple(_impl._cfast.direct_launches())


def test_the_fast_path_launches_directly_where_the_dispatcher_adds_nothing(norm, monkeypatch):
    """csrc/norm_mod_direct.h: a plain call launches the kernels without the dispatcher, forward and
    backward, with the dispatcher's results; a dispatch mode, a profiler, a misaligned x or a double
    backward take the dispatcher, and still compute the same."""
    from torch.utils._python_dispatch import TorchDispatchMode

    fused = NORMS[norm][0]
    x, shift, scale, w, b = _make((2, 64, 512), (2, 1, 512), torch.bfloat16, torch.float32, affine=True)
    ins = [t.detach().clone().requires_grad_() for t in (x, shift, scale, w, b)]
    dy = torch.randn_like(x)
    _impl._cfast.clear()
    y_ref = fused(*ins)  # the checked path: through the dispatcher, and remembered
    g_ref = torch.autograd.grad(y_ref, ins, dy)
    f0, b0 = _launches()
    y = fused(*ins)
    g = torch.autograd.grad(y, ins, dy)
    assert _launches() == (f0 + 1, b0 + 1)
    assert torch.equal(y, y_ref) and all(torch.equal(a, c) for a, c in zip(g, g_ref))
    assert all(a.shape == t.shape and a.dtype == t.dtype for a, t in zip(g, ins))

    seen = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Mode():
        y_mode = fused(*ins)
    assert any("norm_modulate" in s for s in seen), seen
    assert _launches()[0] == f0 + 1 and torch.equal(y_mode, y_ref)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y_prof = fused(*ins)
    assert _launches()[0] == f0 + 1 and torch.equal(y_prof, y_ref)
    assert any("norm_modulate" in e.name for e in prof.events()), "the profiler must see the operator"

    # x at an address off the 16-byte grid (same shape and dtype: the same signature) takes the dispatcher.
    buf = torch.empty(x.numel() + 4, device="cuda", dtype=x.dtype)
    x_odd = buf[4:].view(x.shape)
    x_odd.copy_(x)
    assert x_odd.data_ptr() % 16 != 0
    y_odd = fused(x_odd, *ins[1:])
    assert _launches()[0] == f0 + 1 and torch.equal(y_odd, y_ref.detach())

    # A backward under grad mode (create_graph=True) goes through the dispatcher, where autograd sees the
    # backward operator; the direct backward is for create_graph=False only.
    y = fused(*ins)
    g1 = torch.autograd.grad(y, ins, dy, create_graph=True)
    assert _launches() == (f0 + 2, b0 + 1)
    assert all(torch.equal(a.detach(), c) for a, c in zip(g1, g_ref))

    # scale changed in place after the forward: its saved version is stale, and backward says so.
    sc = ins[2].detach().clone().requires_grad_()
    sc_i = sc * 1.0
    y = fused(ins[0], ins[1], sc_i, ins[3], ins[4])
    sc_i.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward(dy)


def test_direct_launches_of_strided_tables_and_autocast_agree(norm):
    """Strided (B, 1, D) chunks of a (B, 6, D) table launch directly, also under autocast."""
    fused = NORMS[norm][0]
    D = 1536
    x = torch.randn(2, 300, D, device="cuda").to(torch.bfloat16)
    table = torch.randn(2, 6, D, device="cuda")
    shift, scale = table[:, 1:2], table[:, 4:5]
    _impl._cfast.clear()
    y_ref = fused(x, shift, scale)
    f0, _ = _launches()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ac = fused(x, shift, scale)
    y = fused(x, shift, scale)
    assert _launches()[0] == f0 + 2
    assert torch.equal(y, y_ref) and torch.equal(y_ac, y_ref)
