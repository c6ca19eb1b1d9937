"""The adapter interface of the fusion pass, and the generic adapters built on it.

An adapter knows how to fuse (and unfuse) the LayerNorm + modulate sites of one kind of module.
:class:`FusionAdapter` is the interface; :class:`ReplaceForward` swaps the instance ``forward`` for a fused
one (the common case); :class:`FlagAdapter` sets a switch the module already has; :class:`NoteAdapter`
recognises a site it deliberately leaves alone. The model-family adapters (``video_dit.py``, ``wan.py``,
``dit.py``) are built from these; the pass that applies them lives in ``registry.py``.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_adaptiveload.fusion.probe import ProbeResult, run_probe

__all__ = [
    "ClassForward",
    "CopiedForward",
    "FlagAdapter",
    "FusionAdapter",
    "FusionError",
    "NoteAdapter",
    "ReplaceForward",
    "class_forward",
    "layer_norm_args",
]


class FusionError(ValueError):
    """Raised when fusion finds no site to swap (and that was not allowed) or is asked something invalid."""


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

    def verify(self, module: nn.Module) -> ProbeResult | tuple[str, str]:
        """Compare the fused and the original computation on a small probe, before fusing.

        Returns:
            A :class:`~lightning_adaptiveload.fusion.probe.ProbeResult`, or a pair ``(status, message)``,
            with status ``"ok"``, ``"mismatch"`` (the message says by how much; the module is skipped),
            ``"unverifiable"`` (e.g. parameters on the meta device; fused anyway, the message goes to
            ``report.checks``) or ``"unavailable"`` (this adapter has no probe).
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


def class_forward(module: nn.Module) -> Any:
    """The forward that ``module``'s class defines (a forward set on the instance is ignored)."""
    # FSDP2 swaps a module's class for a generated subclass that does not override forward, so this still
    # resolves to the original function.
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
            compared, forward and gradients, on a perturbed copy of the module (fp32, then bf16), before
            the first module of each class is fused; a class whose results differ beyond rounding is
            skipped with the error in the report (see :func:`~lightning_adaptiveload.fusion.probe.run_probe`).
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
        if self.expected_forward is not None and class_forward(module) is not self.expected_forward:
            return (
                f"{type(module).__qualname__} overrides forward ({_describe(class_forward(module))}), but the "
                f"fused forward was written for {_describe(self.expected_forward)}; register an adapter for "
                f"{type(module).__qualname__} itself"
            )
        return self._check(module) if self._check is not None else None

    def verify(self, module: nn.Module) -> ProbeResult | tuple[str, str]:
        if self._probe is None:
            return "unavailable", ""
        return run_probe(module, self._probe, class_forward(module), self.forward)

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


def diffusers_version() -> str:
    """The version of the diffusers already imported (``"unknown"`` when it is not)."""
    return getattr(sys.modules.get("diffusers"), "__version__", "unknown")


class ClassForward(ReplaceForward):
    """:class:`ReplaceForward` for a class named by module path and class name, looked up only once imported.

    The class's forward (the one the fused forward was written for) is resolved when a module is checked,
    so that nothing imports diffusers; a module whose forward takes other parameters than ``params`` (the
    class changed in another diffusers version) is skipped with a reason naming the installed version.

    Args:
        forward, name, sites, check, probe: as for :class:`ReplaceForward`.
        where: ``(module path, class name)`` of the class.
        params: the names of the class forward's parameters after ``self``, or None for no such check.
        owns_subtree: False for an adapter of a block whose own norm modules other adapters fuse (the
            block's adapter fuses only the sites written inline in the block's forward).
    """

    def __init__(
        self,
        forward: Callable[..., Any],
        *,
        where: tuple[str, str],
        params: list[str] | None = None,
        owns_subtree: bool = True,
        name: str | None = None,
        sites: int | Callable[[nn.Module], int] = 1,
        check: Callable[[nn.Module], str | None] | None = None,
        probe: Callable[[nn.Module, torch.Generator], list[tuple[tuple, dict]]] | None = None,
    ) -> None:
        super().__init__(forward, name=name, sites=sites, check=self._versioned(check), probe=probe)
        self.where = where
        self.params = params
        self.owns_subtree = owns_subtree

    def resolve(self) -> type | None:
        """The class, if its module is imported."""
        return getattr(sys.modules.get(self.where[0]), self.where[1], None)

    def _versioned(
        self, check: Callable[[nn.Module], str | None] | None
    ) -> Callable[[nn.Module], str | None]:
        def versioned(module: nn.Module) -> str | None:
            if self.params is not None:
                actual = list(inspect.signature(class_forward(module)).parameters)[1:]
                if actual != self.params:
                    return (
                        f"diffusers {diffusers_version()}: {type(module).__qualname__}.forward takes "
                        f"({', '.join(actual)}), the fused forward was written for ({', '.join(self.params)})"
                    )
            reason = check(module) if check is not None else None
            return None if reason is None else f"diffusers {diffusers_version()}: {reason}"

        return versioned

    def check(self, module: nn.Module) -> str | None:
        self.expected_forward = getattr(self.resolve(), "forward", None)
        return super().check(module)


@functools.cache
def _code_of(forward: Callable[..., Any]) -> str | None:
    """``forward``'s syntax tree as text, its name, docstring, comments, layout and decorators aside (None
    without Python source)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]
    node.body, node.decorator_list, node.name = body, [], "_"
    return ast.dump(node)


def same_code(a: Callable[..., Any], b: Callable[..., Any]) -> bool:
    """Whether two functions are the same code: the same names used (a cheap first test), then the same
    syntax tree, their own names, docstrings, comments and layout aside."""
    ca, cb = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if ca is None or cb is None or ca.co_names != cb.co_names or ca.co_varnames != cb.co_varnames:
        return False
    ta = _code_of(a)
    return ta is not None and ta == _code_of(b)


def same_forward_as(where: tuple[str, str]) -> Callable[[nn.Module], bool]:
    """A predicate on modules: of a class other than ``where`` (module path, class name; looked up in modules
    already imported), not a subclass of it, whose forward is the same code as its (:func:`same_code`)."""

    def matches(module: nn.Module) -> bool:
        cls = getattr(sys.modules.get(where[0]), where[1], None)
        if cls is None or isinstance(module, cls):
            return False  # not imported, or the class's own (and its subclasses', judged by its adapter)
        return same_code(class_forward(module), cls.forward)

    return matches


class CopiedForward(ReplaceForward):
    """A :class:`ClassForward`'s fused forward, for other classes whose forward is the same code.

    diffusers copies blocks between families (its ``# Copied from`` classes: Bria-Fibo's, LongCat-Image's and
    Ovis-Image's blocks are Flux's, HunyuanVideo 1.5's is HunyuanVideo's), and a class whose forward is the
    same code as the one a fused forward was written for (:func:`same_code`) computes what that class
    computes with its own submodules. Such a class takes the original's fused forward, after the original's
    checks and its probe, like the original; a class that has its own changes does not match, and stays
    with whatever else recognises it.

    Args:
        original: the adapter of the class the fused forward was written for.
    """

    def __init__(self, original: ClassForward) -> None:
        super().__init__(
            original.forward,
            name=f"{original.name} (same forward: {original.where[1]})",
            sites=original._sites,
            check=original._check,
            probe=original._probe,
        )
        self.original = original
        self.owns_subtree = original.owns_subtree
        # Whether a module's class is another class whose forward is the original's code.
        self.matches = same_forward_as(original.where)

    def check(self, module: nn.Module) -> str | None:
        if not self.matches(module):
            return f"{type(module).__qualname__}.forward is not the code of {self.original.where[1]}.forward"
        self.expected_forward = class_forward(module)
        return super().check(module)


class FlagAdapter(FusionAdapter):
    """Fuse a module that already has a boolean switch (``NormModulate.fused``) by setting it."""

    def __init__(self, attr: str, name: str) -> None:
        self.attr = attr
        self.name = name

    def check(self, module: nn.Module) -> str | None:
        value = getattr(module, self.attr, None)
        if not isinstance(value, bool):
            return (
                f"expected a bool attribute {self.attr!r} (the models/layers.py NormModulate contract), "
                f"found {value!r}; the reference model changed, update the adapter in fusion/video_dit.py"
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


class NoteAdapter(FusionAdapter):
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


def layer_norm_args(norm: nn.LayerNorm) -> dict[str, Any]:
    """The affine parameters and eps of ``norm``, as keyword arguments of ``layer_norm_modulate``."""
    return {"weight": norm.weight, "bias": norm.bias, "eps": norm.eps}
