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
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

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

_LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
_RECIPE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
# Top-level keys of a recipe besides the arguments of the subcommand's Trainer method.
_RECIPE_SECTIONS = ("seed_everything", "trainer", "model", "data", "optimizer", "lr_scheduler")


def packaged_recipes() -> dict[str, str]:
    """The recipes shipped in the package: name (file name without ``.yaml``) -> path."""
    if not os.path.isdir(_RECIPE_DIR):
        return {}
    return {
        name[: -len(".yaml")]: os.path.join(_RECIPE_DIR, name)
        for name in sorted(os.listdir(_RECIPE_DIR))
        if name.endswith(".yaml")
    }


def resolve_recipe(value: str) -> str:
    """A ``--config`` value: an existing file as given, else a packaged recipe's path by name.

    ``quickstart``, ``quickstart.yaml`` and ``recipes/quickstart.yaml`` name
    ``lightning_adaptiveload/recipes/quickstart.yaml`` when no such file exists in the working directory, so
    an installed package runs its recipes from anywhere.
    """
    if os.path.exists(value):
        return value
    folder, base = os.path.split(value)
    # `recipes/NAME.yaml`, as written in a checkout's docs, also finds the packaged recipe outside one.
    if folder not in ("", "recipes", "./recipes"):
        return value
    name = base[: -len(".yaml")] if base.endswith(".yaml") else base
    return packaged_recipes().get(name, value)


def _resolve_configs(argv: list[str]) -> list[str]:
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = resolve_recipe(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + resolve_recipe(arg[len("--config=") :])
    return out


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

    try:
        from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
    except ModuleNotFoundError as err:
        raise SystemExit(
            f"lightning-adaptiveload: cannot load the training classes ({err}); reinstall the package "
            "(pip install -e .) or install the missing dependency"
        ) from None

    options: dict[str, Any] = dict(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        # Errors come back as exceptions: main() prints them in a few lines instead of the usage dump.
        parser_kwargs={
            "description": "Load-balanced training of video DiTs on mixed-length data.",
            "exit_on_error": False,
        },
    )
    options.update(kwargs)
    return _cli_class(default_model=model_class is None)(
        model_class if model_class is not None else pl.LightningModule,
        datamodule_class if datamodule_class is not None else AdaptiveLoadDataModule,
        args=args,
        run=run,
        **options,
    )


def _cli_class(default_model: bool) -> type:
    """The LightningCLI subclass (made on first use: importing Lightning is slow, and tools do not need it).

    Args:
        default_model: recipes may leave out ``model.class_path``; it then names ``VideoDiTModule``.
    """
    if _CLI_CLASSES.get(default_model) is not None:
        return _CLI_CLASSES[default_model]
    from lightning.pytorch.cli import LightningCLI

    class AdaptiveLoadCLI(LightningCLI):
        """Checks the data before ``fit`` starts its ranks, and says at the end where the output went."""

        def add_arguments_to_parser(self, parser: Any) -> None:
            if default_model:
                parser.set_defaults({"model": {"class_path": "lightning_adaptiveload.VideoDiTModule"}})

        def before_fit(self) -> None:
            _check_before_fit(self.trainer, self.datamodule)

        def after_fit(self) -> None:
            _report_outputs(self.trainer, self.datamodule)

    _CLI_CLASSES[default_model] = AdaptiveLoadCLI
    return AdaptiveLoadCLI


_CLI_CLASSES: dict[bool, type] = {}


def _check_before_fit(trainer: Any, datamodule: Any) -> None:
    """Prepare and check the data in the launching process, before DDP starts the other ranks.

    Lightning starts the ranks before ``prepare_data`` and ``setup``; an error raised there on one rank
    ends the run with other ranks' connection errors printed after it. Raised here, it is the last
    error shown. Runs on local rank 0 only (the ranks Lightning starts, and every rank but one per
    node under torchrun or SLURM, skip it); ``prepare_data`` later reuses what it wrote.
    """
    check = getattr(datamodule, "check_data", None)
    if not callable(check) or getattr(trainer, "local_rank", 0) != 0:
        return
    datamodule.prepare_data()
    check()


def _report_outputs(trainer: Any, datamodule: Any) -> None:
    """Print (rank 0) where the logs, the load-balance files, the saved config and the synthetic data are,
    and the planned balance of this run beside the ``equal_tokens`` / ``independent`` baseline."""
    # trainer.log_dir broadcasts from rank 0: every rank asks.
    log_dir = trainer.log_dir or trainer.default_root_dir
    if not getattr(trainer, "is_global_zero", True):
        return
    lines = ["", "[adaptiveload] where this run's output is:"]
    if log_dir:
        lines.append(f"  logs:            {os.path.abspath(log_dir)}")
        config = os.path.join(log_dir, "config.yaml")
        if os.path.exists(config):
            lines.append(f"  saved config:    {os.path.abspath(config)}")
    for cb in trainer.callbacks:
        outdir = getattr(cb, "_outdir", None)
        if type(cb).__name__ == "LoadBalanceMonitor" and outdir and os.path.isdir(outdir):
            files = sorted(f for f in os.listdir(outdir) if f.startswith("load_balance"))
            lines.append(f"  load balance:    {os.path.abspath(outdir)}: {', '.join(files) or 'no files'}")
    if getattr(datamodule, "synthetic", None):
        where = [datamodule.train_shards] + ([datamodule.val_shards] if datamodule.val_shards else [])
        lines.append(f"  synthetic data:  {', '.join(os.path.abspath(str(w)) for w in where)}")
    comparison = _baseline_line(trainer, datamodule)
    if comparison:
        lines.append(comparison)
    print("\n".join(lines), flush=True)


def _baseline_line(trainer: Any, datamodule: Any) -> str | None:
    """One line: this run's planned compute CV and steps beside the baseline's, on the same data and ranks."""
    index = getattr(datamodule, "train_index", None)
    batcher = getattr(datamodule, "batcher", None)
    if index is None or batcher is None:
        return None
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.planner import plan_epoch

    world = int(getattr(trainer, "world_size", 1))
    workers = int(getattr(datamodule, "num_workers", 0))
    seed = int(getattr(datamodule, "seed", 0))

    def plan(mode: str, schedule: str) -> Any:
        b = DualConstraintBatcher.from_config({**batcher.config(), "mode": mode})
        return plan_epoch(index, world, workers, b, seed, 0, mode=schedule).report

    this = plan(batcher.mode, datamodule.schedule)
    base = plan("equal_tokens", "independent")
    return (
        f"  balance (planned, epoch 0, {world} ranks): compute CV {this['est_compute_cv']:.3f} over "
        f"{this['steps']} steps with schedule {datamodule.schedule}, mode {batcher.mode}; baseline "
        f"(schedule independent, mode equal_tokens) {base['est_compute_cv']:.3f} over {base['steps']} steps"
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
    lines += ["", f"packaged recipes (--config NAME): {', '.join(packaged_recipes()) or 'none'}"]
    lines += ["example: lightning-adaptiveload fit --config quickstart"]
    return "\n".join(lines)


def _valid_sections(subcommand: str) -> list[str]:
    """Top-level keys a recipe may have for ``subcommand`` (for the nearest-key hint)."""
    import inspect

    from lightning.pytorch import Trainer
    from lightning.pytorch.cli import LightningCLI

    skip = LightningCLI.subcommands().get(subcommand, set())
    method = getattr(Trainer, subcommand, None)
    params = [p for p in inspect.signature(method).parameters if p != "self"] if method else []
    return [*_RECIPE_SECTIONS, *(p for p in params if p not in skip)]


def _hint(key: str, valid: Sequence[str], what: str) -> str:
    near = difflib.get_close_matches(key, list(valid), n=1)
    return (
        f"  unknown {what} {key!r}: "
        + (f"did you mean {near[0]!r}? " if near else "")
        + (f"valid keys are {', '.join(valid)}")
    )


def _init_params(class_path: str) -> list[str]:
    """The keyword arguments of a class named by its import path ([] when it cannot be imported)."""
    import inspect

    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
        return [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    except (ImportError, AttributeError, ValueError, TypeError):
        return []


def _argument_message(argv: Sequence[str], err: Exception) -> str:
    """A few lines for a rejected command line or recipe: the parser's reason and the nearest valid key."""
    import re

    message = str(err)
    subcommand = argv[0] if argv and argv[0] in _LIGHTNING_COMMANDS else "fit"
    lines = []
    in_class = re.search(r"class_path '([^']+)':\s*Option '([^']+)' is not accepted", message)
    in_group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", message)
    anywhere = re.search(r"does not accept option '([^']+)'", message) or re.search(
        r"Option '([^']+)' is not accepted", message
    )
    if in_class:
        lines.append(f"  {in_class.group(1)} has no argument {in_class.group(2)!r}")
        lines.append(_hint(in_class.group(2), _init_params(in_class.group(1)), "argument"))
    elif in_group or anywhere:
        group, key = in_group.groups() if in_group else ("", anywhere.group(1).lstrip("-"))
        parts = [*group.split("."), *key.split(".")] if group else key.split(".")
        valid = _valid_sections(subcommand)
        if parts[0] not in valid:
            lines.append(_hint(parts[0], valid, "top-level key"))
        elif parts[0] == "trainer" and len(parts) > 1:
            lines.append(_hint(parts[1], _init_params("lightning.pytorch.Trainer"), "trainer key"))
    if lines:
        lines.insert(
            0, f"lightning-adaptiveload {subcommand}: a key of the recipe or command line is not accepted"
        )
    else:  # another problem: the parser's own words, without the usage dump
        text = [line.strip("'\"") for line in message.strip().splitlines()[:8]]
        lines = [f"lightning-adaptiveload {subcommand}: {text[0] if text else err!r}", *text[1:]]
    lines.append(f"  (all options: lightning-adaptiveload {subcommand} --help)")
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
    if argv[0] not in _LIGHTNING_COMMANDS and not argv[0].startswith("-"):
        near = difflib.get_close_matches(argv[0], [*_LIGHTNING_COMMANDS, *COMMANDS], n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        print(f"lightning-adaptiveload: unknown command {argv[0]!r}{hint}\n\n{_usage()}", file=sys.stderr)
        return 2
    argv = _resolve_configs(argv)
    if from_command_line:
        # DDP re-launches sys.argv: the ranks it starts get the resolved recipe paths too.
        sys.argv[1:] = argv
    try:
        # From the command line LightningCLI reads sys.argv itself (and DDP re-launches the same command).
        build_cli(None if from_command_line else argv)
    except argparse.ArgumentError as err:
        print(_argument_message(argv, err), file=sys.stderr)
        return 2
    except Exception as err:
        if not from_command_line:
            raise
        return _report_failure(err, started)
    return 0


def ingest_main(argv: Sequence[str]) -> int:
    """``lightning-adaptiveload ingest INPUTS --out DIR --vae VAE_DIR [...]``: see ``docs/ingest.md``.

    Exits 0 when every input was written (or was already), 1 when some were skipped, 2 on bad arguments.
    """
    import argparse
    import json

    p = argparse.ArgumentParser(
        prog="lightning-adaptiveload ingest",
        description="Encode videos and images into latent shards with Wan's VAE (Trainer.predict; resumable).",
    )
    p.add_argument(
        "inputs", help="a folder of videos/images (captions in <file>.txt) or a CSV/JSONL manifest"
    )
    p.add_argument("--out", required=True, help="output folder (a rerun skips what is already written)")
    p.add_argument(
        "--vae", required=True, help="folder of a diffusers AutoencoderKLWan (e.g. <Wan2.1-Diffusers>/vae)"
    )
    p.add_argument(
        "--text-encoder", default=None, help="folder of a transformers UMT5EncoderModel; omit for no text"
    )
    p.add_argument("--tokenizer", default=None, help="folder of its tokenizer (default: --text-encoder)")
    p.add_argument("--fps", type=float, default=16.0, help="target frame rate; 0 = the source's (default 16)")
    p.add_argument(
        "--max-frames", type=int, default=81, help="at most this many frames, cut to 4k+1 (default 81)"
    )
    p.add_argument(
        "--buckets",
        default="wan480p",
        help="'wan480p' (480x832, 832x480, 624x624), 'HxW,HxW,...', or 'native' (own size rounded down to 16)",
    )
    p.add_argument("--samples-per-shard", type=int, default=100)
    p.add_argument("--latent-dtype", choices=("float16", "float32"), default="float16")
    p.add_argument(
        "--on-error", choices=("skip", "raise"), default="skip", help="a corrupt input: count it, or stop"
    )
    p.add_argument("--num-workers", type=int, default=2, help="decoding processes per rank")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="encoder compute dtype"
    )
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--devices", default="auto", help="'auto', a count, or a list such as 0,1")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(list(argv))
    from lightning_adaptiveload.data.ingest import ingest

    devices: Any = args.devices
    if devices != "auto":
        devices = [int(d) for d in devices.split(",") if d] if "," in devices else int(devices)
    summary = ingest(
        args.inputs,
        args.out,
        args.vae,
        text_encoder=args.text_encoder,
        tokenizer=args.tokenizer,
        fps=args.fps or None,
        max_frames=args.max_frames,
        buckets=args.buckets,
        samples_per_shard=args.samples_per_shard,
        latent_dtype=args.latent_dtype,
        on_error=args.on_error,
        num_workers=args.num_workers,
        dtype=args.dtype,
        trainer_kwargs=dict(
            accelerator=args.accelerator, devices=devices, num_nodes=args.num_nodes, strategy=args.strategy
        ),
        progress=not args.no_progress,
    )
    print(json.dumps({"out": args.out, **summary}))
    return 1 if summary["skipped"] else 0
