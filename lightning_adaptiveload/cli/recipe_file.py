"""The one reader of a user's recipe and other text files on the command line, with one set of limits.

Every command reads the YAML (or JSON, or plain text) a user names through this module: ``fit --config``
and the other training commands (before jsonargparse sees the file, and jsonargparse's own YAML parsing
through :func:`parser_loader`), ``calibrate --recipe``, ``simulate --times`` and the hints of a failed run.
A file is read as untrusted input:

- it must be a regular file: a FIFO, a device, a socket or a directory is refused, naming the path, before
  anything waits on it (a FIFO is opened without blocking, and its type checked on the open descriptor);
- at most :data:`MAX_FILE_BYTES` bytes, UTF-8;
- its YAML nests at most :data:`MAX_YAML_DEPTH` levels, and its values, with every alias (``*name``)
  expanded, number at most :data:`MAX_YAML_VALUES`: an alias bomb (a "billion laughs", a few hundred bytes
  that expand to 9^9 values when printed or copied) is refused from its events, in linear time, before a
  value is built; so is an alias used inside its own anchor (a value that contains itself).

Every error is a :class:`RecipeFileError` (a ``ValueError``) that names the file (or the flag that gave
it), the line where YAML gives one, and what to do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

from lightning_adaptiveload.shards.textfile import file_kind

__all__ = [
    "MAX_FILE_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_VALUES",
    "RecipeFileError",
    "check_config_files",
    "check_regular",
    "check_yaml",
    "load_yaml",
    "parser_loader",
    "read_json",
    "read_text",
    "read_yaml",
]

#: The largest file read: a recipe is a page of YAML, a cost model a few lines of JSON.
MAX_FILE_BYTES = 1 << 20
#: The most values one YAML document may hold once its aliases are expanded (keys, values and the
#: mappings and lists themselves each count one).
MAX_YAML_VALUES = 1 << 16
#: The deepest nesting of mappings and lists in one YAML document.
MAX_YAML_DEPTH = 64

# The flags of the training commands whose value may name a YAML file that jsonargparse then reads.
_FILE_FLAGS = ("--config", "--trainer", "--model", "--data", "--optimizer", "--lr_scheduler")


class RecipeFileError(ValueError):
    """A file that cannot be read as a recipe (or other input text); the message names it and says why."""


# What a non-regular file is, in words: the one test, shared with the bounded text readers of tools/.
_kind = file_kind


def check_regular(path: str | os.PathLike, *, what: str | None = None) -> None:
    """Refuse ``path`` where it exists and is not a regular file (a FIFO, device, socket or directory), for
    a file that a tool reads itself (a mix, a step-time trace), before the tool opens it and waits.

    Raises:
        RecipeFileError: naming the path and what it is.
    """
    try:
        info = os.stat(path)
    except OSError:
        return  # no such file: the tool's own reader says so, with its own advice
    kind = _kind(info.st_mode)
    if kind is not None:
        raise RecipeFileError(
            f"{what or os.fspath(path)}: is {kind}, not a regular file; give the path of a file"
        )


def read_text(path: str | os.PathLike, *, what: str | None = None, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The text of the regular file ``path``: at most ``max_bytes`` bytes of UTF-8.

    Args:
        path: the file.
        what: how the messages name it (``"--recipe cal.yaml"``); default: the path.
        max_bytes: the largest size read.

    Raises:
        RecipeFileError: no such file, not a regular file (a FIFO, device, socket or directory: refused
            without waiting on it), larger than ``max_bytes``, unreadable or not UTF-8.
    """
    name = what or os.fspath(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer before its type is known.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise RecipeFileError(f"{name}: no such file; check the path") from None
    except OSError as err:
        raise RecipeFileError(f"{name}: cannot be opened ({err.strerror or err})") from None
    try:
        info = os.fstat(fd)
        kind = _kind(info.st_mode)
        if kind is not None:
            raise RecipeFileError(f"{name}: is {kind}, not a regular file; give the path of a file")
        if info.st_size > max_bytes:
            raise RecipeFileError(
                f"{name}: {info.st_size} bytes, more than the {max_bytes} a recipe may have; is it the right file?"
            )
        os.set_blocking(fd, True)
        with open(fd, "rb", closefd=False) as f:
            raw = f.read(max_bytes + 1)
    except OSError as err:
        raise RecipeFileError(f"{name}: cannot be read ({err.strerror or err})") from None
    finally:
        os.close(fd)
    if len(raw) > max_bytes:  # it grew since it was looked at
        raise RecipeFileError(
            f"{name}: more than the {max_bytes} bytes a recipe may have; is it the right file?"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise RecipeFileError(
            f"{name}, line {line}: not UTF-8 text ({err.reason} at byte {err.start})"
        ) from None


def _safe_loader() -> type:
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _line(mark: Any) -> str:
    return f", line {mark.line + 1}" if mark is not None else ""


def check_yaml(
    text: str,
    source: str = "the YAML",
    *,
    max_values: int = MAX_YAML_VALUES,
    max_depth: int = MAX_YAML_DEPTH,
) -> None:
    """Refuse YAML that would explode or recurse when loaded, from its parse events (no value is built).

    Counts every value once per time an alias makes it appear (linear in the text: an anchor's expanded
    size is remembered), and the nesting depth.

    Raises:
        RecipeFileError: more than ``max_values`` values with the aliases expanded, an alias inside its own
            anchor, nesting deeper than ``max_depth``, or YAML that does not parse (each naming ``source``
            and the line).
    """
    import yaml

    sizes: dict[str, int] = {}  # anchor -> its node's values, aliases expanded
    stack: list[tuple[str | None, int]] = []  # the open collections: (anchor, total values when it opened)
    total = 0
    try:
        for event in yaml.parse(text, Loader=_safe_loader()):
            if isinstance(event, yaml.AliasEvent):
                if any(anchor == event.anchor for anchor, _ in stack):
                    raise RecipeFileError(
                        f"{source}{_line(event.start_mark)}: the alias *{event.anchor} is used inside its own "
                        f"anchor &{event.anchor} (a value that contains itself); write the values out"
                    )
                total += sizes.get(event.anchor, 1)  # an unknown alias: the loader names it below
            elif isinstance(event, yaml.ScalarEvent):
                total += 1
                if event.anchor is not None:
                    sizes[event.anchor] = 1
            elif isinstance(event, yaml.CollectionStartEvent):
                total += 1
                stack.append((event.anchor, total - 1))
                if len(stack) > max_depth:
                    raise RecipeFileError(
                        f"{source}{_line(event.start_mark)}: nested too deeply (more than {max_depth} levels "
                        "of mappings and lists) to be a recipe"
                    )
            elif isinstance(event, yaml.CollectionEndEvent):
                anchor, before = stack.pop()
                if anchor is not None:
                    sizes[anchor] = total - before
            elif isinstance(event, yaml.DocumentStartEvent):
                total, sizes = 0, {}  # each document is loaded on its own
            if total > max_values:
                raise RecipeFileError(
                    f"{source}{_line(event.start_mark)}: its aliases (*name) expand to more than {max_values} "
                    "values (an alias bomb?); write the values out"
                )
    except yaml.YAMLError as err:
        raise _yaml_error(source, err) from None


def _yaml_error(source: str, err: Exception) -> RecipeFileError:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    if "nesting depth" in problem:  # libyaml's own bound, met while it reads ahead of the events
        return RecipeFileError(f"{source}{_line(mark)}: nested too deeply ({problem}) to be a recipe")
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    return RecipeFileError(
        f"{source}{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")
    )


def load_yaml(text: str, source: str = "the YAML") -> Any:
    """``text`` as YAML (safe types only), after :func:`check_yaml`'s limits.

    Raises:
        RecipeFileError: as :func:`check_yaml`, or YAML that does not load (naming ``source`` and the line).
    """
    import yaml

    check_yaml(text, source)
    try:
        return yaml.load(text, Loader=_safe_loader())  # noqa: S506 - a SafeLoader
    except yaml.YAMLError as err:
        raise _yaml_error(source, err) from None


def read_yaml(path: str | os.PathLike, *, what: str | None = None, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """The YAML document of the file ``path``, read by :func:`read_text` and loaded by :func:`load_yaml`.

    Raises:
        RecipeFileError: as :func:`read_text` and :func:`load_yaml`.
    """
    name = what or os.fspath(path)
    return load_yaml(read_text(path, what=name, max_bytes=max_bytes), name)


def read_json(path: str | os.PathLike, *, what: str | None = None, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """The JSON value of the file ``path``, read by :func:`read_text`.

    Raises:
        RecipeFileError: as :func:`read_text`, or text that is not JSON (naming the line).
    """
    import json

    name = what or os.fspath(path)
    text = read_text(path, what=name, max_bytes=max_bytes)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise RecipeFileError(
            f"{name}, line {err.lineno}, column {err.colno}: not valid JSON: {err.msg}"
        ) from None
    except RecursionError:
        raise RecipeFileError(f"{name}: nested too deeply to be read") from None


def parser_loader(text: str) -> Any:
    """The YAML loader of the training commands' parser (jsonargparse): its own YAML reading, after
    :func:`check_yaml`'s limits, so that a recipe, an inline ``--config`` and every flag's value are held to
    them too."""
    from jsonargparse import get_loader

    check_yaml(text, "the recipe")
    return get_loader("yaml")(text)


def _file_values(argv: Sequence[str]) -> Iterable[tuple[str, str]]:
    """``(flag, value)`` of every flag of ``argv`` whose value jsonargparse may read as a file."""
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag not in _FILE_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(argv):
                continue
            value = argv[i + 1]
        yield flag, value


def check_config_files(argv: Sequence[str]) -> None:
    """Read every file the command line gives jsonargparse to read (``--config FILE``, and ``--trainer``,
    ``--model``, ``--data``, ``--optimizer``, ``--lr_scheduler`` given a file) through :func:`read_yaml`,
    so that a FIFO, a device, a huge file or an alias bomb is refused, naming it, before the parser opens it.
    A value that names no file (inline YAML, a class name) is left to the parser.

    Raises:
        RecipeFileError: the first file refused.
    """
    for flag, value in _file_values(argv):
        if "\n" in value or not os.path.lexists(value):
            continue
        read_yaml(value, what=f"{flag} {value}")
