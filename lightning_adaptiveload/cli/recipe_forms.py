"""Recipes and command lines of the last release: the DataModule's flat keys nested into their groups.

``AdaptiveLoadDataModule`` took 27 flat keywords; it now takes a few settings groups, and a recipe nests
them (``data.init_args.batching.max_tokens``, ``data.init_args.plan.schedule``, ...). For one release a
recipe or a command line in the old form still runs: :func:`nest_recipe` and :func:`nest_flags` move
each old key into its group (``mode`` is ``batching.sizing``, ``plan_chunk_samples`` is
``plan.chunk_samples``) and warn once with a :class:`DeprecationWarning` that names the new keys. The
recipe loader of the package's LightningCLI (:func:`load_recipe_text`) calls :func:`nest_recipe` on every
config file it reads.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_adaptiveload.loading.settings import DATAMODULE_GROUPS, group_of_keyword

__all__ = [
    "PARSER_MODE",
    "load_recipe_text",
    "nest_data_args",
    "nest_flags",
    "nest_recipe",
    "register_loader",
    "show_deprecations",
]

#: The jsonargparse parser mode of the package's LightningCLI: YAML, read through :func:`nest_recipe`.
PARSER_MODE = "adaptiveload_yaml"
_FLAG_PREFIXES = ("--data.init_args.", "--data.")
_MESSAGE_START = "uses the flat DataModule keys"
_NULLS = ("null", "Null", "NULL", "~")


def nest_data_args(args: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data.init_args`` with the old flat keys moved into their groups, and those keys (in order).

    Raises:
        ValueError: a key given both flat and in its group (``max_tokens`` and ``batching.max_tokens``).
    """
    out: dict[str, Any] = {}
    nested: dict[str, dict[str, Any]] = {}
    moved: list[str] = []
    for key, value in args.items():
        where = group_of_keyword(key) if isinstance(key, str) else None
        if where is None:
            out[key] = value
        else:
            nested.setdefault(where[0], {})[where[1]] = value
            moved.append(key)
    for group, fields in nested.items():
        given = out.get(group)
        if given is None:
            out[group] = fields
            continue
        if not isinstance(given, Mapping):
            raise ValueError(f"data.init_args.{group} must be a mapping of its settings, got {given!r}")
        both = sorted(set(given) & set(fields))
        if both:
            raise ValueError(
                f"data.init_args.{group}.{both[0]} is given twice: also flat (the old form); keep "
                f"data.init_args.{group}.{both[0]} only"
            )
        out[group] = {**given, **fields}
    return out, moved


def nest_recipe(recipe: Any, where: str = "the recipe") -> Any:
    """``recipe`` (a parsed YAML document) with its ``data`` section in the nested form; warns once
    (:class:`DeprecationWarning`) when it held old flat keys. Anything but a recipe is returned as is."""
    if not isinstance(recipe, dict) or not isinstance(recipe.get("data"), dict):
        return recipe
    data = recipe["data"]
    if isinstance(data.get("init_args"), dict):
        args, moved = nest_data_args(data["init_args"])
        new_data = {**data, "init_args": args}
    elif "class_path" not in data:
        new_data, moved = nest_data_args(data)
    else:
        return recipe
    if not moved:
        return recipe
    _warn(where, [f"data.init_args.{k}" for k in moved])
    return {**recipe, "data": new_data}


def nest_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` with every old flat DataModule flag renamed to its nested form
    (``--data.init_args.mode=dual`` -> ``--data.init_args.batching.sizing=dual``); warns once when any was.

    A group's field set to null (``--data.init_args.batching.max_compute=null``, either form) is passed as
    ``--data.init_args.batching={"max_compute": null}``, which sets that field alone: jsonargparse (4.53)
    reads a null given to a nested dataclass field as the string ``"None"``.
    """
    out, moved, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        prefix = next((p for p in _FLAG_PREFIXES if arg.startswith(p)), None)
        if prefix is None:
            out.append(arg)
            continue
        name, eq, value = arg[len(prefix) :].partition("=")
        where = group_of_keyword(name) if "." not in name else None
        if where is not None:
            moved.append(f"{prefix.lstrip('-')}{name}")
        elif name.count(".") == 1 and name.split(".")[0] in DATAMODULE_GROUPS:
            where = (name.split(".")[0], name.split(".")[1])
        else:
            out.append(arg)
            continue
        if not eq and i < len(argv) and not argv[i].startswith("--"):
            value, eq = argv[i], "="
            i += 1
        group, field = where
        if eq and value.strip() in _NULLS:
            out.append(f"--data.init_args.{group}={json.dumps({field: None})}")
        else:
            out.append(f"--data.init_args.{group}.{field}{eq}{value}")
    if moved:
        show_deprecations()
        _warn("the command line", moved)
    return out


def load_recipe_text(text: str) -> Any:
    """jsonargparse's YAML loader, then :func:`nest_recipe` (the loader of :data:`PARSER_MODE`)."""
    from jsonargparse import get_loader

    return nest_recipe(get_loader("yaml")(text))


def register_loader() -> str:
    """Register :func:`load_recipe_text` as the loader of :data:`PARSER_MODE` with jsonargparse; returns
    the mode."""
    import yaml
    from jsonargparse import set_loader

    set_loader(PARSER_MODE, load_recipe_text, exceptions=(yaml.YAMLError,))
    show_deprecations()
    return PARSER_MODE


def show_deprecations() -> None:
    """Show this module's deprecation warnings on the command line (Python hides a DeprecationWarning raised
    outside ``__main__``); other deprecation warnings keep their filters."""
    warnings.filterwarnings("default", message=f".*{_MESSAGE_START}", category=DeprecationWarning)


def _warn(where: str, keys: list[str]) -> None:
    new = []
    for key in keys:
        name = key.rsplit(".", 1)[-1]
        group, field = group_of_keyword(name)  # type: ignore[misc]
        new.append(f"data.init_args.{group}.{field}")
    warnings.warn(
        f"{where} {_MESSAGE_START} of the last release ({', '.join(keys)}); they are deprecated "
        f"and will be removed in the next release: nest them as {', '.join(new)} (docs/recipes.md)",
        DeprecationWarning,
        stacklevel=3,
    )
