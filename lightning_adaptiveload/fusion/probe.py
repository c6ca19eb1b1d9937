"""The numerical check of a fused forward against the original, on a small random probe.

Before the first module of a class is fused, :func:`run_probe` runs the block's own forward and its fused
replacement on inputs an adapter draws, and compares the block's update (output - input) within a
tolerance per dtype. The model-family adapters draw their inputs with :func:`probe_device_dtype` and
:func:`probe_randn`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["probe_device_dtype", "probe_randn", "run_probe"]

# Relative error allowed between a block's own forward and its fused replacement on the verification probe,
# measured against the size of the block's update (output - input), beyond two rounding steps per element
# (see _relative_update_error). Fusion changes rounding only: in fp32 the two agree to ~1e-6; in bf16 the
# fused path rounds once where the original rounds twice, which moves the update by about a bf16 ulp
# (measured: under 1e-2). A structural mismatch (a missing gate, a swapped chunk) moves it by O(1).
_PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 6e-2, torch.float16: 3e-2}


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    sample = getattr(out, "sample", None)
    return sample if isinstance(sample, torch.Tensor) else None


def _unverifiable_params(module: nn.Module) -> str | None:
    params = list(module.parameters()) + list(module.buffers())
    if not params:
        return "it has no parameters to take a device and dtype from"
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
    device = next(iter(list(module.parameters()) + list(module.buffers()))).device
    return device, dtype


def run_probe(
    module: nn.Module,
    probe: Callable[[nn.Module, torch.Generator], list[tuple[tuple, dict]]],
    original: Callable[..., Any],
    fused: Callable[..., Any],
) -> tuple[str, str]:
    """Compare ``original(module, ...)`` with ``fused(module, ...)`` on the inputs ``probe`` draws.

    Returns:
        ``(status, message)`` as :meth:`FusionAdapter.verify <lightning_adaptiveload.fusion.adapter.
        FusionAdapter.verify>` describes it.
    """
    why = _unverifiable_params(module)
    if why is not None:
        return "unverifiable", why
    device, _ = probe_device_dtype(module)
    # A private generator: the probe must not shift the global RNG stream (seeded runs stay reproducible).
    generator = torch.Generator(device=device).manual_seed(0)
    training = {m: m.training for m in module.modules()}
    module.eval()  # dropout off, so both paths compute the same function
    worst, worst_tol, worst_dtype = 0.0, 1.0, None
    try:
        with torch.no_grad():
            for args, kwargs in probe(module, generator):
                try:
                    ref = _first_tensor(original(module, *args, **kwargs))
                except Exception as exc:  # noqa: BLE001 - the probe does not fit this module: no verdict
                    return (
                        "unverifiable",
                        f"its own forward failed on the probe ({type(exc).__name__}: {exc})",
                    )
                out = _first_tensor(fused(module, *args, **kwargs))
                if ref is None or out is None:
                    return "unverifiable", "its forward does not return a tensor"
                if ref.shape != out.shape or ref.dtype != out.dtype:
                    return "mismatch", (
                        f"the fused output is {tuple(out.shape)} {out.dtype}, the original "
                        f"{tuple(ref.shape)} {ref.dtype}"
                    )
                if not torch.isfinite(out).all() and torch.isfinite(ref).all():
                    return "mismatch", "the fused output has NaN or inf where the original has none"
                err = _relative_update_error(ref, out, args[0] if args else None)
                tol = _PROBE_TOLERANCE.get(ref.dtype, 1e-3)
                if err / tol > worst / worst_tol:
                    worst, worst_tol, worst_dtype = err, tol, ref.dtype
    except Exception as exc:  # noqa: BLE001 - the fused path fails where the original runs: skip
        return "mismatch", f"the fused forward failed on the probe: {type(exc).__name__}: {exc}"
    finally:
        for m, flag in training.items():
            m.training = flag
    if worst > worst_tol:
        return "mismatch", (
            f"the fused forward differs from the original by {worst:.3g} (relative to the block's update; "
            f"{worst_tol:g} allowed in {worst_dtype}) on a random probe"
        )
    return "ok", f"{worst:.2g}"


def _relative_update_error(ref: torch.Tensor, out: torch.Tensor, x: Any) -> float:
    # Residual blocks return x + update, and x dominates the output: measure against the update, so that a
    # dropped gate or a swapped chunk cannot hide under x. Each element may also differ by two rounding
    # steps of its own magnitude (the fused path rounds once where the original rounds twice, and a
    # low-precision output can land on the neighbouring value); without that slack one flipped bf16 ulp
    # of a large x would count as a large error whenever the update is small.
    ref32, out32 = ref.float(), out.float()
    update = ref32 - x.float() if isinstance(x, torch.Tensor) and x.shape == ref.shape else ref32
    eps = torch.finfo(ref.dtype).eps if ref.is_floating_point() else 0.0
    excess = ((out32 - ref32).abs() - 2 * eps * ref32.abs()).clamp_min(0).max().item()
    scale = max(update.abs().max().item(), eps * ref32.abs().max().item(), 1e-12)
    return excess / scale


def probe_randn(shape: Iterable[int], generator: torch.Generator, device: torch.device, dtype: torch.dtype):
    """Standard normal values drawn in fp32 with ``generator`` (the same on every dtype), cast to ``dtype``."""
    return torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32).to(dtype)
