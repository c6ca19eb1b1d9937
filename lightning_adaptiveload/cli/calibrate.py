"""``lightning-adaptiveload calibrate``: the command line of :mod:`lightning_adaptiveload.tools.calibrate`.

Reads the recipe and the flags, calls :func:`~lightning_adaptiveload.tools.calibrate.calibrate` and writes
its YAML fragment (to stdout or ``--out``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from lightning_adaptiveload.tools.calibrate import PRECISIONS, calibrate, shape_for_seq_len
from lightning_adaptiveload.tools.calibrate_settings import (
    CalibratedTraining,
    CalibrateSettings,
    MemorySearch,
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
# activation_checkpointing); the others are top-level keys. The flat form of earlier releases is read too.
_MODEL_GROUPS = {
    "activation_checkpointing": "memory",
    "checkpoint_policy": "memory",
    "weight_dtype": "optimizer",
}
# The recipe's and the flags' settings of the measured step (CalibratedTraining's fields).
_TRAINING_KEYS = frozenset(f.name for f in dataclasses.fields(CalibratedTraining))


MAX_RECIPE_BYTES = 1 << 20  # a recipe is a page of YAML
MAX_RECIPE_VALUES = 1 << 16  # values after aliases (*name) are expanded: a "billion laughs" has 9^9


def _expanded_size(root: Any, limit: int) -> int | None:
    """How many values ``root`` holds with shared references counted each time (as a printer or a copy
    would walk them), or None beyond ``limit`` or when it holds itself. Linear in the distinct nodes."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if not isinstance(node, dict | list):
            continue
        children = list(node.values()) + list(node.keys()) if isinstance(node, dict) else node
        if done:
            open_.discard(id(node))
            total = 1 + sum(sizes.get(id(c), 1) for c in children)
            if total > limit:
                return None
            sizes[id(node)] = total
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_:
            return None  # a node that contains itself (&a [*a])
        open_.add(id(node))
        stack.append((node, True))
        stack.extend((c, False) for c in children if isinstance(c, dict | list) and id(c) not in sizes)
    return sizes.get(id(root), 1)


def _load_recipe(path: str) -> Any:
    """The recipe's YAML, read as untrusted text: a regular file of at most MAX_RECIPE_BYTES whose
    values, aliases expanded, number at most MAX_RECIPE_VALUES (an alias bomb is small on disk and
    explodes when printed or copied), nesting bounded."""
    import yaml

    from lightning_adaptiveload.shards.paths import open_regular

    try:
        with open_regular(path) as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as err:
        raise ValueError(f"--recipe {path}: cannot read it ({err})") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise ValueError(f"--recipe {path}: larger than {MAX_RECIPE_BYTES} bytes; is it a recipe?")
    try:
        recipe = yaml.safe_load(raw)
    except yaml.YAMLError as err:
        raise ValueError(f"--recipe {path}: not valid YAML ({err})") from None
    except RecursionError:
        raise ValueError(f"--recipe {path}: nested too deeply to be a recipe") from None
    if _expanded_size(recipe, MAX_RECIPE_VALUES) is None:
        raise ValueError(
            f"--recipe {path}: its aliases (*name) expand to more than {MAX_RECIPE_VALUES} values, or a value "
            "contains itself (an alias bomb?); write the values out"
        )
    return recipe


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
    for key in _MODEL_KEYS:
        group = args.get(_MODEL_GROUPS.get(key, ""))
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
    precision = _mapping(recipe.get("trainer"), path, "trainer").get("precision")
    if precision is not None:
        if not isinstance(precision, str | int):
            raise ValueError(
                f"--recipe {path}: trainer.precision must be a string, got {type(precision).__name__}"
            )
        precision = str(precision)
        out["precision"] = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}.get(precision, precision)
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-adaptiveload calibrate",
        description="Time the model per sequence length on this device, fit the cost model, find the token "
        "budget that fits the memory, and write a YAML fragment for a recipe.",
    )
    p.add_argument(
        "--recipe",
        help="read preset, model_overrides, activation_checkpointing, compile, weight_dtype, "
        "trainer.precision and the synthetic data's mix from this recipe (flags override it)",
    )
    p.add_argument("--preset", help="model preset: tiny, wan-1.3b, wan-14b (default wan-1.3b)")
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
    p.add_argument("--text-len", type=int, help="padded text length (default 512 for Wan, 16 for tiny)")
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
        default=True,
        help="time single samples and a designed set of packs at max_tokens through the packed forward, and "
        "fit c0 + alpha*S + beta*S^2 to all of them (default: on; --no-packs: per-sample fit of batch times)",
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
        if args.recipe:  # a packaged recipe by name, as `fit --config quickstart` takes it
            from lightning_adaptiveload.cli.fit import resolve_recipe

            args.recipe = resolve_recipe(args.recipe)
        settings = _recipe_defaults(args.recipe) if args.recipe else {}
        for key in (*_MODEL_KEYS, "precision", "checkpoint_blocks"):
            value = getattr(args, key)
            if value is not None:
                settings[key] = value
        settings.setdefault("preset", "wan-1.3b")
        recipe_mix = settings.pop("mix", None)
        recipe_text_len = settings.pop("text_len", None)
        shapes = args.shapes
        if args.seq_lens:
            from lightning_adaptiveload.models import VideoDiTConfig

            cfg = VideoDiTConfig.preset(settings["preset"], **(settings.get("model_overrides") or {}))
            shapes = [shape_for_seq_len(s, cfg.in_channels, cfg.patch_size) for s in args.seq_lens]
        training = CalibratedTraining(
            **{k: settings.pop(k) for k in list(settings) if k in _TRAINING_KEYS},
            device=args.device,
            ddp=args.ddp,
        )
        memory = MemorySearch(
            vram_fraction=args.vram_fraction,
            memory_budget_gb=args.memory_budget_gb,
            max_tokens=args.max_tokens,
            max_batch=args.max_batch,
        )
        measured = CalibrateSettings(
            shapes=shapes,
            mix=args.mix or (recipe_mix if shapes is None and not args.seq_lens else None),
            num_shapes=args.num_shapes,
            batch_sizes=args.batch_sizes,
            text_len=args.text_len if args.text_len is not None else recipe_text_len,
            warmup=args.warmup,
            repeats=args.repeats,
            kind=args.kind,
            max_compute=args.max_compute,
            seed=args.seed,
            packs=args.packs,
            training=training,
            memory=memory,
        )
        result = calibrate(
            settings.pop("preset"),
            settings.pop("model_overrides", None),
            measured,
            progress=not args.no_progress,
        )
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
            f"wrote {args.out}: max_tokens={result.max_tokens}, max_compute={result.max_compute}, "
            f"cost model {result.cost_model.describe()}; relative error mean "
            f"{100 * fit.get('mean_rel_error', float('nan')):.1f}%, max {100 * fit.get('max_rel_error', float('nan')):.1f}%",
            file=sys.stderr,
        )
    return 0
