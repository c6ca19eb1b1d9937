"""Training commands (``fit``, ``validate``, ``test``, ``predict``) through the package's LightningCLI.

Owns :func:`build_cli` and its ``LightningCLI`` subclass (the data check before ``fit`` starts its ranks,
the summary of where the output went after it), the resolution of ``--config NAME`` to a packaged recipe,
and the few-line message, with the nearest valid key, for a recipe or command line the parser rejects.
Lightning is imported only when a command runs.
"""

from __future__ import annotations

import difflib
import importlib
import os
from collections.abc import Sequence
from typing import Any

from lightning_adaptiveload import _dist

__all__ = [
    "LIGHTNING_COMMANDS",
    "PARSER_MODE",
    "TRAINER_DEFAULTS",
    "argument_message",
    "build_cli",
    "group_flags",
    "packaged_recipes",
    "register_loader",
    "resolve_configs",
    "resolve_recipe",
]

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
# The model a recipe without model.class_path builds.
DEFAULT_MODEL = "lightning_adaptiveload.VideoDiTModule"
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


def resolve_configs(argv: list[str]) -> list[str]:
    """``argv`` with every ``--config`` value passed through :func:`resolve_recipe`."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == "--config" and i + 1 < len(out):
            out[i + 1] = resolve_recipe(out[i + 1])
        elif arg.startswith("--config="):
            out[i] = "--config=" + resolve_recipe(arg[len("--config=") :])
    return out


#: The jsonargparse parser mode of the package's LightningCLI: YAML, read with the limits of
#: :func:`~lightning_adaptiveload.cli.recipe_file.parser_loader`.
PARSER_MODE = "adaptiveload_yaml"
_GROUP_FLAG_PREFIXES = ("--data.init_args.", "--data.")
_NULLS = ("null", "Null", "NULL", "~")


def register_loader() -> str:
    """Register :func:`~lightning_adaptiveload.cli.recipe_file.parser_loader` as the loader of
    :data:`PARSER_MODE` with jsonargparse; returns the mode."""
    import yaml
    from jsonargparse import set_loader

    from lightning_adaptiveload.cli.recipe_file import RecipeFileError, parser_loader

    set_loader(PARSER_MODE, parser_loader, exceptions=(yaml.YAMLError, RecipeFileError))
    return PARSER_MODE


def group_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` with every flag of a DataModule settings group in the ``--data.init_args.GROUP.FIELD`` form
    (``--data.batching.max_tokens 512`` -> ``--data.init_args.batching.max_tokens=512``).

    A field set to null (``--data.init_args.batching.max_compute=null``) is passed as
    ``--data.init_args.batching={"max_compute": null}``, which sets that field alone: jsonargparse (4.53)
    reads a null given to a nested dataclass field as the string ``"None"``.
    """
    import json

    from lightning_adaptiveload.loading.settings import DATAMODULE_GROUPS

    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        prefix = next((p for p in _GROUP_FLAG_PREFIXES if arg.startswith(p)), None)
        name, eq, value = arg[len(prefix) :].partition("=") if prefix else ("", "", "")
        group, _, field = name.partition(".")
        if prefix is None or group not in DATAMODULE_GROUPS or not field or "." in field:
            out.append(arg)
            continue
        if not eq and i < len(argv) and not argv[i].startswith("--"):
            value, eq = argv[i], "="
            i += 1
        if eq and value.strip() in _NULLS:
            out.append(f"--data.init_args.{group}={json.dumps({field: None})}")
        else:
            out.append(f"--data.init_args.{group}.{field}{eq}{value}")
    return out


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
        from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
    except ModuleNotFoundError as err:
        raise SystemExit(
            f"lightning-adaptiveload: cannot load the training classes ({err}); reinstall the package "
            "(pip install -e .) or install the missing dependency"
        ) from None

    import sys

    from lightning_adaptiveload.cli.recipe_file import check_config_files

    # Every file the parser will read, read first with the limits of cli/recipe_file.py (a FIFO is refused
    # here, before jsonargparse would block on it); the parser's own YAML reading has them too.
    check_config_files(sys.argv[1:] if args is None else list(args))
    mode = register_loader()
    _quiet_resumability_warning()
    if args is not None:
        args = group_flags(args)
    options: dict[str, Any] = dict(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        # Errors come back as exceptions: main() prints them in a few lines instead of the usage dump.
        parser_kwargs={
            "prog": program_name(),
            "description": "Load-balanced training of video DiTs on mixed-length data.",
            "exit_on_error": False,
            "parser_mode": mode,
            **{command: {"parser_mode": mode} for command in LIGHTNING_COMMANDS},
        },
    )
    options.update(kwargs)
    # Every training epoch is planned with its own step count, so Lightning must read the loader's length
    # every epoch (AdaptiveLoadDataModule refuses a trainer without it; a recipe may still set it).
    options["trainer_defaults"] = {**TRAINER_DEFAULTS, **dict(kwargs.get("trainer_defaults") or {})}
    options.setdefault("parser_class", _parser_class())
    return _cli_class(default_model=model_class is None)(
        model_class if model_class is not None else pl.LightningModule,
        datamodule_class if datamodule_class is not None else AdaptiveLoadDataModule,
        args=args,
        run=run,
        **options,
    )


def program_name() -> str:
    """How the command was called, for ``usage:`` lines: ``python -m lightning_adaptiveload`` when run as a
    module (``sys.argv[0]`` is ``__main__.py``), else ``lightning-adaptiveload``."""
    import sys

    first = os.path.basename(sys.argv[0]) if sys.argv else ""
    return "python -m lightning_adaptiveload" if first == "__main__.py" else "lightning-adaptiveload"


def _parser_class() -> type:
    """``LightningArgumentParser`` without argparse's abbreviations (``--trainer.max_epoch`` is an error,
    not ``max_epochs``). jsonargparse makes the parsers of subcommands and of a class's ``init_args`` with
    ``type(parent)(...)``, so every parser of the CLI gets ``allow_abbrev=False``."""
    if _PARSER_CLASS:
        return _PARSER_CLASS[0]
    from lightning.pytorch.cli import LightningArgumentParser

    class AdaptiveLoadArgumentParser(LightningArgumentParser):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("allow_abbrev", False)
            super().__init__(*args, **kwargs)

    _PARSER_CLASS.append(AdaptiveLoadArgumentParser)
    return AdaptiveLoadArgumentParser


_PARSER_CLASS: list[type] = []


def _quiet_resumability_warning() -> None:
    """Hide Lightning's "your dataloader is not resumable" warning of a mid-epoch resume: it looks at the
    loader, but the CLI's data is an ``AdaptiveLoadDataModule``, whose own ``state_dict`` restores the epoch's
    plan and position (``docs/recipes.md``, "Resuming")."""
    import warnings

    warnings.filterwarnings(
        "ignore",
        message=r"You're resuming from a checkpoint that ended before the epoch ended and your dataloader",
    )


#: The Trainer settings the CLI gives every run unless the recipe or the command line sets them.
TRAINER_DEFAULTS: dict[str, Any] = {"reload_dataloaders_every_n_epochs": 1}


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
                parser.set_defaults({"model": {"class_path": DEFAULT_MODEL}})

        def before_fit(self) -> None:
            _no_last_checkpoint_under_fast_dev_run(self.trainer)
            _check_resume(self.trainer, self.config.get(self.subcommand, {}).get("ckpt_path"))
            _check_before_fit(self.trainer, self.datamodule, self.model)

        def after_fit(self) -> None:
            _report_outputs(self.trainer, self.datamodule)
            _dist.destroy_gloo_group_now()

        # The other subcommands end the same way (CPU DDP: every rank tears its gloo group down together).
        def after_validate(self) -> None:
            _dist.destroy_gloo_group_now()

        def after_test(self) -> None:
            _dist.destroy_gloo_group_now()

        def after_predict(self) -> None:
            _dist.destroy_gloo_group_now()

    _CLI_CLASSES[default_model] = AdaptiveLoadCLI
    return AdaptiveLoadCLI


_CLI_CLASSES: dict[bool, type] = {}


def _no_last_checkpoint_under_fast_dev_run(trainer: Any) -> None:
    """Under ``fast_dev_run``, keep ``ModelCheckpoint(save_last=True)`` from writing ``last.ckpt``.

    Lightning (2.6) skips every checkpoint under ``fast_dev_run`` except the one its ``on_train_end`` writes for
    ``save_last``: with the quickstart's fixed ``dirpath``, that one-step checkpoint replaced the last run's
    ``last.ckpt``, which ``--ckpt_path last`` would then resume."""
    if not getattr(trainer, "fast_dev_run", False):
        return
    for cb in getattr(trainer, "checkpoint_callbacks", None) or ():
        if getattr(cb, "save_last", None):
            cb.save_last = False


def _check_resume(trainer: Any, ckpt_path: Any) -> None:
    """``--ckpt_path last`` with no ``last.ckpt`` to resume from: say why, in one line, before training starts
    from scratch (Lightning's own warning does not say where it looked)."""
    if ckpt_path != "last" or not getattr(trainer, "is_global_zero", True):
        return
    callbacks = list(getattr(trainer, "checkpoint_callbacks", None) or ())
    folders = [cb.dirpath for cb in callbacks if getattr(cb, "dirpath", None)]
    if any(os.path.isfile(os.path.join(folder, "last.ckpt")) for folder in folders):
        return
    if not callbacks:
        why = "checkpointing is off (trainer.enable_checkpointing: false, no ModelCheckpoint)"
    elif folders:
        why = f"no last.ckpt in {', '.join(os.path.abspath(f) for f in folders)} (no run has saved one there yet)"
    else:
        why = "the ModelCheckpoint has no fixed dirpath (each run writes into its own version folder)"
    print(
        f"[adaptiveload] --ckpt_path last: nothing to resume, {why}; training starts from the beginning. "
        "Give the ModelCheckpoint a dirpath and save_last: true (docs/recipes.md, 'Resuming').",
        flush=True,
    )


def _check_before_fit(trainer: Any, datamodule: Any, model: Any = None) -> None:
    """Check the module against the data, then prepare and check the data, in the launching process,
    before DDP starts the other ranks.

    Lightning starts the ranks before ``prepare_data`` and ``setup``; an error raised there on one rank
    ends the run with other ranks' connection errors printed after it. Raised here, it is the last
    error shown. Runs on local rank 0 only (the ranks Lightning starts, and every rank but one per
    node under torchrun or SLURM, skip it); ``prepare_data`` later reuses what it wrote. The module check
    (a packed schedule for a module that runs no packs) comes first: it needs no data.
    """
    if getattr(trainer, "local_rank", 0) != 0:
        return
    check_module = getattr(datamodule, "check_module", None)
    if callable(check_module):
        check_module(model)
    check = getattr(datamodule, "check_data", None)
    if not callable(check):
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
    for cb in getattr(trainer, "checkpoint_callbacks", None) or ():
        folder = getattr(cb, "dirpath", None)
        if folder and os.path.isdir(folder):
            files = sorted(f for f in os.listdir(folder) if f.endswith(".ckpt"))
            resume = " (resume: --ckpt_path last)" if "last.ckpt" in files else ""
            lines.append(
                f"  checkpoints:     {os.path.abspath(folder)}: {', '.join(files) or 'none'}{resume}"
            )
    if getattr(datamodule, "synthetic", None):
        where = [datamodule.train_shards] + ([datamodule.val_shards] if datamodule.val_shards else [])
        lines.append(f"  synthetic data:  {', '.join(os.path.abspath(str(w)) for w in where)}")
    comparison = _baseline_line(trainer, datamodule)
    if comparison:
        lines.append(comparison)
    print("\n".join(lines), flush=True)


# Above this many training samples the end of fit does not plan the baseline epoch (a second full plan,
# seconds to minutes at internet scale); `lightning-adaptiveload simulate` compares schedules instead.
BASELINE_MAX_SAMPLES = 200_000


def _baseline_line(trainer: Any, datamodule: Any) -> str | None:
    """One line: this run's planned compute CV and steps beside the baseline's, on the same data and ranks.

    The run's own figures come from the plan its loader already made (the last epoch's); only the
    baseline (``equal_tokens``, independent) is planned here, and not at all for large data sets.
    """
    index = getattr(datamodule, "train_index", None)
    batcher = getattr(datamodule, "batcher", None)
    if index is None or batcher is None:
        return None
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher
    from lightning_adaptiveload.planning.plan import batching_label
    from lightning_adaptiveload.planning.planner import plan_epoch
    from lightning_adaptiveload.planning.settings import PlanSettings

    world = int(getattr(trainer, "world_size", 1))
    workers = int(getattr(datamodule, "num_workers", 0))
    seed = int(getattr(datamodule, "seed", 0))
    current = getattr(getattr(datamodule, "train_dataset", None), "plan", None)
    epoch = int(current.epoch) if current is not None else 0

    def plan(sizing: str, schedule: str) -> Any:
        b = DualConstraintBatcher.from_config({**batcher.config(), "sizing": sizing})
        return plan_epoch(index, world, workers, b, seed, epoch, PlanSettings(schedule=schedule)).report

    this = current.report if current is not None else plan(batcher.sizing, datamodule.schedule)
    line = (
        f"  balance (planned, epoch {epoch}, {world} ranks): compute CV {this['est_compute_cv']:.3f} over "
        f"{this['steps']} steps with {batching_label(datamodule.schedule, batcher.sizing)}"
    )
    if index.num_samples > BASELINE_MAX_SAMPLES:
        return f"{line}; baseline not planned for {index.num_samples} samples (compare with `simulate`)"
    base = plan("equal_tokens", "independent")
    return (
        f"{line}; baseline (schedule independent, sizing equal_tokens) {base['est_compute_cv']:.3f} over "
        f"{base['steps']} steps"
    )


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
        params = inspect.signature(cls).parameters.values()
        return [
            p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
    except (ImportError, AttributeError, ValueError, TypeError):
        return []


def _hidden_by_var_keyword(class_path: str, name: str) -> str | None:
    """The line for an argument of ``AdaptiveLoadDataModule`` (``plan``, ``batching``, ...) that a subclass
    taking ``**kw`` hides from the CLI (jsonargparse could not follow ``**kw`` to the base class), or None."""
    import inspect

    module_name, _, cls_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
        params = inspect.signature(cls).parameters.values()
    except (ImportError, AttributeError, ValueError, TypeError):
        return None
    var = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
    if var is None or name not in _init_params("lightning_adaptiveload.datamodule.AdaptiveLoadDataModule"):
        return None
    return (
        f"  {cls_name}.__init__ takes **{var}, which the CLI cannot follow to AdaptiveLoadDataModule's {name!r}: "
        f"pass it on unchanged (super().__init__(..., **{var})) or name {name} in the signature "
        "(docs/recipes.md, 'A DataModule subclass of your own')"
    )


def _group_fields(class_path: str, group: str) -> list[str]:
    """The fields of the settings dataclass a class takes as its argument ``group`` ([] when it is none)."""
    import dataclasses
    import typing

    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
        hint = typing.get_type_hints(cls.__init__).get(group)
    except (ImportError, AttributeError, NameError, TypeError):
        return []
    candidates = [hint, *typing.get_args(hint)]
    kind = next((c for c in candidates if dataclasses.is_dataclass(c)), None)
    return [f.name for f in dataclasses.fields(kind)] if kind is not None else []


class _Found(tuple):
    """A regex match's ``groups()`` / ``group(i, j)`` for a key found another way."""

    def __new__(cls, *parts: str) -> _Found:
        return super().__new__(cls, parts)

    def groups(self) -> tuple[str, ...]:
        return tuple(self)

    def group(self, *indices: int) -> Any:
        picked = tuple(self[i - 1] for i in indices)
        return picked[0] if len(picked) == 1 else picked


def argument_message(argv: Sequence[str], err: Exception) -> str:
    """A few lines for a rejected command line or recipe: the parser's reason and the nearest valid key."""
    import re

    message = str(err)
    subcommand = argv[0] if argv and argv[0] in LIGHTNING_COMMANDS else "fit"
    lines = []
    in_class = re.search(r"class_path '([^']+)':\s*Option '([^']+)' is not accepted", message)
    # A key inside a settings group of a class's arguments (data.init_args.batching.max_token).
    in_settings = re.search(
        r"class_path '([^']+)':\s*Group '([^']+)' does not accept option '([^']+)'", message
    )
    in_group = re.search(r"Group '([^']+)' does not accept option '([^']+)'", message)
    # Without abbreviations argparse calls an unknown key "unrecognized arguments" (and jsonargparse wraps
    # the one of a class's init_args in the Union-subtype errors of its key).
    unrecognized = re.search(r"class_path '([^']+)':\s*unrecognized arguments: --([^\s=]+)", message)
    if unrecognized and not in_settings and not in_class:
        class_path, name = unrecognized.groups()
        group, dot, key = name.partition(".")
        if dot and "." not in key and _group_fields(class_path, group):
            in_settings = _Found(class_path, group, key)
        else:
            in_class = _Found(class_path, name)
    anywhere = (
        re.search(r"does not accept option '([^']+)'", message)
        or re.search(r"Option '([^']+)' is not accepted", message)
        or (None if unrecognized else re.search(r"unrecognized arguments: --([^\s=]+)", message))
    )
    if in_settings and _group_fields(*in_settings.group(1, 2)):
        class_path, group, key = in_settings.groups()
        lines.append(f"  {class_path} has no setting {group}.{key}")
        lines.append(_hint(key, _group_fields(class_path, group), f"key of {group}"))
    elif in_class:
        class_path, key = in_class.groups()
        lines.append(f"  {class_path} has no argument {key!r}")
        groups = [g for g in _init_params(class_path) if key in _group_fields(class_path, g)]
        if groups:  # a setting of one of its groups, given at the top (the flat form of 0.1.0)
            lines.append(f"  {key!r} is a setting of its group {groups[0]!r}: write it as {groups[0]}.{key}")
        else:
            lines.append(_hint(key.split(".")[0], _init_params(class_path), "argument"))
        hidden = _hidden_by_var_keyword(class_path, key.split(".")[0])
        if hidden:
            lines.append(hidden)
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
