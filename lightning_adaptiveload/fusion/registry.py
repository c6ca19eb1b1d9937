"""The fusion pass: the adapter registry, :func:`fuse_norm_modulate`, :func:`unfuse_norm_modulate` and
the :class:`FusionReport` they return.

The pass walks a model's modules, hands each to the first registered adapter whose target matches it (user
adapters first, most recent first; then the built-in ones of ``video_dit.py``, ``wan.py``, ``dit.py``,
``diffusers_mmdit.py``, ``diffusers_blocks.py`` and ``diffusers_norms.py``), checks the fused forward numerically once per class on a
perturbed copy (``probe.py``), fuses, and records on the module what to undo.
Nothing but the instance ``forward`` (or a switch the block has) changes, so ``state_dict`` is untouched
and :func:`unfuse_norm_modulate` restores each module exactly. Users add adapters for their own blocks with
:func:`register_fusion_adapter`; see ``docs/fusion.md``.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_adaptiveload.fusion import (
    diffusers_blocks,
    diffusers_mmdit,
    diffusers_norms,
    dit,
    video_dit,
    wan,
)
from lightning_adaptiveload.fusion.adapter import (
    ClassForward,
    CopiedForward,
    FlagAdapter,
    FusionAdapter,
    FusionError,
    NoteAdapter,
    ReplaceForward,
    same_forward_as,
)
from lightning_adaptiveload.fusion.probe import ProbeResult
from lightning_adaptiveload.fusion.sites import norm_kind

__all__ = [
    "FusionReport",
    "SkippedModule",
    "fuse_norm_modulate",
    "register_fusion_adapter",
    "unfuse_norm_modulate",
    "unregister_fusion_adapter",
]

# Attribute stored on every module the pass changed: what to undo. A plain attribute, so it never enters
# state_dict, and deepcopy / pickle carry it along with the patched forward.
_RECORD_ATTR = "_adaptiveload_fusion"


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
            (``verify=True``): ``"matches the original forward and gradients on a perturbed copy (...)"``
            with the errors per dtype, ``"not checked: <why>"`` or ``"no probe"``.
        probes: for each class checked, the :class:`~lightning_adaptiveload.fusion.probe.ProbeResult`
            (what was perturbed, the dtypes compared, the largest errors and the tolerances); also for a
            class the probe refused (its modules are in ``skipped``).
        already_fused: modules that were fused before this call (by an earlier call, or built fused), per
            class; they count as found. For ``unfuse``: modules built fused, which are left as they are.
        skipped: modules recognised but not changed, with the reason.
        unrecognized: classes that hold a LayerNorm or an RMSNorm (other than an attention's q / k norms),
            with no recognised module inside, that no adapter recognised (left as they are), with how many
            modules of each.
        unfused_norms: for classes that no adapter recognised but that hold recognised modules (so are not
            in ``unrecognized``), the attribute names of their own norms without an affine: in a DiT block
            such a norm is usually modulated inline in the block's forward (an FFN site), which then stays
            unfused. A norm that is not modulated (a cross-attention's) is listed too; look at the block's
            forward, and register an adapter for the block where it modulates one.
    """

    action: str
    model: str
    sites: dict[str, int] = field(default_factory=dict)
    modules: dict[str, int] = field(default_factory=dict)
    adapters: dict[str, str] = field(default_factory=dict)
    checks: dict[str, str] = field(default_factory=dict)
    probes: dict[str, ProbeResult] = field(default_factory=dict)
    already_fused: dict[str, int] = field(default_factory=dict)
    skipped: list[SkippedModule] = field(default_factory=list)
    unrecognized: dict[str, int] = field(default_factory=dict)
    unfused_norms: dict[str, list[str]] = field(default_factory=dict)

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
        verb = "now run through the fused ops" if self.action == "fuse" else "restored to their own forward"
        lines = [
            f"{self.action}_norm_modulate({self.model}): {self.num_sites} norm+modulate site(s) in "
            f"{self.num_modules} module(s) {verb}"
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
        if self.unfused_norms:
            lines.append(
                "  norms without an affine left in blocks no adapter recognised (if the block modulates them "
                "in its forward, those sites stay unfused; register an adapter for the block): "
                + ", ".join(f"{c}.{{{', '.join(names)}}}" for c, names in self.unfused_norms.items())
            )
        return "\n".join(lines)


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


def _builtin_entries() -> list[_Entry]:
    entries = [
        _Entry(target, adapter, True)
        for family in (video_dit, wan, dit, diffusers_mmdit, diffusers_blocks, diffusers_norms)
        for target, adapter in family.builtin_entries()
    ]
    # Then, after every class of its own, the classes whose forward is a copy of a built-in class's: they take
    # its fused forward, or its note (a copy of a block whose norms are not modulated is no more modulated).
    copies = [
        _Entry(c.matches, c, True)
        for c in (CopiedForward(e.adapter) for e in entries if isinstance(e.adapter, ClassForward))
    ]
    notes = [
        _Entry(same_forward_as(e.target), e.adapter, True)
        for e in entries
        if isinstance(e.adapter, NoteAdapter) and isinstance(e.target, tuple)
    ]
    return entries + copies + notes


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


# Children that normalise an attention's queries and keys: never modulated, so not a hint for an adapter.
_QK_NORMS = frozenset({"norm_q", "norm_k", "norm_added_q", "norm_added_k", "q_norm", "k_norm", "norm_cross"})


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or norm_kind(module) == "rms_norm"


def _holds_norm(module: nn.Module) -> bool:
    return not _is_norm(module) and any(
        _is_norm(child) and name not in _QK_NORMS for name, child in module.named_children()
    )


def _bump(counter: dict[str, int], key: str, n: int = 1) -> None:
    counter[key] = counter.get(key, 0) + n


def fuse_norm_modulate(module: nn.Module, *, allow_empty: bool = False, verify: bool = True) -> FusionReport:
    """Route every recognised norm + modulate site in ``module`` through the fused ops.

    LayerNorm sites go through ``layer_norm_modulate``, RMSNorm sites (LTX-Video) through
    ``rms_norm_modulate``. Changes modules in place (instance ``forward`` or a ``fused`` switch);
    parameters, buffers and ``state_dict`` are untouched. Idempotent: modules fused before are counted as
    ``already_fused``. Call it before FSDP wrapping and ``torch.compile``, or at least before the first
    compiled forward.

    Args:
        module: any model; its submodules are searched (the model itself included).
        allow_empty: when False (default), raise if no site is found; the error names the classes that hold a
            LayerNorm or RMSNorm, which are the ones to register an adapter for.
        verify: compare the fused and the original forward, outputs and gradients, once per block class
            before fusing, on a deep copy of the first module whose parameters are perturbed (non-zero
            shift, scale and gate even at adaLN-Zero initialisation), in fp32 and in bf16 (adapters that
            provide a probe: all built-in ones). A class that fails is skipped with the error in the report;
            ``report.probes`` says what each probe perturbed, compared and found. Skipped automatically,
            with a note, for parameters on the meta device or sharded.

    Returns:
        A :class:`FusionReport`.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``.
        FusionError: nothing was found and ``allow_empty`` is False.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fuse_norm_modulate expects an nn.Module, got {type(module).__name__}")
    report = FusionReport(action="fuse", model=type(module).__name__)
    walk = _FuseWalk(report, _USER + _BUILTINS, verify)
    for name, sub in module.named_modules():
        walk.visit(name, sub)
    walk.count_unrecognized()
    if not report.found and not allow_empty:
        raise FusionError(nothing_found_message(module, report))
    return report


@dataclass
class _FuseWalk:
    """One :func:`fuse_norm_modulate` walk over a model's modules, filling ``report`` as it goes."""

    report: FusionReport
    entries: list[_Entry]
    verify: bool
    verdicts: dict[tuple[int, type], tuple[str, str]] = field(default_factory=dict)
    owned: list[str] = field(default_factory=list)
    # names of modules some adapter handled (fused, already fused or skipped)
    recognised: list[str] = field(default_factory=list)
    # (name, class, module) of unmatched modules that hold a LayerNorm
    holders: list[tuple[str, str, nn.Module]] = field(default_factory=list)

    def visit(self, name: str, sub: nn.Module) -> None:
        """Fuse ``sub`` if an adapter takes it, or note why not."""
        if _inside(name, self.owned):
            return
        cls = type(sub).__name__
        record = sub.__dict__.get(_RECORD_ATTR)
        if isinstance(record, _Record):
            _bump(self.report.already_fused, cls)
            if record.adapter.owns_subtree:
                self.owned.append(name)
            self.recognised.append(name)
            return
        entry = next((e for e in self.entries if e.matches(sub)), None)
        if entry is None:
            if _holds_norm(sub):
                self.holders.append((name, cls, sub))
            return
        adapter = entry.adapter
        self.recognised.append(name)
        if adapter.owns_subtree:
            self.owned.append(name)
        reason = adapter.check(sub)
        if reason is not None:
            self.report.skipped.append(SkippedModule(name, cls, reason))
            return
        if adapter.is_fused(sub):
            _bump(self.report.already_fused, cls)
            return
        if self.verify and not self._passes_probe(name, sub, adapter):
            return
        self._fuse(sub, adapter)

    def _passes_probe(self, name: str, sub: nn.Module, adapter: FusionAdapter) -> bool:
        # One verdict per adapter and block class: the probe compares computations (on a perturbed copy),
        # not this module's weights.
        cls = type(sub).__name__
        key = (id(adapter), type(sub))
        if key not in self.verdicts:
            self.verdicts[key] = ProbeResult.coerce(adapter.verify(sub))
        result = self.verdicts[key]
        if result.status in ("ok", "mismatch") and result.dtypes:
            self.report.probes[cls] = result
        if result.status == "mismatch":
            self.report.skipped.append(SkippedModule(name, cls, f"the probe refused it: {result.message}"))
            return False
        if result.status == "ok":
            self.report.checks[cls] = (
                result.message if result.dtypes else f"matches the original forward ({result.message})"
            )
        elif result.status == "unverifiable":
            self.report.checks[cls] = f"not checked: {result.message}"
        elif isinstance(adapter, ReplaceForward):  # a switch (NormModulate) has nothing to compare
            self.report.checks[cls] = "no probe"
        return True

    def _fuse(self, sub: nn.Module, adapter: FusionAdapter) -> None:
        cls = type(sub).__name__
        state = adapter.fuse(sub)
        sites = adapter.sites(sub)
        sub.__dict__[_RECORD_ATTR] = _Record(adapter, sites, state)
        _bump(self.report.modules, cls)
        _bump(self.report.sites, cls, sites)
        self.report.adapters[cls] = adapter.name

    def count_unrecognized(self) -> None:
        """Count the LayerNorm holders no adapter recognised, after the walk."""
        # A holder with recognised modules inside (our reference DiTBlock: NormModulate sites next to the
        # plain cross-attention LayerNorm) is accounted for; the others are what a user may want an adapter for.
        # Its own norms without an affine are named, though: a block that fuses its norm modules but not its
        # inline FFN sites (a family's copy of a block, with a change) would otherwise pass unnoticed.
        for name, cls, module in self.holders:
            if not any(_inside(r, [name]) for r in self.recognised):
                _bump(self.report.unrecognized, cls)
                continue
            bare = [
                child_name
                for child_name, child in module.named_children()
                if _is_norm(child) and child_name not in _QK_NORMS and getattr(child, "weight", None) is None
            ]
            if bare:
                known = self.report.unfused_norms.setdefault(cls, [])
                known.extend(n for n in bare if n not in known)


def nothing_found_message(module: nn.Module, report: FusionReport) -> str:
    """Why nothing was fused in ``module`` and what to do: the text of the FusionError (and the mixin's warning)."""
    model = type(module).__name__
    parts = [f"fuse_norm_modulate: no norm + modulate site (LayerNorm or RMSNorm) could be fused in {model}."]
    if report.unrecognized:
        holders = ", ".join(f"{c} (x{n})" for c, n in report.unrecognized.items())
        parts.append(
            f"Classes that hold a LayerNorm or RMSNorm but no adapter recognises: {holders}; both kinds can be "
            "fused (layer_norm_modulate, rms_norm_modulate) once an adapter says where the site is."
        )
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
            f"It holds no nn.LayerNorm or RMSNorm module (its block classes: {', '.join(blocks) or 'none'}); a "
            "norm written as a function call (F.layer_norm, F.rms_norm) is not found by structure: write an adapter "
            "for the block that calls it."
        )
    if report.skipped:
        reasons = "; ".join(f"{s.name or '(model)'} ({s.cls}): {s.reason}" for s in report.skipped[:5])
        more = f" (and {len(report.skipped) - 5} more)" if len(report.skipped) > 5 else ""
        parts.append(f"Recognised but skipped: {reasons}{more}.")
    parts.append(
        "Register an adapter for your block class with register_fusion_adapter(BlockClass, fused_forward) "
        "(docs/fusion.md shows how), or pass allow_empty=True to train unfused (FusedNormModulateMixin does, "
        "with a warning, unless fuse_allow_empty=False)."
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
                (e for e in _BUILTINS if isinstance(e.adapter, FlagAdapter) and e.matches(sub)), None
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
