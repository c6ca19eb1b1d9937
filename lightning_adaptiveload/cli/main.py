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
    group_flags,
    packaged_recipes,
    resolve_configs,
    resolve_recipe,
)
from lightning_adaptiveload.cli.recipe_file import RecipeFileError, check_config_files, read_yaml

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
    lines += [
        "",
        f"a failed command prints its error alone, last; its traceback goes to a file ({TRACEBACK_FLAG}: to the "
        "terminal, with any command)",
    ]
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


def _report_failure(err: BaseException, started: float, argv: Sequence[str] = ()) -> int:
    """Print the error that caused the failure (this rank's or another's) alone, as the final block.

    The traceback goes to a file (its path is printed just before the final block), or to stderr with
    ``--traceback`` / ``LIGHTNING_ADAPTIVELOAD_TRACEBACK=1``: the library's errors say what went wrong and
    what to do, and 60 lines of frames in front of that line bury it. Known errors get a ``what to do``
    line (:func:`_hints`).

    Every rank records its error in a file of the run (keyed by ``MASTER_PORT``); the launching rank,
    whose own error is often only the closed connection of a rank that died first, prints that rank's
    error as the final block.
    """
    import json
    import time

    _show_traceback(err)
    # jsonargparse re-raises an error of a class's __init__ inside a long "does not validate" message.
    while err.__cause__ is not None:
        frames = traceback.extract_tb(err.__traceback__)
        if not frames or "jsonargparse" not in frames[-1].filename:
            break
        err = err.__cause__
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    own = {
        "rank": rank,
        "error": f"{type(err).__name__}: {err}",
        "secondary": _is_secondary(err),
        "hints": _hints(err, argv),
    }
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
    hints = "".join(f"\n  {line}" for line in root.get("hints") or ())
    print(
        f"\nlightning-adaptiveload: the run failed{where}:\n  {root['error']}{hints}",
        file=sys.stderr,
        flush=True,
    )
    return 1


# -- the traceback of a failure: behind a flag, or in a file -------------------------------------------------

TRACEBACK_FLAG = "--traceback"
TRACEBACK_ENV = "LIGHTNING_ADAPTIVELOAD_TRACEBACK"


def _take_traceback_flag(argv: list[str]) -> list[str]:
    """``argv`` without ``--traceback``; the flag becomes the environment variable, which the ranks that
    DDP starts (from ``sys.argv``) inherit."""
    if TRACEBACK_FLAG in argv:
        os.environ[TRACEBACK_ENV] = "1"
        argv = [a for a in argv if a != TRACEBACK_FLAG]
    return argv


def _show_traceback(err: BaseException) -> None:
    """The traceback to stderr (``--traceback``), else to a file whose path is printed in one line."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        print(text, file=sys.stderr, end="", flush=True)
        return
    import tempfile

    rank = os.environ.get("LOCAL_RANK", "0")
    try:
        fd, path = tempfile.mkstemp(prefix=f"lightning-adaptiveload-traceback-rank{rank}-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        print(text, file=sys.stderr, end="", flush=True)  # nowhere to keep it: show it
        return
    print(
        f"lightning-adaptiveload: traceback in {path} (or rerun with {TRACEBACK_FLAG})",
        file=sys.stderr,
        flush=True,
    )


# -- what to do about known failures -------------------------------------------------------------------------


def _hints(err: BaseException, argv: Sequence[str]) -> list[str]:
    """``what to do`` lines for errors whose own message does not say it (those of Lightning and PyTorch)."""
    text = str(err)
    if "No supported gpu backend found" in text or "accelerator is not available" in text:
        return _no_gpu_hint(argv)
    return []


def _recipe_of(argv: Sequence[str]) -> tuple[str | None, dict[str, Any]]:
    """The last ``--config`` of ``argv`` and its contents ({} when it cannot be read)."""
    path = None
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg[len("--config=") :]
    if path is None:
        return None, {}
    try:
        recipe = read_yaml(path)
    except (RecipeFileError, ImportError):
        return path, {}
    return path, recipe if isinstance(recipe, dict) else {}


def _init_args(recipe: dict[str, Any], section: str) -> dict[str, Any]:
    part = recipe.get(section)
    if not isinstance(part, dict):
        return {}
    args = part.get("init_args", part)
    return args if isinstance(args, dict) else {}


def _no_gpu_hint(argv: Sequence[str]) -> list[str]:
    """A GPU recipe on a machine without a GPU: which recipe is for the CPU, and what a CPU retry would do."""
    import torch

    path, recipe = _recipe_of(argv)
    build = (
        f"PyTorch {torch.__version__} is a CPU-only build"
        if torch.version.cuda is None
        else f"PyTorch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU"
    )
    name = os.path.basename(path) if path else "this recipe"
    lines = [
        f"what to do: {name} asks for GPUs (trainer.accelerator), and {build}.",
        "  On a CPU, run the recipe made for it: lightning-adaptiveload fit --config quickstart "
        "(the tiny model on synthetic data, about a minute).",
    ]
    preset = _init_args(recipe, "model").get("preset")
    synthetic = _init_args(recipe, "data").get("synthetic")
    cost = []
    if preset and preset != "tiny":
        cost.append(f"train its {preset} model on the CPU (far too slow to be useful)")
    if isinstance(synthetic, dict):
        try:
            from lightning_adaptiveload.shards.synthetic import ANNOUNCE_BYTES, estimate_synthetic_bytes

            size = estimate_synthetic_bytes(
                synthetic.get("mix", "tiny"),
                int(synthetic.get("num_samples", 256)),
                synthetic.get("text_len_range", (0, 16)),
                int(synthetic.get("text_dim", 32)),
                synthetic.get("dtype", "float16"),
            )
            if size > ANNOUNCE_BYTES:
                cost.insert(0, f"first write about {size / (1 << 30):.1f} GiB of synthetic data")
        except (ValueError, TypeError, OSError):
            pass
    if cost:
        lines.append(f"  --trainer.accelerator cpu would run {name} as it is: {', then '.join(cost)}.")
    return lines


def _missing_recipe(argv: list[str]) -> str | None:
    """The message for a ``--config`` that names neither a file nor a packaged recipe (a typo), or None.

    A value with ``:``, ``{`` or a newline is inline YAML, which LightningCLI parses itself."""
    values = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
    values += [a[len("--config=") :] for a in argv if a.startswith("--config=")]
    for value in values:
        if os.path.exists(value) or any(c in value for c in ":{\n"):
            continue
        names = list(packaged_recipes())
        base = os.path.basename(value)
        near = difflib.get_close_matches(
            base[: -len(".yaml")] if base.endswith(".yaml") else base, names, n=1
        )
        hint = f"did you mean {near[0]!r}? " if near else ""
        return (
            f"lightning-adaptiveload: --config {value}: no such file and no packaged recipe of that name; {hint}"
            f"packaged recipes: {', '.join(names)}"
        )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    import argparse
    import time

    started = time.time()
    from_command_line = argv is None
    argv = _take_traceback_flag(list(sys.argv[1:] if argv is None else argv))
    if argv and argv[0] in COMMANDS:
        command = _load(argv[0])
        if not from_command_line:
            return int(command(argv[1:]) or 0)
        try:
            return int(command(argv[1:]) or 0)
        except Exception as err:  # a tool's own error: the message alone, as for training
            return _report_failure(err, started, argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] not in LIGHTNING_COMMANDS and not argv[0].startswith("-"):
        near = difflib.get_close_matches(argv[0], [*LIGHTNING_COMMANDS, *COMMANDS], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        print(f"lightning-adaptiveload: unknown command {argv[0]!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    argv = group_flags(resolve_configs(argv))
    missing = _missing_recipe(argv)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    try:
        check_config_files(argv)  # a FIFO, a huge file or an alias bomb: refused before the parser reads it
    except RecipeFileError as err:
        print(f"lightning-adaptiveload {argv[0]}: {err}", file=sys.stderr)
        return 2
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
        return _report_failure(err, started, argv)
    return 0
