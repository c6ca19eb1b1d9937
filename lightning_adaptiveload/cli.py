"""Command line: ``python -m lightning_adaptiveload`` / ``lightning-adaptiveload``.

Training goes through :class:`~lightning.pytorch.cli.LightningCLI` (``fit``, ``validate``, ``test``,
``predict`` with ``--config`` YAML recipes whose ``model`` and ``data`` sections take ``class_path`` /
``init_args``); the data tools are plain subcommands dispatched before LightningCLI sees the arguments::

    lightning-adaptiveload fit --config recipes/quickstart.yaml
    lightning-adaptiveload synth --out data/mine --mix tiny
    lightning-adaptiveload index data/mine
    lightning-adaptiveload calibrate --recipe recipes/wan13b_480p_dual.yaml --mix wan21_480p --out cal.yaml
    lightning-adaptiveload simulate ...
    lightning-adaptiveload build-ops
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["build_cli", "main", "COMMANDS"]

# name -> (module, function, one-line help). Imported only when used, so that `fit` does not pay for
# them and a missing optional part only breaks its own command.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "synth": (
        "lightning_adaptiveload.shards",
        "synth_main",
        "write synthetic latent shards following a length mix",
    ),
    "index": ("lightning_adaptiveload.shards", "index_main", "build or verify index.json for latent shards"),
    "calibrate": (
        "lightning_adaptiveload.calibrate",
        "main",
        "time the model on this device, fit the cost model, find the token budget -> YAML fragment",
    ),
    "simulate": (
        "lightning_adaptiveload.simulate",
        "main",
        "simulate batch planning: balance per mode and world size",
    ),
    "build-ops": ("lightning_adaptiveload.ops._build", "main", "compile the fused CUDA op ahead of time"),
}

_LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


def _load(name: str) -> Any:
    module_name, func_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (err.name == module_name or module_name.startswith(err.name + ".")):
            raise SystemExit(
                f"lightning-adaptiveload {name}: this installation has no {module_name} module; "
                "reinstall the package (pip install -e .) or update it"
            ) from None
        raise SystemExit(
            f"lightning-adaptiveload {name}: {module_name} needs {err.name!r}, which is not installed; "
            f"install it (pip install {err.name})"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise SystemExit(
            f"lightning-adaptiveload {name}: {module_name} has no {func_name}(argv); update the package"
        )
    return func


def build_cli(
    args: Sequence[str] | None = None,
    run: bool = True,
    model_class: type | None = None,
    datamodule_class: type | None = None,
    **kwargs: Any,
):
    """The package's LightningCLI: any ``LightningModule`` as model (``VideoDiTModule`` when the recipe names
    none), any ``AdaptiveLoadDataModule`` subclass as data (both with ``class_path`` / ``init_args``), and a
    saved config that a repeated run overwrites instead of failing on.

    Args:
        args: command line (without the program name); None reads ``sys.argv``.
        run: run the subcommand (False: only parse and instantiate, e.g. to check a recipe).
        model_class: base class the recipe's ``model.class_path`` must subclass (default:
            ``LightningModule``, so any module; see ``docs/your_own_model.md``).
        datamodule_class: base class of ``data.class_path`` (default: ``AdaptiveLoadDataModule``).
        **kwargs: passed to ``LightningCLI`` (e.g. ``trainer_defaults``, ``save_config_kwargs``).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.cli import LightningCLI

    try:
        from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
    except ModuleNotFoundError as err:
        raise SystemExit(
            f"lightning-adaptiveload: cannot load the training classes ({err}); reinstall the package "
            "(pip install -e .) or install the missing dependency"
        ) from None

    class _CLI(LightningCLI):
        def add_arguments_to_parser(self, parser: Any) -> None:
            if model_class is None:
                # Recipes written for VideoDiTModule may leave out model.class_path.
                parser.set_defaults({"model": {"class_path": "lightning_adaptiveload.module.VideoDiTModule"}})

    options: dict[str, Any] = dict(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": "Load-balanced training of video DiTs on mixed-length data."},
    )
    options.update(kwargs)
    return _CLI(
        model_class if model_class is not None else pl.LightningModule,
        datamodule_class if datamodule_class is not None else AdaptiveLoadDataModule,
        args=args,
        run=run,
        **options,
    )


def _usage() -> str:
    width = max(len(n) for n in (*COMMANDS, *_LIGHTNING_COMMANDS))
    lines = [
        "usage: lightning-adaptiveload COMMAND [options]",
        "",
        "training (LightningCLI; --config RECIPE.yaml):",
    ]
    lines += [f"  {n:<{width}}  see `lightning-adaptiveload {n} --help`" for n in _LIGHTNING_COMMANDS]
    lines += ["", "tools:"]
    lines += [f"  {n:<{width}}  {help_}" for n, (_, _, help_) in COMMANDS.items()]
    lines += ["", "example: lightning-adaptiveload fit --config recipes/quickstart.yaml"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return int(_load(argv[0])(argv[1:]) or 0)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    # From the command line LightningCLI reads sys.argv itself (and DDP re-launches the same command).
    build_cli(None if from_command_line else argv)
    return 0
