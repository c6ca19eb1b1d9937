"""The numerical check of a fused forward against the original: a probe that can fail.

Before the first module of a class is fused, :func:`run_probe` compares the module's own forward with its
fused replacement, forward and gradients, on a **perturbed copy** of the module: every floating-point
parameter of a deep copy is moved by random noise (modulation linears and ``scale_shift_table``-like
tensors included), so that shift, scale and gate are all non-zero. Comparing at the model's own weights
proves nothing at adaLN-Zero initialisation, where the modulation is zero and every block is the identity:
a block that reads shift and scale the other way round, or drops a gate, looks right there. The comparison
runs twice, on an fp32 copy (tight tolerance: fusion changes rounding only) and on a bf16 copy (or the
module's own fp16/bf16), within that dtype's rounding. Errors are measured against the size of the block's
update (output - input), so that a wrong site cannot hide under the residual stream, and each gradient
against its own largest value.

The module itself is not touched (its RNG stream, weights and training flags stay as they were). The copy
costs one more set of the module's parameters and gradients, once per block class. The model-family
adapters draw their inputs with :func:`probe_device_dtype` and :func:`probe_randn`.
"""

from __future__ import annotations

import contextlib
import copy as _copy
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["ProbeResult", "perturb_parameters", "probe_device_dtype", "probe_randn", "run_probe"]

# (forward, gradients) relative error allowed between a module's own forward and its fused replacement on
# the perturbed copy, beyond two rounding steps per element. In fp32 the two agree to about 1e-6 (the
# fused site rounds once where the inline code rounds twice); a structural mismatch (a swapped chunk, a
# dropped gate or shift) moves the result by O(1). In bf16 the rounding of the norm's output, and its
# propagation through attention and FFN, moves the update by up to a few bf16 ulps.
_TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-9, 1e-8),
    torch.float32: (1e-4, 1e-3),
    torch.bfloat16: (6e-2, 1.5e-1),
    torch.float16: (3e-2, 1e-1),
}
# A gradient is measured against its own largest value, but never against less than this fraction of the
# largest gradient of the comparison: some gradients are zero in theory and rounding noise in practice (an
# attention's key bias: softmax ignores a shift shared by all keys), and noise against noise is no signal.
_GRAD_FLOOR = {torch.float64: 1e-4, torch.float32: 1e-2, torch.bfloat16: 2e-2, torch.float16: 2e-2}
# Names that mark a parameter as modulation (reported as such; all parameters are perturbed anyway).
_MODULATION_NAMES = ("scale_shift_table", "modulation", "adaln", "ada_ln")


@dataclass
class ProbeResult:
    """What one probe compared and found (kept in ``FusionReport.probes`` per block class).

    Attributes:
        status: ``"ok"``, ``"mismatch"`` (the class is skipped), ``"unverifiable"`` (fused unchecked, e.g.
            parameters on the meta device) or ``"unavailable"`` (the adapter has no probe).
        message: one line for the report.
        perturbed: how many parameter tensors of the copy were randomised.
        modulation: the names of those that are modulation parameters (adaLN linears, scale-shift tables).
        dtypes: the dtypes compared, in order.
        forward_error, grad_error: per dtype name, the largest relative error found.
        tolerance: per dtype name, the (forward, gradients) tolerance.
        notes: what was not compared, and why.
        anchored: per low-precision dtype name where the direct comparison exceeded its tolerance, the
            (forward, gradients) errors against the fp32 forward of the same weights: fused, then original.
    """

    status: str
    message: str = ""
    perturbed: int = 0
    modulation: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    forward_error: dict[str, float] = field(default_factory=dict)
    grad_error: dict[str, float] = field(default_factory=dict)
    tolerance: dict[str, tuple[float, float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    anchored: dict[str, tuple[float, float, float, float]] = field(default_factory=dict)

    @classmethod
    def coerce(cls, value: Any) -> ProbeResult:
        """A ProbeResult from what ``FusionAdapter.verify`` returned (a ProbeResult or ``(status, message)``)."""
        if isinstance(value, ProbeResult):
            return value
        status, message = value
        return cls(status=status, message=message)

    def describe_perturbation(self) -> str:
        shown = ", ".join(self.modulation[:3]) + (", ..." if len(self.modulation) > 3 else "")
        mod = f", {len(self.modulation)} of them modulation ({shown})" if self.modulation else ""
        return f"a perturbed copy ({self.perturbed} parameter tensors randomised{mod})"

    def describe_errors(self) -> str:
        parts = []
        for name in self.dtypes:
            if name not in self.forward_error:
                continue
            tf, tg = self.tolerance[name]
            parts.append(
                f"{name}: forward {self.forward_error[name]:.1e}, gradients {self.grad_error.get(name, 0.0):.1e} "
                f"(tolerance {tf:g} / {tg:g})"
            )
        return "; ".join(parts)


class _ProbeFailed(Exception):
    """A comparison that found the fused forward wrong."""


class _ProbeUnfit(Exception):
    """The probe's inputs do not fit the module (its own forward fails): no verdict."""


def _unverifiable_params(module: nn.Module) -> str | None:
    params = list(module.parameters()) + list(module.buffers())
    if any(p.is_meta for p in params):
        return "its parameters are on the meta device (deferred init)"
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch builds without distributed
        DTensor = ()  # noqa: N806
    if any(isinstance(p, DTensor) for p in params):
        return "its parameters are sharded (DTensor)"
    return None


def probe_device_dtype(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    """The device and compute dtype a probe for ``module`` is drawn on."""
    # The compute dtype is that of the floating-point weights; fp32 tables kept for precision (Wan's
    # scale_shift_table, _keep_in_fp32_modules) must not decide it, so take the most common one.
    dtypes = Counter(p.dtype for p in module.parameters() if p.is_floating_point())
    dtype = dtypes.most_common(1)[0][0] if dtypes else torch.float32
    # A module without parameters (a norm without affine weights, modulated by its inputs) is probed on CPU.
    tensors = list(module.parameters()) + list(module.buffers())
    return (tensors[0].device if tensors else torch.device("cpu")), dtype


def probe_randn(shape: Iterable[int], generator: torch.Generator, device: torch.device, dtype: torch.dtype):
    """Standard normal values drawn in fp32 with ``generator`` (the same on every dtype), cast to ``dtype``."""
    return torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32).to(dtype)


# --------------------------------------------------------------------------------------------------------
# The perturbed copy


def _is_modulation(param_name: str, owner: nn.Module, parent: nn.Module | None) -> bool:
    lowered = param_name.lower()
    if any(key in lowered for key in _MODULATION_NAMES):
        return True
    # The projection of diffusers' adaptive norms (AdaLayerNormZero.linear, CogVideoXLayerNormZero.linear,
    # AdaLayerNormContinuous.linear, ...): a Linear inside a module whose class is a kind of norm.
    return isinstance(owner, nn.Linear) and parent is not None and "Norm" in type(parent).__name__


@torch.no_grad()
def perturb_parameters(module: nn.Module, generator: torch.Generator) -> tuple[int, list[str]]:
    """Move every floating-point parameter of ``module`` by random noise, in place.

    Each tensor moves by normal noise with a standard deviation of half the larger of its own RMS and the
    scale of a default initialisation (1/sqrt(fan_in) for the weight of a Linear, convolution or embedding,
    1 for anything else: norm weights, biases, scale-shift tables). So a tensor that is zero (adaLN-Zero's
    modulation projection, a zero bias) moves as far as a freshly initialised one.

    Returns:
        ``(how many tensors moved, the names of the modulation parameters among them)``.
    """
    parents: dict[str, nn.Module] = {}
    modules = dict(module.named_modules())
    for name, sub in modules.items():
        for child_name, _ in sub.named_children():
            parents[f"{name}.{child_name}" if name else child_name] = sub
    moved, modulation = 0, []
    for mod_name, owner in modules.items():
        for p_name, p in owner.named_parameters(recurse=False):
            if not p.is_floating_point():
                continue
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            layer = (
                isinstance(owner, (nn.Linear, nn.modules.conv._ConvNd, nn.Embedding)) and p_name == "weight"
            )
            floor = (p.numel() // max(p.shape[0], 1)) ** -0.5 if layer and p.dim() >= 2 else 1.0
            rms = p.detach().float().square().mean().sqrt().item() if p.numel() else 0.0
            noise = torch.randn(p.shape, generator=generator, device=p.device, dtype=torch.float32)
            p.copy_((p.float() + noise * (0.5 * max(rms, floor))).to(p.dtype))
            moved += 1
            if _is_modulation(full, owner, parents.get(mod_name)):
                modulation.append(full)
    return moved, modulation


def _perturbed_copy(
    module: nn.Module, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, int, list]:
    clone = _copy.deepcopy(module)
    clone.to(dtype)
    clone.eval()  # dropout off, so both paths compute the same function
    for p in clone.parameters():
        if p.is_floating_point():
            p.requires_grad_(True)  # frozen weights too: their gradients must agree as well
    moved, modulation = perturb_parameters(clone, torch.Generator(device=device).manual_seed(0))
    return clone, moved, modulation


# --------------------------------------------------------------------------------------------------------
# One forward + backward


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output: a tensor, a tuple / list of them, or an output with ``.sample``."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for t in out if isinstance(t, torch.Tensor)]
    sample = getattr(out, "sample", None)
    return [sample] if isinstance(sample, torch.Tensor) else []


def _leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().clone().requires_grad_(True)
    return value


def _run(forward: Callable[..., Any], clone: nn.Module, args: tuple, kwargs: dict):
    """Outputs, the float inputs, and the gradients of (inputs, parameters) of one fixed random projection."""
    args = tuple(_leaf(a) for a in args)
    kwargs = {k: _leaf(v) for k, v in kwargs.items()}
    outs = _tensors(forward(clone, *args, **kwargs))
    inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    params = [p for p in clone.parameters() if p.requires_grad]
    floats = [o for o in outs if o.is_floating_point() and o.requires_grad]
    grads: list[torch.Tensor | None] = [None] * (len(inputs) + len(params))
    if floats:
        gen = torch.Generator(device=floats[0].device).manual_seed(1)  # the same projection for both paths
        loss = sum(
            (o.float() * torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32)).sum()
            for o in floats
        )
        grads = list(torch.autograd.grad(loss, inputs + params, allow_unused=True))
    return [o.detach() for o in outs], [i.detach() for i in inputs], grads


def _update_error(ref: torch.Tensor, out: torch.Tensor, inputs: list[torch.Tensor]) -> float:
    # Residual blocks return x + update, and x dominates the output: measure against the update, so that a
    # dropped gate or a swapped chunk cannot hide under x. The residual is the input of the output's shape
    # closest to it (a two-stream block returns both streams). Each element may also differ by two rounding
    # steps of its own magnitude (the fused path rounds once where the original rounds twice).
    ref32, out32 = ref.float(), out.float()
    same = [x.float() for x in inputs if x.shape == ref.shape]
    update = min((ref32 - x for x in same), key=lambda u: u.abs().max().item(), default=ref32)
    return _excess(ref32, out32, update.abs().max().item(), ref.dtype)


def _excess(ref32: torch.Tensor, out32: torch.Tensor, scale: float, dtype: torch.dtype) -> float:
    """The largest difference beyond two rounding steps of each element, relative to ``scale``."""
    if ref32.numel() == 0:
        return 0.0
    eps = torch.finfo(dtype).eps
    excess = ((out32 - ref32).abs() - 2 * eps * ref32.abs()).clamp_min(0).max().item()
    return excess / max(scale, eps * ref32.abs().max().item(), 1e-12)


def _compare(ref_run, out_run, names: list[str], dtype_name: str) -> tuple[float, float]:
    (ref_outs, inputs, ref_grads), (outs, _, grads) = ref_run, out_run
    if len(outs) != len(ref_outs):
        raise _ProbeFailed(f"the fused forward returns {len(outs)} tensors, the original {len(ref_outs)}")
    fwd = 0.0
    for i, (r, o) in enumerate(zip(ref_outs, outs)):
        if r.shape != o.shape or r.dtype != o.dtype:
            raise _ProbeFailed(
                f"output {i} of the fused forward is {tuple(o.shape)} {o.dtype}, the original's "
                f"{tuple(r.shape)} {r.dtype} ({dtype_name})"
            )
        if not r.is_floating_point():
            if not torch.equal(r, o):
                raise _ProbeFailed(f"output {i} differs ({dtype_name})")
            continue
        if torch.isfinite(r).all() and not torch.isfinite(o).all():
            raise _ProbeFailed(f"output {i} of the fused forward has NaN or inf where the original has none")
        fwd = max(fwd, _update_error(r, o, inputs))
    grad = 0.0
    present = [r.float().abs().max().item() for r in ref_grads if r is not None and r.numel()]
    largest = max(present, default=0.0)
    for name, r, o in zip(names, ref_grads, grads):
        if (r is None) != (o is None):
            which = "the fused forward" if o is None else "the original"
            raise _ProbeFailed(f"{which} gives no gradient to {name} ({dtype_name})")
        if r is None or not r.numel():
            continue
        r32 = r.float()
        scale = max(r32.abs().max().item(), _GRAD_FLOOR.get(r.dtype, 2e-2) * largest)
        grad = max(grad, _excess(r32, o.float(), scale, r.dtype))
    return fwd, grad


def _grad_names(clone: nn.Module, args: tuple, kwargs: dict) -> list[str]:
    names = [
        f"input {i}" for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()
    ]
    names += [
        f"input {k!r}" for k, a in kwargs.items() if isinstance(a, torch.Tensor) and a.is_floating_point()
    ]
    return names + [n for n, p in clone.named_parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------------------------
# The probe


def _dtypes_to_compare(module: nn.Module) -> list[torch.dtype]:
    _, own = probe_device_dtype(module)
    low = own if own in (torch.bfloat16, torch.float16) else torch.bfloat16
    return [torch.float32, low]


def run_probe(
    module: nn.Module,
    probe: Callable[[nn.Module, torch.Generator], list[tuple[tuple, dict]]],
    original: Callable[..., Any],
    fused: Callable[..., Any],
) -> ProbeResult:
    """Compare ``original(copy, ...)`` with ``fused(copy, ...)``, forward and gradients, on perturbed copies.

    ``probe(copy, generator)`` draws the inputs (on the copy's device and dtype, see
    :func:`probe_device_dtype`); each pair ``(args, kwargs)`` runs through both forwards on a deep copy of
    ``module`` whose parameters :func:`perturb_parameters` moved, first in fp32, then in bf16 (or the
    module's own fp16 / bf16). ``module`` itself is not changed.

    Returns:
        A :class:`ProbeResult`: ``"ok"``, ``"mismatch"`` (with what differs and by how much),
        ``"unverifiable"`` (meta or sharded parameters, no copy possible, or the probe's inputs do not fit
        the module's own forward in fp32).
    """
    why = _unverifiable_params(module)
    if why is not None:
        return ProbeResult("unverifiable", why)
    device, _ = probe_device_dtype(module)
    result = ProbeResult("ok")
    with torch.inference_mode(False), torch.enable_grad():
        for dtype in _dtypes_to_compare(module):
            name = str(dtype).replace("torch.", "")
            try:
                _probe_one_dtype(module, probe, original, fused, dtype, device, result)
            except _ProbeFailed as exc:
                return _mismatch(result, name, str(exc))
            except _ProbeUnfit as exc:
                if dtype == torch.float32:
                    return ProbeResult("unverifiable", str(exc))
                result.notes.append(f"{name}: not compared ({exc})")
                continue
            beyond = _beyond_tolerance(result, name)
            if beyond is not None:  # fp32 first: a structural error stops the probe there
                return _mismatch(result, name, beyond)
    notes = f" ({'; '.join(result.notes)})" if result.notes else ""
    result.message = (
        f"matches the original forward and gradients on {result.describe_perturbation()}: "
        f"{result.describe_errors()}{notes}"
    )
    return result


@contextlib.contextmanager
def _full_fp32(device: torch.device):
    """fp32 matmuls and convolutions without TF32 on CUDA while the fp32 comparison runs (restored after).

    With TF32 on, a rounding difference of 1e-7 before a matmul can flip its TF32 rounding and move the
    result by 1e-4: the fp32 comparison would measure TF32, not the fused op.
    """
    if device.type != "cuda":
        yield
        return
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.set_float32_matmul_precision("highest")
        torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.set_float32_matmul_precision(matmul)
            torch.backends.cudnn.allow_tf32 = cudnn


def _probe_one_dtype(module, probe, original, fused, dtype, device, result: ProbeResult) -> None:
    if dtype == torch.float32:
        with _full_fp32(device):
            return _probe_in(module, probe, original, fused, dtype, device, result)
    return _probe_in(module, probe, original, fused, dtype, device, result)


def _probe_in(module, probe, original, fused, dtype, device, result: ProbeResult) -> None:
    name = str(dtype).replace("torch.", "")
    try:
        clone, moved, modulation = _perturbed_copy(module, dtype, device)
    except Exception as exc:  # noqa: BLE001 - a module that cannot be copied: no verdict
        raise _ProbeUnfit(f"the module could not be copied ({type(exc).__name__}: {exc})") from exc
    result.perturbed, result.modulation = moved, modulation
    result.dtypes.append(name)
    result.tolerance[name] = _TOLERANCE.get(dtype, (1e-3, 1e-3))
    generator = torch.Generator(device=device).manual_seed(0)
    cases = probe(clone, generator)
    if not cases:
        raise _ProbeUnfit("the adapter's probe drew no inputs")
    fwd = grad = 0.0
    for args, kwargs in cases:
        try:
            ref = _run(original, clone, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the probe does not fit this module: no verdict
            raise _ProbeUnfit(f"its own forward failed on the probe ({type(exc).__name__}: {exc})") from exc
        if not ref[0]:
            raise _ProbeUnfit("its forward does not return a tensor")
        try:
            out = _run(fused, clone, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - the fused path fails where the original runs
            raise _ProbeFailed(f"the fused forward failed on the probe: {type(exc).__name__}: {exc}") from exc
        names = _grad_names(clone, args, kwargs)
        f, g = _compare(ref, out, names, name)
        fwd, grad = max(fwd, f), max(grad, g)
        tf, tg = result.tolerance[name]
        if dtype != torch.float32 and (f > tf or g > tg):
            _anchor(result, name, clone, original, args, kwargs, ref, out, names, device)
    result.forward_error[name], result.grad_error[name] = fwd, grad


def _as_fp32(run):
    outs, inputs, grads = run
    up = [o.float() if o.is_floating_point() else o for o in outs]
    return up, [i.float() for i in inputs], [None if g is None else g.float() for g in grads]


def _anchor(result: ProbeResult, name, clone, original, args, kwargs, ref, out, names, device) -> None:
    """Both low-precision runs against the original's fp32 forward of the same weights and inputs.

    Why: where the original itself is far from its fp32 result in bf16 (a long chain of rounding after
    the norm: Sana's linear attention at full width), the fused and original bf16 runs differ by as much,
    and a direct comparison cannot tell rounding from a wrong fused forward. The fp32 stage has checked
    the structure; this one asks that the fused run be no further from fp32 than twice the original's
    own distance (plus the tolerance).
    """
    try:
        clone32 = _copy.deepcopy(clone).float()
        for p in clone32.parameters():
            if p.is_floating_point():
                p.requires_grad_(True)
        up = lambda v: v.detach().float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v  # noqa: E731
        with _full_fp32(device):
            ref32 = _run(original, clone32, tuple(up(a) for a in args), {k: up(v) for k, v in kwargs.items()})
        ff, fg = _compare(ref32, _as_fp32(out), names, "float32")
        of, og = _compare(ref32, _as_fp32(ref), names, "float32")
    except Exception as exc:  # noqa: BLE001 - no anchored verdict: the direct one stands
        result.notes.append(f"{name}: not compared against fp32 ({type(exc).__name__}: {exc})")
        return
    old = result.anchored.get(name, (0.0, 0.0, 0.0, 0.0))
    result.anchored[name] = (max(old[0], ff), max(old[1], fg), max(old[2], of), max(old[3], og))


def _beyond_tolerance(result: ProbeResult, name: str) -> str | None:
    tf, tg = result.tolerance[name]
    fwd, grad = result.forward_error[name], result.grad_error[name]
    if fwd <= tf and grad <= tg:
        return None
    anchored = result.anchored.get(name)
    if anchored is not None:
        ff, fg, of, og = anchored
        if ff <= 2 * of + tf and fg <= 2 * og + tg:
            result.notes.append(
                f"{name}: the two runs differ by {fwd:.2g} / {grad:.2g} (forward / gradients), as far as the "
                f"original itself is from its fp32 forward: fused {ff:.2g} / {fg:.2g}, original "
                f"{of:.2g} / {og:.2g} from fp32 (allowed: twice the original's, plus the tolerance)"
            )
            return None
        return (
            f"the fused forward is further from the fp32 forward than the original in {name}: "
            f"{ff:.3g} / {fg:.3g} (forward / gradients) against the original's {of:.3g} / {og:.3g} "
            f"(allowed: twice the original's, plus {tf:g} / {tg:g})"
        )
    what = "forward" if fwd / tf >= grad / tg else "gradients"
    err, tol = (fwd, tf) if what == "forward" else (grad, tg)
    relative = "the block's update" if what == "forward" else "each gradient's largest value"
    return (
        f"the fused forward differs from the original by {err:.3g} in its {what} (relative to {relative}; "
        f"{tol:g} allowed in {name})"
    )


def _mismatch(result: ProbeResult, dtype_name: str, what: str) -> ProbeResult:
    result.status = "mismatch"
    result.message = f"{what}, on {result.describe_perturbation()} in {dtype_name}"
    return result
