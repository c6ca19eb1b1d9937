"""A LightningModule mixin that fuses the model's norm + modulate sites in ``configure_model``.

:class:`FusedNormModulateMixin` runs :func:`~lightning_adaptiveload.fusion.registry.fuse_norm_modulate`
after whichever ``configure_model`` builds the model, before the strategy wraps it. Lightning is imported
only to log the report on rank zero, when the mixin runs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn
from typing_extensions import override

from lightning_adaptiveload.fusion.adapter import FusionError
from lightning_adaptiveload.fusion.registry import FusionReport, fuse_norm_modulate, nothing_found_message

__all__ = ["FusedNormModulateMixin"]


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
        fuse_allow_empty: when no site is found, warn (on rank zero, saying which classes hold a norm no
            adapter knows) and train unfused; the default. Set False to make it an error instead.
        fuse_verify: check each fused block class numerically on a tiny probe first (see
            :func:`fuse_norm_modulate`).
        fuse_submodule: dotted name of the submodule to fuse (e.g. ``"model"``); None fuses the whole
            LightningModule.

    Raises:
        FusionError: from ``configure_model``, when ``fuse_allow_empty`` is False and no site is found, or
            when ``fuse_submodule`` names no submodule.

    Example::

        class FusedVideoDiTModule(FusedNormModulateMixin, VideoDiTModule):
            pass

        class MyModule(FusedNormModulateMixin, L.LightningModule):
            fuse_allow_empty = False  # an error, not a warning, when nothing is fused

            def configure_model(self):
                if self.model is None:
                    self.model = build_dit()
    """

    fuse_enabled: bool = True
    fuse_allow_empty: bool = True
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

    @override
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
        from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

        rank_zero_info(str(report))
        if not report.found:
            # Training goes on unfused: say so once, with what to do (fuse_allow_empty=False makes it an error).
            rank_zero_warn(
                f"{type(self).__name__} (FusedNormModulateMixin) trains unfused: {nothing_found_message(target, report)} "
                f"Set {type(self).__name__}.fuse_enabled = False to silence this, or fuse_allow_empty = False to "
                "make it an error."
            )
