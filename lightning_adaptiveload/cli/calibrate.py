"""``lightning-adaptiveload calibrate``: the command line of :mod:`lightning_adaptiveload.tools.calibrate`.

Reads the recipe and the flags and measures the recipe's own model: ``VideoDiTModule`` (or a recipe without a
``model`` section, or no recipe: ``--preset``) through :func:`~lightning_adaptiveload.tools.calibrate.calibrate`,
any other ``model.class_path`` through :func:`~lightning_adaptiveload.tools.calibrate.calibrate_module`, built
from its ``init_args`` by jsonargparse as ``fit`` builds it (the class must be a ``LightningModule``). Writes
the YAML fragment (to stdout or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from lightning_adaptiveload.tools.calibrate import PRECISIONS, calibrate, calibrate_module, shape_for_seq_len
from lightning_adaptiveload.tools.calibrate_settings import (
    CalibratedTraining,
    CalibrateSettings,
    MemorySearch,
    ModuleBatches,
)

__all__ = ["main"]


def _parse_shapes(text: str) -> list[tuple[int, int, int, int]]:
    shapes = []
    for part in text.split(","):
        dims = part.strip().lower().split("x")
        if len(dims) != 4 or not all(d.isdigit() and int(d) > 0 for d in dims):
            raise ValueError(f"--shapes: {part!r} is not CxTxHxW with positive integers, e.g. 16x21x60x104")
        shapes.append(tuple(int(d) for d in dims))
    return shapes


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


# The model settings a recipe's model.init_args gives calibrate (each also a flag).
_MODEL_KEYS = (
    "preset",
    "model_overrides",
    "activation_checkpointing",
    "compile",
    "weight_dtype",
    "checkpoint_policy",
)
# The settings group of VideoDiTModule that holds a model key in a recipe (model.init_args.memory.
# activation_checkpointing); the others are top-level keys of model.init_args.
_MODEL_GROUPS = {
    "activation_checkpointing": "memory",
    "checkpoint_policy": "memory",
    "weight_dtype": "optimizer",
}
# The recipe's and the flags' settings of the measured step (CalibratedTraining's fields).
_TRAINING_KEYS = frozenset(f.name for f in dataclasses.fields(CalibratedTraining))


def _load_recipe(path: str) -> Any:
    """The recipe's YAML, read as untrusted text by the one recipe reader (``cli/recipe_file.py``: a regular
    file, its size, aliases and nesting bounded; a ``ValueError`` naming ``--recipe PATH`` and the line)."""
    from lightning_adaptiveload.cli.recipe_file import read_yaml

    return read_yaml(path, what=f"--recipe {path}")


def _mapping(value: Any, path: str, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(
            f"--recipe {path}: {where} must be a mapping (key: value lines), got a {type(value).__name__}"
        )
    return value


def _recipe_defaults(path: str) -> dict[str, Any]:
    """Settings from a recipe: model.init_args, trainer.precision and the synthetic data's mix.

    Raises:
        ValueError: naming the recipe and the part that is not what a recipe holds.
    """
    recipe = _mapping(_load_recipe(path), path, "the recipe")
    model = _mapping(recipe.get("model"), path, "model")
    args = _mapping(model.get("init_args", model), path, "model.init_args")
    out: dict[str, Any] = {}
    class_path = model.get("class_path")
    if class_path is not None:
        if not isinstance(class_path, str) or not class_path.strip():
            raise ValueError(f"--recipe {path}: model.class_path must be an import path, got {class_path!r}")
        out["model_class_path"] = class_path.strip()
        out["model_init_args"] = _mapping(model.get("init_args"), path, "model.init_args")
    for key in _MODEL_KEYS:
        if key in _MODEL_GROUPS:
            group = args.get(_MODEL_GROUPS[key])
            if isinstance(group, dict) and key in group:
                out[key] = group[key]
        elif key in args:
            out[key] = args[key]
    if isinstance(out.get("compile"), dict):  # CompileSettings' fields: calibrate compiles with the defaults
        out["compile"] = True
    data = _mapping(recipe.get("data"), path, "data")
    data_args = _mapping(data.get("init_args", data), path, "data.init_args")
    synthetic = data_args.get("synthetic") or {}
    if isinstance(synthetic, dict) and synthetic.get("mix"):
        out["mix"] = synthetic["mix"]
        text_range = synthetic.get("text_len_range")
        if isinstance(text_range, list | tuple) and len(text_range) == 2:
            if not all(type(v) is int for v in text_range):
                raise ValueError(
                    f"--recipe {path}: data.init_args.synthetic.text_len_range must be two integers, got {text_range!r}"
                )
            out["text_len"] = int(text_range[1])
    out["batches"] = _recipe_batches(path, data_args, synthetic)
    if data_args.get("train_shards") is not None:
        out["train_shards"] = data_args["train_shards"]
    precision = _mapping(recipe.get("trainer"), path, "trainer").get("precision")
    if precision is not None:
        if not isinstance(precision, str | int):
            raise ValueError(
                f"--recipe {path}: trainer.precision must be a string, got {type(precision).__name__}"
            )
        precision = str(precision)
        out["precision"] = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(precision, precision)
    return out


def _recipe_batches(path: str, data_args: dict[str, Any], synthetic: Any) -> dict[str, Any]:
    """The batch contract's fields a recipe's data section sets (``ModuleBatches``' keyword arguments)."""
    batching = _mapping(data_args.get("batching"), path, "data.init_args.batching")
    loader = _mapping(data_args.get("loader"), path, "data.init_args.loader")
    plan = _mapping(data_args.get("plan"), path, "data.init_args.plan")
    out: dict[str, Any] = {}
    if batching.get("patch_size") is not None:
        patch = batching["patch_size"]
        out["patch_size"] = tuple(patch) if isinstance(patch, list | tuple) else patch
    if loader.get("text_pad_to") is not None:
        out["text_pad_to"] = loader["text_pad_to"]
    if plan.get("schedule") is not None:
        out["schedule"] = plan["schedule"]
    if isinstance(synthetic, dict) and synthetic:
        # What SyntheticShards writes (its defaults where the block leaves a key out).
        no_text = "text_len_range" in synthetic and synthetic["text_len_range"] is None
        out["text_dim"] = None if no_text else synthetic.get("text_dim", 32)
        out["dtype"] = str(synthetic.get("dtype", "float16"))
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-adaptiveload calibrate",
        description="Time the model per sequence length on this device, fit the cost model, find the token "
        "budget that fits the memory, and write a YAML fragment for a recipe.",
    )
    p.add_argument(
        "--recipe",
        help="measure this recipe's model (model.class_path with its init_args; VideoDiTModule: its preset, "
        "model_overrides, memory, optimizer and compile settings) with its trainer.precision, on batches shaped "
        "by its data (the synthetic mix, else the training shards); flags override it",
    )
    p.add_argument(
        "--preset",
        help="VideoDiTModule preset: tiny, wan-1.3b, wan-14b (default: the recipe's, else wan-1.3b); not with a "
        "recipe whose model is another class",
    )
    p.add_argument("--model-overrides", type=json.loads, help="JSON, e.g. '{\"num_layers\": 4}'")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--mix", help="length mix whose bucket shapes are measured (name or JSON path)")
    src.add_argument("--shapes", type=_parse_shapes, help="latent shapes CxTxHxW,... to measure")
    src.add_argument("--seq-lens", type=_int_list, help="token counts to measure (single-frame shapes)")
    p.add_argument("--num-shapes", type=int, default=6, help="distinct lengths to measure (<= 0: all)")
    p.add_argument("--batch-sizes", type=_int_list, help="batch sizes to time (default: 1 and the budget's)")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        help="training precision (default: the recipe's, else bf16-mixed on CUDA)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute block activations in backward (default: the recipe's)",
    )
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile the model"
    )
    p.add_argument(
        "--weight-dtype",
        choices=("fp32", "bf16"),
        help="the model's parameters: fp32 (autocast casts them) or bf16 with fp32 masters in the "
        "optimizer (default: the recipe's, else fp32)",
    )
    p.add_argument(
        "--checkpoint-policy",
        choices=("full", "save_attention", "save_matmuls"),
        help="what a checkpointed block keeps (default: the recipe's, else full)",
    )
    p.add_argument(
        "--checkpoint-blocks",
        choices=("auto",),
        help="auto: fit the activation-memory model and write checkpoint_blocks: auto with it",
    )
    p.add_argument(
        "--text-len",
        type=int,
        help="text states per sample (default: the recipe's longest, else 512 for Wan, 16 for tiny)",
    )
    p.add_argument(
        "--text-dim",
        type=int,
        help="width of the text states for a recipe's own model (default: the recipe's synthetic data's, else "
        "its training shards'; 0: no text)",
    )
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--vram-fraction", type=float, default=0.9, help="share of device memory to fill (0.9)")
    p.add_argument("--memory-budget-gb", type=float, help="memory budget in GiB instead of --vram-fraction")
    p.add_argument("--max-tokens", type=int, help="skip the memory search and use this token budget")
    p.add_argument("--max-batch", type=int, default=256, help="largest batch size the search tries (256)")
    p.add_argument(
        "--ddp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count DDP gradient buckets in the peak (default: on with CUDA)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per shape (2)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per shape (5)")
    p.add_argument(
        "--kind", choices=("quadratic", "power"), default="quadratic", help="cost model form to fit"
    )
    p.add_argument(
        "--max-compute",
        choices=("resolve", "auto"),
        default="resolve",
        help="write the resolved 'auto' cap for the measured shapes, or 'auto'",
    )
    p.add_argument(
        "--packs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time single samples and a designed set of packs at max_tokens through the packed forward, and "
        "fit c0 + alpha*S + beta*S^2 to all of them (default: where the model takes packs: VideoDiTModule, or a "
        "module with runs_packed_batches = True; --no-packs: per-sample fit of batch times)",
    )
    p.add_argument(
        "--results",
        help="also write every measured point, its model prediction and relative error to this YAML file",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the model and inputs (0)")
    p.add_argument("--out", default="-", help="output YAML path ('-' = stdout)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``lightning-adaptiveload calibrate``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        result = _calibrate(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    text = result.to_yaml()
    if args.results:
        import yaml

        os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
        with open(args.results, "w", encoding="utf-8") as f:
            yaml.safe_dump(result.to_results(), f, sort_keys=False)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
        fit = result.cost_model.fit_info or {}
        print(
            f"wrote {args.out}: {result.model.get('class_path', 'model')} measured; max_tokens={result.max_tokens}, "
            f"max_compute={result.max_compute}, cost model {result.cost_model.describe()}; relative error mean "
            f"{100 * fit.get('mean_rel_error', float('nan')):.1f}%, max {100 * fit.get('max_rel_error', float('nan')):.1f}%",
            file=sys.stderr,
        )
    return 0


# How recipes name VideoDiTModule: measured from its preset by calibrate() (no instance is built here).
_VIDEO_DIT_PATHS = frozenset(
    {
        "VideoDiTModule",
        "lightning_adaptiveload.VideoDiTModule",
        "lightning_adaptiveload.models.VideoDiTModule",
        "lightning_adaptiveload.models.module.VideoDiTModule",
    }
)
# The flags that set VideoDiTModule's model, and their settings' names.
_VIDEO_DIT_FLAGS = {
    "preset": "--preset",
    "model_overrides": "--model-overrides",
    "activation_checkpointing": "--activation-checkpointing",
    "compile": "--compile",
    "weight_dtype": "--weight-dtype",
    "checkpoint_policy": "--checkpoint-policy",
    "checkpoint_blocks": "--checkpoint-blocks",
}


def _calibrate(args: argparse.Namespace) -> Any:
    """The calibration the flags and the recipe ask for (the recipe's own model, or VideoDiTModule's preset)."""
    if args.recipe:  # a packaged recipe by name, as `fit --config quickstart` takes it
        from lightning_adaptiveload.cli.fit import resolve_recipe

        args.recipe = resolve_recipe(args.recipe)
    settings = _recipe_defaults(args.recipe) if args.recipe else {}
    class_path = settings.pop("model_class_path", None)
    init_args = settings.pop("model_init_args", {})
    if class_path is not None and class_path not in _VIDEO_DIT_PATHS:
        given = [flag for key, flag in _VIDEO_DIT_FLAGS.items() if getattr(args, key) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: {'these set' if len(given) > 1 else 'this sets'} VideoDiTModule's model, but "
                f"--recipe {args.recipe} names model.class_path {class_path}, and calibrate measures the recipe's "
                "own model: leave them out and set how the model trains in its model.init_args (or drop --recipe "
                "to measure a VideoDiTModule preset)"
            )
        module, notes = _instantiate_model(args.recipe, class_path, init_args)
        if not _is_video_dit(module):
            return _calibrate_own_model(args, settings, module, class_path, init_args, notes)
        settings.setdefault("preset", module.hparams.get("preset"))  # another name for VideoDiTModule
    return _calibrate_video_dit(args, settings)


def _is_video_dit(module: Any) -> bool:
    cls = type(module)
    return cls.__module__ == "lightning_adaptiveload.models.module" and cls.__qualname__ == "VideoDiTModule"


def _measured_settings(args: argparse.Namespace, shapes: Any, mix: Any, text_len: Any, training: Any) -> Any:
    return CalibrateSettings(
        shapes=shapes,
        mix=mix,
        num_shapes=args.num_shapes,
        batch_sizes=args.batch_sizes,
        text_len=args.text_len if args.text_len is not None else text_len,
        warmup=args.warmup,
        repeats=args.repeats,
        kind=args.kind,
        max_compute=args.max_compute,
        seed=args.seed,
        packs=args.packs,
        training=training,
        memory=MemorySearch(
            vram_fraction=args.vram_fraction,
            memory_budget_gb=args.memory_budget_gb,
            max_tokens=args.max_tokens,
            max_batch=args.max_batch,
        ),
    )


def _calibrate_video_dit(args: argparse.Namespace, settings: dict[str, Any]) -> Any:
    """VideoDiTModule from its preset: the recipe's model settings and the flags."""
    for key in (*_MODEL_KEYS, "precision", "checkpoint_blocks"):
        value = getattr(args, key)
        if value is not None:
            settings[key] = value
    if not settings.get("preset"):
        settings["preset"] = "wan-1.3b"
    recipe_mix = settings.pop("mix", None)
    recipe_text_len = settings.pop("text_len", None)
    settings.pop("batches", None)
    train_shards = settings.pop("train_shards", None)
    shapes = args.shapes
    from_flags = args.mix or shapes is not None or args.seq_lens
    if args.seq_lens or (not from_flags and not recipe_mix and train_shards is not None):
        from lightning_adaptiveload.models import VideoDiTConfig

        cfg = VideoDiTConfig.preset(settings["preset"], **(settings.get("model_overrides") or {}))
        if args.seq_lens:
            shapes = [shape_for_seq_len(s, cfg.in_channels, cfg.patch_size) for s in args.seq_lens]
        else:  # no synthetic mix: the shapes of the training shards
            data = _read_shards(args.recipe, train_shards, cfg.patch_size)
            shapes = data["shapes"]
            recipe_text_len = data["text_len"] or recipe_text_len
    training = CalibratedTraining(
        **{k: settings.pop(k) for k in list(settings) if k in _TRAINING_KEYS},
        device=args.device,
        ddp=args.ddp,
    )
    measured = _measured_settings(
        args, shapes, args.mix or (recipe_mix if shapes is None else None), recipe_text_len, training
    )
    return calibrate(
        settings.pop("preset"),
        settings.pop("model_overrides", None),
        measured,
        progress=not args.no_progress,
    )


def _calibrate_own_model(
    args: argparse.Namespace,
    settings: dict[str, Any],
    module: Any,
    class_path: str,
    init_args: dict[str, Any],
    notes: dict[str, str],
) -> Any:
    """A recipe's own LightningModule: its training_step on batches shaped by the recipe's data."""
    recipe = args.recipe
    batch_args = dict(settings.pop("batches", {}))
    recipe_mix = settings.pop("mix", None)
    text_len = settings.pop("text_len", None)
    train_shards = settings.pop("train_shards", None)
    patch = batch_args.get("patch_size", (1, 2, 2))
    shapes, mix = args.shapes, args.mix
    if shapes is None and not mix and not args.seq_lens:
        mix = recipe_mix
    shard_data = None
    # The data's shapes (and text) from the training shards where no synthetic block describes them.
    needs_shards = (shapes is None and not mix and not args.seq_lens) or (
        "text_dim" not in batch_args and args.text_dim is None
    )
    if needs_shards and train_shards is not None and not recipe_mix:
        try:
            shard_data = _read_shards(recipe, train_shards, patch)
        except ValueError:
            if shapes is None and not mix and not args.seq_lens:
                raise
    if shard_data is not None:
        if shapes is None and not mix and not args.seq_lens:
            shapes = shard_data["shapes"]
        batch_args.setdefault("text_dim", shard_data["text_dim"])
        batch_args.setdefault("dtype", shard_data["dtype"])
        text_len = shard_data["text_len"] or text_len
    if args.text_dim is not None:
        batch_args["text_dim"] = args.text_dim or None
    if "text_dim" not in batch_args:
        raise ValueError(
            f"--recipe {recipe}: the width of the text states of {class_path}'s batches is not known (no "
            "data.init_args.synthetic block, and no readable train_shards): give --text-dim D (0: no text)"
        )
    if args.seq_lens:
        channels = _channels(recipe_mix, shard_data)
        if channels is None:
            raise ValueError(
                "--seq-lens: the latent channel count of the recipe's data is not known (no synthetic mix, no "
                "readable train_shards); give --shapes CxTxHxW instead"
            )
        shapes = [shape_for_seq_len(s, channels, patch) for s in args.seq_lens]
    try:
        batches = ModuleBatches(**batch_args)
    except (TypeError, ValueError) as err:
        raise ValueError(f"--recipe {recipe}: data.init_args: {err}") from None
    training = CalibratedTraining(precision=settings.get("precision"), device=args.device, ddp=args.ddp)
    measured = _measured_settings(args, shapes, mix, text_len, training)
    return calibrate_module(
        module,
        measured,
        batches,
        class_path=class_path,
        init_args=init_args,
        notes=notes,
        progress=not args.no_progress,
    )


def _channels(mix: Any, shard_data: dict[str, Any] | None) -> int | None:
    if mix:
        from lightning_adaptiveload.shards.mixes import load_mix

        return int(load_mix(mix).buckets[0].latent_shape[0])
    if shard_data is not None and shard_data["shapes"]:
        return int(shard_data["shapes"][0][0])
    return None


def _instantiate_model(recipe: str, class_path: str, init_args: dict[str, Any]) -> tuple[Any, dict[str, str]]:
    """The recipe's model, built by jsonargparse as ``fit`` builds it: the class must be a ``LightningModule``
    (``subprocess.Popen`` or a function is refused before anything is called), its ``init_args`` are checked
    against its signature. A module that is not importable from here but sits beside the recipe (as
    ``python -m`` from the recipe's folder finds it) is imported from the recipe's folder (appended to the
    import path, after everything installed).

    Returns:
        The module, and lines for the record.

    Raises:
        ValueError: naming the recipe, the class and the reason.
    """
    import importlib.util

    notes: dict[str, str] = {}
    top = class_path.split(".")[0]
    folder = os.path.dirname(os.path.abspath(recipe))
    if "." in class_path and _find_spec(top) is None:
        beside = os.path.join(folder, top + ".py"), os.path.join(folder, top, "__init__.py")
        if any(os.path.isfile(p) for p in beside) and folder not in sys.path:
            sys.path.append(folder)
            importlib.invalidate_caches()
            notes["imported"] = f"{top} from the recipe's folder {folder}"
    try:
        from jsonargparse import ArgumentParser
        from lightning.pytorch import LightningModule
    except ImportError as err:
        raise ValueError(
            f"--recipe {recipe}: building model.class_path {class_path} needs Lightning ({err})"
        ) from None
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model", required=True)
    try:
        cfg = parser.parse_object({"model": {"class_path": class_path, "init_args": dict(init_args)}})
    except Exception as err:  # noqa: BLE001 - jsonargparse's ArgumentError, or the class module's import error
        raise ValueError(
            f"--recipe {recipe}: model.class_path {class_path} cannot be built: {_parser_reason(err)}"
            + (
                " (put its folder on PYTHONPATH, or run calibrate from it as fit runs)"
                if "No module named" in str(err)
                else ""
            )
        ) from None
    try:
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        module = instantiate(cfg).model
    except Exception as err:  # noqa: BLE001 - the class's own __init__
        raise ValueError(
            f"--recipe {recipe}: cannot measure {class_path}: building it with its init_args failed "
            f"({type(err).__name__}: {err})"
        ) from None
    return module, notes


def _find_spec(name: str) -> Any:
    import importlib.util

    try:
        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _parser_reason(err: BaseException) -> str:
    """jsonargparse's reason in one line: the first error of its union (not the None alternative)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.startswith("- ") and "NoneType" not in line:
            reason = line[2:]
            if reason.endswith(":") and i + 1 < len(lines) and not lines[i + 1].startswith("- "):
                reason = f"{reason} {lines[i + 1]}"
            return reason
    return lines[0] if lines else repr(err)


def _read_shards(recipe: str | None, train_shards: Any, patch: Sequence[int]) -> dict[str, Any]:
    """The training shards' distinct latent shapes, longest text, text width and dtype (from their index and
    their first samples), as the DataModule would read them.

    Raises:
        ValueError: the shards cannot be read; names the recipe's key and what to give instead.
    """
    from lightning_adaptiveload.loading.datamodule_inputs import binary_index_of
    from lightning_adaptiveload.planning.inputs import distinct_shapes
    from lightning_adaptiveload.shards.index import ShardIndex
    from lightning_adaptiveload.shards.reader import iter_shard

    try:
        binary = binary_index_of(train_shards)
        if binary is not None:
            from lightning_adaptiveload.shards.compact import load_checked_compact

            index = load_checked_compact(binary, patch_size=tuple(patch), on_error="raise")
            text_len = int(index.columns.text_len.max()) if index.num_samples else 0
        else:
            index = ShardIndex.for_paths(train_shards, patch_size=tuple(patch), progress=False)
            text_len = max((t for s in index.shards for t in s.text_lengths), default=0)
        shapes = sorted({tuple(int(d) for d in s) for s in distinct_shapes(index)})
        text_dim, dtype = None, "float16"
        if index.num_shards:
            for i, sample in enumerate(iter_shard(index.shards[0], 0, patch_size=tuple(patch))):
                dtype = str(sample["latent"].dtype).replace("torch.", "")
                if sample.get("text") is not None:
                    text_dim = int(sample["text"].shape[-1])
                    break
                if i >= 15:
                    break
    except (OSError, ValueError) as err:
        raise ValueError(
            f"--recipe {recipe}: data.init_args.train_shards {train_shards!r} cannot be read ({err}); give --mix, "
            "--shapes or --seq-lens, or a data.init_args.synthetic block"
        ) from None
    if not shapes:
        raise ValueError(f"--recipe {recipe}: data.init_args.train_shards {train_shards!r} holds no sample")
    return {"shapes": shapes, "text_len": text_len, "text_dim": text_dim, "dtype": dtype}
