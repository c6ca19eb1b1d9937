"""Swap a DiT's LayerNorm + adaLN modulation sites for the fused ``layer_norm_modulate`` op.

A *site* is ``LN(x) * (1 + scale) + shift`` written inline in a block's forward. Adapters know how to route
the sites of one kind of block through :func:`lightning_adaptiveload.ops.layer_norm_modulate`, either by
replacing the block's ``forward`` on the instance (nothing else changes: no parameter moves, so
``state_dict`` keys and values are untouched and checkpoints load either way) or by flipping a switch the
block already has. Everything is reversible with :func:`unfuse_norm_modulate`.

Built-in adapters:

- ``NormModulate`` of :mod:`lightning_adaptiveload.models.video_dit`: sets its ``fused`` flag.
- diffusers ``WanTransformerBlock`` (Wan 2.1 per-sample modulation, ``temb`` (B, 6, D); Wan 2.2 TI2V
  per-token modulation, ``temb`` (B, S, 6, D)): norm1 and norm3.
- facebookresearch/DiT-style ``DiTBlock`` (``norm1``, ``attn``, ``norm2``, ``mlp``, ``adaLN_modulation``
  with 6 chunks) and ``FinalLayer`` (``norm_final``, ``linear``, ``adaLN_modulation`` with 2 chunks),
  recognised by structure, whatever the class is called.

Users add their own with :func:`register_fusion_adapter`; see ``docs/fusion.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_adaptiveload import ops as _ops

__all__ = [
    "FusedNormModulateMixin",
    "FusionAdapter",
    "FusionError",
    "FusionReport",
    "ReplaceForward",
    "SkippedModule",
    "fuse_norm_modulate",
    "register_fusion_adapter",
    "unfuse_norm_modulate",
    "unregister_fusion_adapter",
]

# Attribute stored on every module this file changed: what to undo. A plain attribute, so it never enters
# state_dict, and deepcopy / pickle carry it along with the patched forward.
_RECORD_ATTR = "_adaptiveload_fusion"

# Relative error allowed between a block's own forward and its fused replacement on the verification probe,
# measured against the size of the block's update (output - input), beyond two rounding steps per element
# (see _relative_update_error). Fusion changes rounding only: in fp32 the two agree to ~1e-6; in bf16 the
# fused path rounds once where the original rounds twice, which moves the update by about a bf16 ulp
# (measured: under 1e-2). A structural mismatch (a missing gate, a swapped chunk) moves it by O(1).
_PROBE_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 6e-2, torch.float16: 3e-2}


class FusionError(ValueError):
    """Raised when fusion finds no site to swap (and that was not allowed) or is asked something invalid."""


# --------------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------------


@dataclass
class SkippedModule:
    """A module an adapter recognised but did not change.

    Attributes:
        name: qualified module name inside the model passed in (``""`` for the model itself).
        cls: the module's class name.
        reason: why it was not changed, and what to do about it.
    """

    name: str
    cls: str
    reason: str


@dataclass
class FusionReport:
    """What :func:`fuse_norm_modulate` or :func:`unfuse_norm_modulate` did. ``str(report)`` is a summary.

    All counts are keyed by the class name of the module that was changed (the block, not the LayerNorm).

    Attributes:
        action: ``"fuse"`` or ``"unfuse"``.
        model: class name of the module passed in.
        sites: norm + modulate sites changed by this call, per class.
        modules: modules changed by this call, per class.
        adapters: the adapter used for each class.
        checks: for each class changed, the outcome of the numerical check against the original forward
            (``verify=True``): ``"matches the original forward (...)"``, ``"not checked: <why>"`` or
            ``"no probe"``.
        already_fused: modules that were fused before this call (by an earlier call, or built fused), per
            class; they count as found. For ``unfuse``: modules built fused, which are left as they are.
        skipped: modules recognised but not changed, with the reason.
        unrecognized: classes that hold a LayerNorm, with no recognised module inside, that no adapter
            recognised (left as they are), with how many modules of each.
    """

    action: str
    model: str
    sites: dict[str, int] = field(default_factory=dict)
    modules: dict[str, int] = field(default_factory=dict)
    adapters: dict[str, str] = field(default_factory=dict)
    checks: dict[str, str] = field(default_factory=dict)
    already_fused: dict[str, int] = field(default_factory=dict)
    skipped: list[SkippedModule] = field(default_factory=list)
    unrecognized: dict[str, int] = field(default_factory=dict)

    @property
    def num_sites(self) -> int:
        """Sites changed by this call."""
        return sum(self.sites.values())

    @property
    def num_modules(self) -> int:
        """Modules changed by this call."""
        return sum(self.modules.values())

    @property
    def found(self) -> bool:
        """Whether any site is fused now (changed by this call or fused already)."""
        return self.num_modules > 0 or sum(self.already_fused.values()) > 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy."""
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        verb = "now use" if self.action == "fuse" else "restored from"
        lines = [
            f"{self.action}_norm_modulate({self.model}): {self.num_sites} norm+modulate site(s) in "
            f"{self.num_modules} module(s) {verb} layer_norm_modulate"
        ]
        for cls, n in self.modules.items():
            detail = f"adapter: {self.adapters.get(cls, '?')}"
            if cls in self.checks:
                detail += f"; probe: {self.checks[cls]}"
            lines.append(f"  {cls}: {n} module(s), {self.sites.get(cls, 0)} site(s) [{detail}]")
        if self.already_fused:
            what = "already fused" if self.action == "fuse" else "built fused, left as they are"
            lines.append(f"  {what}: " + ", ".join(f"{c} x{n}" for c, n in self.already_fused.items()))
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)} module(s):")
            for s in self.skipped:
                lines.append(f"    {s.name or '(model)'} ({s.cls}): {s.reason}")
        if self.unrecognized:
            lines.append(
                "  not recognised, left as they are (register an adapter to fuse them): "
                + ", ".join(f"{c} x{n}" for c, n in self.unrecognized.items())
            )
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------------------


class FusionAdapter:
    """How to fuse (and unfuse) the norm + modulate sites of one kind of module.

    Subclass it for blocks that need more than a forward replacement (e.g. a switch the block already has);
    for the common case use :class:`ReplaceForward`, or pass a plain function to
    :func:`register_fusion_adapter`.

    Attributes:
        name: shown in the report.
        owns_subtree: when True (the default), the modules inside a matched module are not visited: the
            adapter is responsible for all of them.
    """

    name: str = "custom"
    owns_subtree: bool = True

    def sites(self, module: nn.Module) -> int:
        """Number of norm + modulate sites one module has (for the report)."""
        return 1

    def check(self, module: nn.Module) -> str | None:
        """Return why ``module`` cannot be fused (shown in the report), or None when it can."""
        return None

    def is_fused(self, module: nn.Module) -> bool:
        """Whether ``module`` already uses the fused op without this adapter having changed it."""
        return False

    def verify(self, module: nn.Module) -> tuple[str, str]:
        """Compare the fused and the original computation on a small probe, before fusing.

        Returns:
            ``(status, message)`` with status ``"ok"``, ``"mismatch"`` (the message says by how much; the
            module is skipped), ``"unverifiable"`` (e.g. parameters on the meta device; fused anyway, the
            message goes to ``report.checks``) or ``"unavailable"`` (this adapter has no probe).
        """
        return "unavailable", ""

    def fuse(self, module: nn.Module) -> Any:
        """Route ``module``'s sites through ``layer_norm_modulate``; return what :meth:`unfuse` needs."""
        raise NotImplementedError

    def unfuse(self, module: nn.Module, state: Any) -> str | None:
        """Undo :meth:`fuse`. Return None when restored, else why it could not be (the module is left fused)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _class_forward(module: nn.Module) -> Any:
    # The forward the class defines (instance attributes ignored). FSDP2 swaps a module's class for a
    # generated subclass that does not override forward, so this still resolves to the original function.
    return type(module).forward


def _describe(obj: Any) -> str:
    func = getattr(obj, "func", obj)
    return getattr(func, "__qualname__", None) or type(obj).__qualname__


class _FusedForward(functools.partial):
    """``partial(fused_forward, module)`` with a short repr (a plain partial prints the whole module).

    A partial rather than a bound method: it pickles by reference to the function (a bound method pickles
    as ``getattr(module, "forward")``, which resolves to the class forward while the module is being
    rebuilt), and torch.compile traces partials without graph breaks.
    """

    def __repr__(self) -> str:
        return f"<fused forward {_describe(self.func)} of {type(self.args[0]).__name__}>"


class ReplaceForward(FusionAdapter):
    """Fuse by replacing ``forward`` on the module instance; unfuse by removing that replacement.

    No parameter or buffer is touched, so ``state_dict`` is identical either way. The replacement is a
    :func:`functools.partial` of ``forward`` bound to the module, so ``copy.deepcopy`` and ``pickle`` work,
    and ``torch.compile`` traces it like any forward.

    Args:
        forward: ``forward(module, *args, **kwargs)``, the fused version of the module's forward. It must
            compute exactly what the original computes, with its norm + modulate sites going through
            :func:`lightning_adaptiveload.ops.layer_norm_modulate`.
        name: shown in the report; defaults to the function's name.
        sites: sites per module (an int or ``sites(module) -> int``), for the report.
        check: optional ``check(module) -> str | None``: why a module cannot be fused, or None.
        probe: optional ``probe(module, generator) -> list[(args, kwargs)]``: small inputs on the module's
            device and dtype (drawn with ``generator``) on which the original and the fused forward are
            compared before the first module of each class is fused; a module whose outputs differ beyond
            rounding is skipped with the error in the report.
        expected_forward: the class forward ``forward`` was written for. A module whose class resolves
            ``forward`` to another function (a subclass that overrides it) is skipped, because the
            replacement would silently drop the subclass's changes. Set for class targets by
            :func:`register_fusion_adapter`.
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        *,
        name: str | None = None,
        sites: int | Callable[[nn.Module], int] = 1,
        check: Callable[[nn.Module], str | None] | None = None,
        probe: Callable[[nn.Module, torch.Generator], list[tuple[tuple, dict]]] | None = None,
        expected_forward: Callable[..., Any] | None = None,
    ) -> None:
        if not callable(forward):
            raise TypeError(f"ReplaceForward: forward must be callable, got {forward!r}")
        self.forward = forward
        self.name = name or getattr(forward, "__name__", "replace_forward")
        self._sites = sites
        self._check = check
        self._probe = probe
        self.expected_forward = expected_forward

    def sites(self, module: nn.Module) -> int:
        return self._sites(module) if callable(self._sites) else int(self._sites)

    def check(self, module: nn.Module) -> str | None:
        patched = module.__dict__.get("forward")
        if patched is not None:
            return (
                f"forward is already replaced on this instance (by {_describe(patched)}), e.g. by a diffusers "
                "hook, accelerate or another patch; replacing it would drop that wrapper. Fuse before adding "
                "hooks that patch forward."
            )
        if self.expected_forward is not None and _class_forward(module) is not self.expected_forward:
            return (
                f"{type(module).__qualname__} overrides forward ({_describe(_class_forward(module))}), but the "
                f"fused forward was written for {_describe(self.expected_forward)}; register an adapter for "
                f"{type(module).__qualname__} itself"
            )
        return self._check(module) if self._check is not None else None

    def verify(self, module: nn.Module) -> tuple[str, str]:
        if self._probe is None:
            return "unavailable", ""
        return _run_probe(module, self._probe, _class_forward(module), self.forward)

    def fuse(self, module: nn.Module) -> Any:
        module.forward = _FusedForward(self.forward, module)
        return None

    def _is_ours(self, module: nn.Module, patched: Any) -> bool:
        return (
            isinstance(patched, _FusedForward)
            and patched.func is self.forward
            and len(patched.args) == 1
            and patched.args[0] is module
        )

    def unfuse(self, module: nn.Module, state: Any) -> str | None:
        patched = module.__dict__.get("forward")
        if not self._is_ours(module, patched):
            return (
                f"forward was replaced again after fusing (now {_describe(patched)}); remove that wrapper "
                "first, then unfuse"
            )
        del module.__dict__["forward"]
        return None


class _FlagAdapter(FusionAdapter):
    """Fuse a module that already has a boolean switch (``NormModulate.fused``) by setting it."""

    def __init__(self, attr: str, name: str) -> None:
        self.attr = attr
        self.name = name

    def check(self, module: nn.Module) -> str | None:
        value = getattr(module, self.attr, None)
        if not isinstance(value, bool):
            return (
                f"expected a bool attribute {self.attr!r} (the models/video_dit.py NormModulate contract), "
                f"found {value!r}; the reference model changed, update the adapter in fusion.py"
            )
        return None

    def is_fused(self, module: nn.Module) -> bool:
        return getattr(module, self.attr) is True

    def fuse(self, module: nn.Module) -> Any:
        previous = getattr(module, self.attr)
        setattr(module, self.attr, True)
        return previous

    def unfuse(self, module: nn.Module, state: Any) -> str | None:
        setattr(module, self.attr, state)
        return None


class _NoteAdapter(FusionAdapter):
    """Recognises a site it deliberately leaves alone, so the report says so; visits the children."""

    owns_subtree = False

    def __init__(self, name: str, reason: Callable[[nn.Module], str | None]) -> None:
        self.name = name
        self._reason = reason

    def check(self, module: nn.Module) -> str | None:
        return self._reason(module)

    def fuse(self, module: nn.Module) -> Any:  # pragma: no cover - check() always refuses
        raise FusionError(f"{self.name} never fuses")

    def unfuse(self, module: nn.Module, state: Any) -> str | None:  # pragma: no cover
        return None


# --------------------------------------------------------------------------------------------------------
# Verification probe
# --------------------------------------------------------------------------------------------------------


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


def _probe_device_dtype(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    # The compute dtype is that of the floating-point weights; fp32 tables kept for precision (Wan's
    # scale_shift_table, _keep_in_fp32_modules) must not decide it, so take the most common one.
    dtypes = Counter(p.dtype for p in module.parameters() if p.is_floating_point())
    dtype = dtypes.most_common(1)[0][0] if dtypes else torch.float32
    device = next(iter(list(module.parameters()) + list(module.buffers()))).device
    return device, dtype


def _run_probe(
    module: nn.Module,
    probe: Callable[[nn.Module, torch.Generator], list[tuple[tuple, dict]]],
    original: Callable[..., Any],
    fused: Callable[..., Any],
) -> tuple[str, str]:
    why = _unverifiable_params(module)
    if why is not None:
        return "unverifiable", why
    device, _ = _probe_device_dtype(module)
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


def _randn(shape: Iterable[int], generator: torch.Generator, device: torch.device, dtype: torch.dtype):
    return torch.randn(tuple(shape), generator=generator, device=device, dtype=torch.float32).to(dtype)


# --------------------------------------------------------------------------------------------------------
# Built-in adapter: facebookresearch/DiT-style blocks (recognised by structure)
# --------------------------------------------------------------------------------------------------------

_DIT_BLOCK_CHILDREN = frozenset({"norm1", "attn", "norm2", "mlp", "adaLN_modulation"})
_DIT_FINAL_CHILDREN = frozenset({"norm_final", "linear", "adaLN_modulation"})


def _children_names(module: nn.Module) -> frozenset[str]:
    return frozenset(name for name, _ in module.named_children())


def _ln_args(norm: nn.LayerNorm) -> dict[str, Any]:
    return {"weight": norm.weight, "bias": norm.bias, "eps": norm.eps}


def _adaln_check(module: nn.Module, norms: tuple[str, ...], chunks: int, uses: tuple[str, ...]) -> str | None:
    dims = set()
    for n in norms:
        norm = getattr(module, n)
        if not isinstance(norm, nn.LayerNorm) or len(norm.normalized_shape) != 1:
            return f"{n} is {type(norm).__name__}, expected an nn.LayerNorm over the last dimension"
        dims.add(norm.normalized_shape[0])
    if len(dims) != 1:
        return f"{' and '.join(norms)} normalise different widths {sorted(dims)}"
    dim = dims.pop()
    ada = module.adaLN_modulation
    last = ada[-1] if isinstance(ada, nn.Sequential) and len(ada) else ada
    if not isinstance(last, nn.Linear) or last.out_features != chunks * dim:
        return (
            f"adaLN_modulation should end in nn.Linear(..., {chunks} * {dim}) producing {chunks} chunks, "
            f"found {type(last).__name__}"
            + (f" with out_features={last.out_features}" if isinstance(last, nn.Linear) else "")
        )
    forward = _class_forward(module)
    params = list(inspect.signature(forward).parameters)[1:]
    if params != ["x", "c"]:
        return f"forward takes ({', '.join(params)}), the DiT structure takes (x, c)"
    code = getattr(forward, "__code__", None)
    if code is not None:
        missing = [n for n in uses + ("adaLN_modulation", "chunk") if n not in code.co_names]
        if missing:
            return f"forward does not use {missing}, so it is not the DiT adaLN structure"
    return None


def _dit_block_check(block: nn.Module) -> str | None:
    return _adaln_check(block, ("norm1", "norm2"), 6, ("norm1", "norm2", "attn", "mlp"))


def _dit_final_check(layer: nn.Module) -> str | None:
    return _adaln_check(layer, ("norm_final",), 2, ("norm_final", "linear"))


def _dit_block_forward_fused(block: nn.Module, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """DiTBlock.forward with both norm + modulate sites fused. x (B, S, D); c (B, D_c)."""
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.adaLN_modulation(c).chunk(6, dim=1)
    h = _ops.layer_norm_modulate(x, shift_msa.unsqueeze(1), scale_msa.unsqueeze(1), **_ln_args(block.norm1))
    x = x + gate_msa.unsqueeze(1) * block.attn(h)
    h = _ops.layer_norm_modulate(x, shift_mlp.unsqueeze(1), scale_mlp.unsqueeze(1), **_ln_args(block.norm2))
    return x + gate_mlp.unsqueeze(1) * block.mlp(h)


def _dit_final_forward_fused(layer: nn.Module, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """DiT FinalLayer.forward with its norm + modulate site fused. x (B, S, D); c (B, D_c)."""
    shift, scale = layer.adaLN_modulation(c).chunk(2, dim=1)
    h = _ops.layer_norm_modulate(x, shift.unsqueeze(1), scale.unsqueeze(1), **_ln_args(layer.norm_final))
    return layer.linear(h)


def _dit_probe(module: nn.Module, generator: torch.Generator) -> list[tuple[tuple, dict]]:
    device, dtype = _probe_device_dtype(module)
    norm = module.norm1 if hasattr(module, "norm1") else module.norm_final
    ada = module.adaLN_modulation
    last = ada[-1] if isinstance(ada, nn.Sequential) else ada
    first = next((m for m in ada.modules() if isinstance(m, nn.Linear)), last)
    dim, cond_dim = norm.normalized_shape[0], first.in_features
    x = _randn((2, 5, dim), generator, device, dtype)
    c = _randn((2, cond_dim), generator, device, dtype)
    return [((x, c), {})]


# --------------------------------------------------------------------------------------------------------
# Built-in adapter: diffusers WanTransformerBlock
# --------------------------------------------------------------------------------------------------------

_WAN_MODULE = "diffusers.models.transformers.transformer_wan"
_WAN_BLOCK_ATTRS = ("norm1", "norm2", "norm3", "attn1", "attn2", "ffn", "scale_shift_table")
_WAN_FORWARD_PARAMS = ["hidden_states", "encoder_hidden_states", "temb", "rotary_emb"]


def _diffusers_version() -> str:
    module = sys.modules.get("diffusers")
    return getattr(module, "__version__", "unknown")


def _wan_block_check(block: nn.Module) -> str | None:
    drift = f"diffusers {_diffusers_version()}: "
    missing = [a for a in _WAN_BLOCK_ATTRS if not hasattr(block, a)]
    if missing:
        return drift + f"WanTransformerBlock has no {missing}; the fused forward does not fit this version"
    table = block.scale_shift_table
    if not (isinstance(table, torch.Tensor) and table.dim() == 3 and tuple(table.shape[:2]) == (1, 6)):
        shape = tuple(table.shape) if isinstance(table, torch.Tensor) else type(table).__name__
        return drift + f"scale_shift_table is {shape}, expected (1, 6, D)"
    dim = table.shape[-1]
    for name in ("norm1", "norm3"):
        norm = getattr(block, name)
        if not isinstance(norm, nn.LayerNorm) or tuple(norm.normalized_shape) != (dim,):
            return drift + f"{name} is {type(norm).__name__}, expected a LayerNorm over D={dim}"
    params = list(inspect.signature(_class_forward(block)).parameters)[1:]
    if params != _WAN_FORWARD_PARAMS:
        return drift + f"forward takes ({', '.join(params)}), expected ({', '.join(_WAN_FORWARD_PARAMS)})"
    return None


def _wan_block_forward_fused(
    block: nn.Module,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: Any,
) -> torch.Tensor:
    """WanTransformerBlock.forward with the norm1 and norm3 sites fused.

    Everything else is as diffusers computes it: modulation vectors in fp32 (table + temb), the attention
    processors, rotary embedding, the cross-attention norm2, the fp32 gated residuals and the casts back.

    Args:
        hidden_states: (B, S, D), the block's dtype.
        encoder_hidden_states: (B, L, D) text (and image) states.
        temb: (B, 6, D) per-sample modulation (Wan 2.1, Wan 2.2 14B) or (B, S, 6, D) per-token (Wan 2.2
            TI2V); any float dtype, used in fp32.
        rotary_emb: (cos, sin), each (1, S, 1, head_dim), as the model passes it.
    """
    table = block.scale_shift_table
    if temb.ndim == 4:
        # Per token: each chunk is (B, S, 1, D) -> (B, S, D), the op's per-token layout.
        mods = [m.squeeze(2) for m in (table.unsqueeze(0) + temb.float()).chunk(6, dim=2)]
    else:
        # Per sample: each chunk is (B, 1, D).
        mods = (table + temb.float()).chunk(6, dim=1)
    shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mods

    norm_hidden_states = _ops.layer_norm_modulate(
        hidden_states, shift_msa, scale_msa, **_ln_args(block.norm1)
    )
    attn_output = block.attn1(norm_hidden_states, None, None, rotary_emb)
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)

    norm_hidden_states = block.norm2(hidden_states.float()).type_as(hidden_states)
    attn_output = block.attn2(norm_hidden_states, encoder_hidden_states, None, None)
    hidden_states = hidden_states + attn_output

    norm_hidden_states = _ops.layer_norm_modulate(
        hidden_states, c_shift_msa, c_scale_msa, **_ln_args(block.norm3)
    )
    ff_output = block.ffn(norm_hidden_states)
    return (hidden_states.float() + ff_output.float() * c_gate_msa).type_as(hidden_states)


def _wan_block_probe(block: nn.Module, generator: torch.Generator) -> list[tuple[tuple, dict]]:
    device, dtype = _probe_device_dtype(block)
    dim = block.scale_shift_table.shape[-1]
    head_dim = dim // block.attn1.heads
    batch, seq = 2, 6
    # The processor splits image context off the front when add_k_proj exists; it assumes 512 text tokens.
    context = 514 if getattr(block.attn2, "add_k_proj", None) is not None else 5
    x = _randn((batch, seq, dim), generator, device, dtype)
    enc = _randn((batch, context, dim), generator, device, dtype)
    angle = _randn((1, seq, 1, head_dim), generator, device, torch.float32)
    rotary = (angle.cos(), angle.sin())
    per_sample = _randn((batch, 6, dim), generator, device, dtype)
    per_token = _randn((batch, seq, 6, dim), generator, device, dtype)
    return [((x, enc, per_sample, rotary), {}), ((x, enc, per_token, rotary), {})]


def _wan_model_head_reason(model: nn.Module) -> str | None:
    if not hasattr(model, "norm_out"):
        return None
    return (
        "output head (norm_out with the model's scale_shift_table) is modulated inline in "
        "WanTransformer3DModel.forward; left unfused, since fusing it means replacing the whole model forward "
        "for one site per model (the blocks hold the other 2 x num_layers)"
    )


# --------------------------------------------------------------------------------------------------------
# Built-in adapter: our reference model's NormModulate
# --------------------------------------------------------------------------------------------------------

_VIDEO_DIT_MODULE = "lightning_adaptiveload.models.video_dit"


# --------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    target: Any  # a class, a predicate, or a (module path, class name) resolved lazily
    adapter: FusionAdapter
    builtin: bool = False

    def resolve_class(self) -> type | None:
        if isinstance(self.target, tuple):
            # Only look in modules already imported: a model can only hold instances of a class whose module
            # is loaded, and importing diffusers just to find out costs seconds.
            module = sys.modules.get(self.target[0])
            return getattr(module, self.target[1], None) if module is not None else None
        return self.target if isinstance(self.target, type) else None

    def matches(self, module: nn.Module) -> bool:
        if isinstance(self.target, tuple) or isinstance(self.target, type):
            cls = self.resolve_class()
            return cls is not None and isinstance(module, cls)
        return bool(self.target(module))


class _LazyWanForward(ReplaceForward):
    """The Wan adapter, whose expected class forward is known only once diffusers is imported."""

    def check(self, module: nn.Module) -> str | None:
        cls = getattr(sys.modules.get(_WAN_MODULE), "WanTransformerBlock", None)
        self.expected_forward = getattr(cls, "forward", None)
        return super().check(module)


def _builtin_entries() -> list[_Entry]:
    dit_block = ReplaceForward(
        _dit_block_forward_fused, name="dit-block", sites=2, check=_dit_block_check, probe=_dit_probe
    )
    dit_final = ReplaceForward(
        _dit_final_forward_fused, name="dit-final-layer", sites=1, check=_dit_final_check, probe=_dit_probe
    )
    wan_block = _LazyWanForward(
        _wan_block_forward_fused,
        name="diffusers-wan-block",
        sites=2,
        check=_wan_block_check,
        probe=_wan_block_probe,
    )
    return [
        _Entry((_VIDEO_DIT_MODULE, "NormModulate"), _FlagAdapter("fused", "video-dit-norm-modulate"), True),
        _Entry((_WAN_MODULE, "WanTransformerBlock"), wan_block, True),
        _Entry(
            (_WAN_MODULE, "WanTransformer3DModel"),
            _NoteAdapter("diffusers-wan-head", _wan_model_head_reason),
            True,
        ),
        _Entry(lambda m: _children_names(m) == _DIT_BLOCK_CHILDREN, dit_block, True),
        _Entry(lambda m: _children_names(m) == _DIT_FINAL_CHILDREN, dit_final, True),
    ]


_BUILTINS: list[_Entry] = _builtin_entries()
_USER: list[_Entry] = []


def register_fusion_adapter(
    target: type[nn.Module] | Callable[[nn.Module], bool],
    adapter: FusionAdapter | Callable[..., Any],
    *,
    name: str | None = None,
    sites: int | Callable[[nn.Module], int] = 1,
    check: Callable[[nn.Module], str | None] | None = None,
    probe: Callable[[nn.Module, torch.Generator], list[tuple[tuple, dict]]] | None = None,
) -> FusionAdapter:
    """Teach :func:`fuse_norm_modulate` to fuse a block of your own.

    Adapters registered here are tried before the built-in ones, the most recent first; the first whose
    target matches a module handles it (and, by default, everything inside it).

    Args:
        target: a block class (matches its instances; a subclass that overrides ``forward`` is skipped with a
            reason) or a predicate ``target(module) -> bool``.
        adapter: the fused forward, ``forward(module, *args, **kwargs)``, computing exactly what the block's
            forward computes with its norm + modulate sites written as
            ``layer_norm_modulate(x, shift, scale, weight, bias, eps)``; or a :class:`FusionAdapter`.
        name, sites, check, probe: see :class:`ReplaceForward` (only used when ``adapter`` is a function).

    Returns:
        The registered adapter (pass it to :func:`unregister_fusion_adapter` to remove it).

    Raises:
        TypeError: ``target`` is neither a class nor callable, or ``adapter`` is neither a FusionAdapter nor
            callable.

    Example::

        def fused_forward(block, x, c):
            shift, scale, gate = block.ada(c).chunk(3, dim=-1)
            h = layer_norm_modulate(x, shift, scale, eps=block.norm.eps)
            return x + gate * block.mlp(h)

        register_fusion_adapter(MyBlock, fused_forward, sites=1)
    """
    if not (isinstance(target, type) or callable(target)):
        raise TypeError(f"register_fusion_adapter: target must be a class or a predicate, got {target!r}")
    if isinstance(adapter, FusionAdapter):
        resolved = adapter
    elif callable(adapter):
        expected = target.forward if isinstance(target, type) and issubclass(target, nn.Module) else None
        resolved = ReplaceForward(
            adapter, name=name, sites=sites, check=check, probe=probe, expected_forward=expected
        )
    else:
        raise TypeError(
            f"register_fusion_adapter: adapter must be a fused forward function or a FusionAdapter, "
            f"got {adapter!r}"
        )
    _USER.insert(0, _Entry(target, resolved))
    return resolved


def unregister_fusion_adapter(adapter: FusionAdapter) -> None:
    """Remove an adapter added by :func:`register_fusion_adapter`. Modules it fused stay fused (and unfuse).

    Raises:
        FusionError: it was not registered.
    """
    for i, entry in enumerate(_USER):
        if entry.adapter is adapter:
            del _USER[i]
            return
    raise FusionError(f"unregister_fusion_adapter: {adapter!r} is not registered")


# --------------------------------------------------------------------------------------------------------
# Fuse / unfuse
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Record:
    adapter: FusionAdapter
    sites: int
    state: Any


def _inside(name: str, owned: list[str]) -> bool:
    return any(name.startswith(prefix + ".") if prefix else True for prefix in owned)


def _holds_layernorm(module: nn.Module) -> bool:
    return not isinstance(module, nn.LayerNorm) and any(
        isinstance(child, nn.LayerNorm) for child in module.children()
    )


def _bump(counter: dict[str, int], key: str, n: int = 1) -> None:
    counter[key] = counter.get(key, 0) + n


def fuse_norm_modulate(module: nn.Module, *, allow_empty: bool = False, verify: bool = True) -> FusionReport:
    """Route every recognised LayerNorm + modulate site in ``module`` through ``layer_norm_modulate``.

    Changes modules in place (instance ``forward`` or a ``fused`` switch); parameters, buffers and
    ``state_dict`` are untouched. Idempotent: modules fused before are counted as ``already_fused``. Call it
    before FSDP wrapping and ``torch.compile``, or at least before the first compiled forward.

    Args:
        module: any model; its submodules are searched (the model itself included).
        allow_empty: when False (default), raise if no site is found; the error names the classes that hold a
            LayerNorm, which are the ones to register an adapter for.
        verify: compare the fused and the original forward numerically on a tiny random probe, once per block
            class, before fusing (adapters that provide a probe: the DiT and Wan ones). A class that fails is
            skipped with the error in the report. Skipped automatically, with a note, for parameters on the
            meta device or sharded.

    Returns:
        A :class:`FusionReport`.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        FusionError: nothing was found and ``allow_empty`` is False.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fuse_norm_modulate expects an nn.Module, got {type(module).__name__}")
    report = FusionReport(action="fuse", model=type(module).__name__)
    entries = _USER + _BUILTINS
    verdicts: dict[tuple[int, type], tuple[str, str]] = {}
    owned: list[str] = []
    recognised: list[str] = []  # names of modules some adapter handled (fused, already fused or skipped)
    holders: list[tuple[str, str]] = []  # (name, class) of unmatched modules that hold a LayerNorm
    for name, sub in module.named_modules():
        if _inside(name, owned):
            continue
        cls = type(sub).__name__
        if isinstance(sub.__dict__.get(_RECORD_ATTR), _Record):
            _bump(report.already_fused, cls)
            owned.append(name)
            recognised.append(name)
            continue
        entry = next((e for e in entries if e.matches(sub)), None)
        if entry is None:
            if _holds_layernorm(sub):
                holders.append((name, cls))
            continue
        adapter = entry.adapter
        recognised.append(name)
        if adapter.owns_subtree:
            owned.append(name)
        reason = adapter.check(sub)
        if reason is not None:
            report.skipped.append(SkippedModule(name, cls, reason))
            continue
        if adapter.is_fused(sub):
            _bump(report.already_fused, cls)
            continue
        if verify:
            key = (id(adapter), type(sub))
            if key not in verdicts:
                verdicts[key] = adapter.verify(sub)
            status, message = verdicts[key]
            if status == "mismatch":
                report.skipped.append(SkippedModule(name, cls, message))
                continue
            if status == "ok":
                report.checks[cls] = f"matches the original forward (max relative error {message})"
            elif status == "unverifiable":
                report.checks[cls] = f"not checked: {message}"
            elif isinstance(adapter, ReplaceForward):  # a switch (NormModulate) has nothing to compare
                report.checks[cls] = "no probe"
        state = adapter.fuse(sub)
        sites = adapter.sites(sub)
        sub.__dict__[_RECORD_ATTR] = _Record(adapter, sites, state)
        _bump(report.modules, cls)
        _bump(report.sites, cls, sites)
        report.adapters[cls] = adapter.name
    # A holder with recognised modules inside (our reference DiTBlock: NormModulate sites next to the plain
    # cross-attention LayerNorm) is accounted for; the others are what a user may want an adapter for.
    for name, cls in holders:
        if not any(_inside(r, [name]) for r in recognised):
            _bump(report.unrecognized, cls)
    if not report.found and not allow_empty:
        raise FusionError(_nothing_found_message(module, report))
    return report


def _nothing_found_message(module: nn.Module, report: FusionReport) -> str:
    model = type(module).__name__
    parts = [f"fuse_norm_modulate: no LayerNorm + modulate site could be fused in {model}."]
    if report.unrecognized:
        holders = ", ".join(f"{c} (x{n})" for c, n in report.unrecognized.items())
        parts.append(f"Classes that hold a LayerNorm but no adapter recognises: {holders}.")
    else:
        blocks = sorted(
            {
                type(m).__name__
                for container in module.modules()
                if isinstance(container, (nn.ModuleList, nn.Sequential))
                for m in container.children()
            }
            or {type(m).__name__ for m in module.children()}
        )
        parts.append(
            f"It holds no nn.LayerNorm module (its block classes: {', '.join(blocks) or 'none'}); a norm "
            "written as a function call is not found by structure."
        )
    if report.skipped:
        reasons = "; ".join(f"{s.name or '(model)'} ({s.cls}): {s.reason}" for s in report.skipped[:5])
        more = f" (and {len(report.skipped) - 5} more)" if len(report.skipped) > 5 else ""
        parts.append(f"Recognised but skipped: {reasons}{more}.")
    parts.append(
        "Register an adapter for your block class with register_fusion_adapter(BlockClass, fused_forward) "
        "(docs/fusion.md shows how), or pass allow_empty=True (FusedNormModulateMixin: fuse_allow_empty=True) "
        "to train unfused."
    )
    return " ".join(parts)


def unfuse_norm_modulate(module: nn.Module) -> FusionReport:
    """Undo :func:`fuse_norm_modulate` everywhere in ``module``, restoring each module exactly.

    Modules that were built fused (e.g. ``NormModulate(fused=True)``) are left as they are. A module whose
    forward was wrapped again after fusing is left fused, reported in ``skipped`` and warned about.

    Args:
        module: a model passed to :func:`fuse_norm_modulate` before (or any model: nothing to do then).

    Returns:
        A :class:`FusionReport` with ``action="unfuse"``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"unfuse_norm_modulate expects an nn.Module, got {type(module).__name__}")
    report = FusionReport(action="unfuse", model=type(module).__name__)
    for name, sub in module.named_modules():
        record = sub.__dict__.get(_RECORD_ATTR)
        cls = type(sub).__name__
        if not isinstance(record, _Record):
            entry = next(
                (e for e in _BUILTINS if isinstance(e.adapter, _FlagAdapter) and e.matches(sub)), None
            )
            if entry is not None and entry.adapter.check(sub) is None and entry.adapter.is_fused(sub):
                _bump(report.already_fused, cls)
            continue
        reason = record.adapter.unfuse(sub, record.state)
        if reason is not None:
            report.skipped.append(SkippedModule(name, cls, reason))
            warnings.warn(
                f"unfuse_norm_modulate: {name or '(model)'} ({cls}) left fused: {reason}", stacklevel=2
            )
            continue
        del sub.__dict__[_RECORD_ATTR]
        _bump(report.modules, cls)
        _bump(report.sites, cls, record.sites)
        report.adapters[cls] = record.adapter.name
    return report


# --------------------------------------------------------------------------------------------------------
# Lightning mixin
# --------------------------------------------------------------------------------------------------------


_DEPTH_ATTR = "_adaptiveload_configure_depth"


def _configure_then_fuse(module: FusedNormModulateMixin, configure: Callable[[], Any]) -> Any:
    # configure_model implementations call each other through super(); fuse once, after the outermost one
    # returns, when the model is complete.
    depth = module.__dict__.get(_DEPTH_ATTR, 0)
    module.__dict__[_DEPTH_ATTR] = depth + 1
    try:
        result = configure()
    finally:
        module.__dict__[_DEPTH_ATTR] = depth
    if depth == 0:
        module._fuse_after_configure_model()
    return result


class FusedNormModulateMixin:
    """Fuse a LightningModule's norm + modulate sites in ``configure_model``.

    Put it first in the bases. Whichever ``configure_model`` builds the model, in a parent class or in the
    class that uses the mixin, runs first; then :func:`fuse_norm_modulate` runs on the result. That is
    before the strategy wraps the model (DDP, FSDP) and before the first (compiled) forward. Calling
    ``configure_model`` again only reports the sites as already fused. The report is logged on rank zero and
    kept in ``self.fusion_report``.

    Options are class attributes, or keyword arguments of ``__init__`` of the same name:

    Attributes:
        fuse_enabled: set False to train unfused (e.g. to compare).
        fuse_allow_empty: do not raise when no site is found.
        fuse_verify: check each fused block class numerically on a tiny probe first (see
            :func:`fuse_norm_modulate`).
        fuse_submodule: dotted name of the submodule to fuse (e.g. ``"model"``); None fuses the whole
            LightningModule.

    Raises:
        FusionError: from ``configure_model``, when no site is found and ``fuse_allow_empty`` is False, or
            ``fuse_submodule`` names no submodule.

    Example::

        class FusedVideoDiTModule(FusedNormModulateMixin, VideoDiTModule):
            pass

        class MyModule(FusedNormModulateMixin, L.LightningModule):
            fuse_allow_empty = False

            def configure_model(self):
                if self.model is None:
                    self.model = build_dit()
    """

    fuse_enabled: bool = True
    fuse_allow_empty: bool = False
    fuse_verify: bool = True
    fuse_submodule: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("configure_model")
        if own is None or getattr(own, "_adaptiveload_fuses", False):
            return

        # A class that uses the mixin and defines configure_model itself overrides the mixin's; wrap it so
        # that fusion still follows it.
        @functools.wraps(own)
        def configure_model(self: FusedNormModulateMixin, *args: Any, **kw: Any) -> Any:
            return _configure_then_fuse(self, lambda: own(self, *args, **kw))

        configure_model._adaptiveload_fuses = True  # type: ignore[attr-defined]
        cls.configure_model = configure_model  # type: ignore[method-assign]

    def __init__(
        self,
        *args: Any,
        fuse_enabled: bool | None = None,
        fuse_allow_empty: bool | None = None,
        fuse_verify: bool | None = None,
        fuse_submodule: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        for key, value in (
            ("fuse_enabled", fuse_enabled),
            ("fuse_allow_empty", fuse_allow_empty),
            ("fuse_verify", fuse_verify),
            ("fuse_submodule", fuse_submodule),
        ):
            if value is not None:
                setattr(self, key, value)
        self.fusion_report: FusionReport | None = None

    def configure_model(self) -> None:
        """Run the next ``configure_model`` in the MRO, then fuse (see the class docstring)."""
        parent = getattr(super(), "configure_model", None)
        _configure_then_fuse(self, parent if parent is not None else (lambda: None))

    configure_model._adaptiveload_fuses = True  # type: ignore[attr-defined]

    def _fuse_after_configure_model(self) -> None:
        if not self.fuse_enabled:
            return
        target: nn.Module = self  # type: ignore[assignment]
        if self.fuse_submodule:
            try:
                target = self.get_submodule(self.fuse_submodule)  # type: ignore[attr-defined]
            except AttributeError as exc:
                raise FusionError(
                    f"{type(self).__name__}.fuse_submodule={self.fuse_submodule!r} names no submodule ({exc}); "
                    "set it to the attribute that holds the model, or to None to fuse the whole module"
                ) from exc
        report = fuse_norm_modulate(target, allow_empty=self.fuse_allow_empty, verify=self.fuse_verify)
        self.fusion_report = report
        from lightning.pytorch.utilities import rank_zero_info

        rank_zero_info(str(report))
