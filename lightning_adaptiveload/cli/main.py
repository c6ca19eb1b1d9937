"""Command line: ``python -m lightning_adaptiveload`` / ``lightning-adaptiveload``.

Training goes through :class:`~lightning.pytorch.cli.LightningCLI` (``fit``, ``validate``, ``test``,
``predict`` with ``--config`` YAML recipes whose ``model`` and ``data`` sections take ``class_path`` /
``init_args``); the data tools are plain subcommands dispatched before LightningCLI sees the arguments::

    lightning-adaptiveload fit --config quickstart          # a packaged recipe, by name
    lightning-adaptiveload fit --config recipes/quickstart.yaml
    lightning-adaptiveload synth --out data/mine --mix tiny
    lightning-adaptiveload index data/mine
    lightning-adaptiveload calibrate --recipe recipes/wan13b_480p_dual.yaml --mix wan21_480p --out cal.yaml
    lightning-adaptiveload simulate ...
    lightning-adaptiveload build-ops

This module owns the dispatch (the ``COMMANDS`` registry: a tool command's name -> its module under
``cli/`` and function), the usage text and the error printing of a failed run; the LightningCLI itself is
in :mod:`lightning_adaptiveload.cli.fit`.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

from lightning_adaptiveload.cli.fit import (
    LIGHTNING_COMMANDS,
    argument_message,
    build_cli,
    packaged_recipes,
    resolve_configs,
    resolve_recipe,
)

# build_cli, resolve_recipe and packaged_recipes live in cli/fit.py; they stay importable from here.
__all__ = ["build_cli", "main", "COMMANDS", "resolve_recipe", "packaged_recipes"]

# name -> (module, function, one-line help). Imported only when used, so that `fit` does not pay for
# them and a missing optional part only breaks its own command.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "synth": (
        "lightning_adaptiveload.cli.data",
        "synth_main",
        "write synthetic latent shards following a length mix",
    ),
    "index": (
        "lightning_adaptiveload.cli.data",
        "index_main",
        "build or verify index.json for latent shards",
    ),
    "convert-index": (
        "lightning_adaptiveload.cli.data",
        "convert_index_main",
        "convert an index between index.json and the binary index.npidx",
    ),
    "calibrate": (
        "lightning_adaptiveload.cli.calibrate",
        "main",
        "time the model on this device, fit the cost model, find the token budget -> YAML fragment",
    ),
    "simulate": (
        "lightning_adaptiveload.cli.simulate",
        "main",
        "simulate batch planning: balance per mode and world size",
    ),
    "build-ops": ("lightning_adaptiveload.cli.build_ops", "main", "compile the fused CUDA op ahead of time"),
    "ingest": (
        "lightning_adaptiveload.cli.ingest",
        "main",
        "encode videos and images into latent shards (Wan VAE)",
    ),
}


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


def _usage() -> str:
    width = max(len(n) for n in (*COMMANDS, *LIGHTNING_COMMANDS))
    lines = [
        "usage: lightning-adaptiveload COMMAND [options]",
        "",
        "training (LightningCLI; --config RECIPE.yaml):",
    ]
    lines += [f"  {n:<{width}}  see `lightning-adaptiveload {n} --help`" for n in LIGHTNING_COMMANDS]
    lines += ["", "tools:"]
    lines += [f"  {n:<{width}}  {help_}" for n, (_, _, help_) in COMMANDS.items()]
    lines += ["", f"packaged recipes (--config NAME): {', '.join(packaged_recipes()) or 'none'}"]
    lines += ["example: lightning-adaptiveload fit --config quickstart"]
    return "\n".join(lines)


# -- errors of a run with several processes ----------------------------------------------------------------

# Errors a rank raises because another rank died (its connection closed), not for a cause of its own.
_SECONDARY = ("connection closed by peer", "connection reset", "broken pipe", "gloo", "nccl", "timed out")


def _error_dir() -> str | None:
    port = os.environ.get("MASTER_PORT")
    if not port or "LOCAL_RANK" not in os.environ:
        return None
    import tempfile

    addr = os.environ.get("MASTER_ADDR", "localhost").replace(os.sep, "_")
    return os.path.join(tempfile.gettempdir(), f"lightning-adaptiveload-errors-{addr}-{port}")


def _is_secondary(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}".lower()
    return type(err).__name__.startswith("Dist") or any(s in text for s in _SECONDARY)


def _report_failure(err: BaseException, started: float) -> int:
    """Print the traceback and, last, the error that caused the failure (this rank's or another's).

    Every rank records its error in a file of the run (keyed by ``MASTER_PORT``); the launching rank,
    whose own error is often only the closed connection of a rank that died first, prints that rank's
    error as the final block.
    """
    import json
    import time

    traceback.print_exc()
    # jsonargparse re-raises an error of a class's __init__ inside a long "does not validate" message.
    while err.__cause__ is not None:
        frames = traceback.extract_tb(err.__traceback__)
        if not frames or "jsonargparse" not in frames[-1].filename:
            break
        err = err.__cause__
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    own = {"rank": rank, "error": f"{type(err).__name__}: {err}", "secondary": _is_secondary(err)}
    root = own
    folder = _error_dir()
    if folder is not None:
        try:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"rank{rank}.json"), "w", encoding="utf-8") as f:
                json.dump(own, f)
        except OSError:
            folder = None
    if folder is not None and rank == 0 and own["secondary"]:
        deadline = time.time() + 3.0
        while root is own and time.time() < deadline:
            for name in sorted(os.listdir(folder)):
                path = os.path.join(folder, name)
                try:
                    if name == "rank0.json" or os.path.getmtime(path) < started - 1:
                        continue
                    with open(path, encoding="utf-8") as f:
                        other = json.load(f)
                except (OSError, ValueError):
                    continue
                if not other.get("secondary"):
                    root = other
                    break
            else:
                time.sleep(0.2)
    if folder is not None and rank == 0:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    where = f" on rank {root['rank']}" if folder is not None else ""
    print(f"\nlightning-adaptiveload: the run failed{where}:\n  {root['error']}", file=sys.stderr, flush=True)
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    import argparse
    import time

    started = time.time()
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return int(_load(argv[0])(argv[1:]) or 0)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] not in LIGHTNING_COMMANDS and not argv[0].startswith("-"):
        near = difflib.get_close_matches(argv[0], [*LIGHTNING_COMMANDS, *COMMANDS], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        print(f"lightning-adaptiveload: unknown command {argv[0]!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    argv = resolve_configs(argv)
    if from_command_line:
        # DDP re-launches sys.argv: the ranks it starts get the resolved recipe paths too.
        sys.argv[1:] = argv
    try:
        # From the command line LightningCLI reads sys.argv itself (and DDP re-launches the same command).
        build_cli(None if from_command_line else argv)
    except argparse.ArgumentError as err:
        print(argument_message(argv, err), file=sys.stderr)
        return 2
    except Exception as err:
        if not from_command_line:
            raise
        return _report_failure(err, started)
    return 0
