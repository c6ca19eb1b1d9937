"""The DataModule's loading settings: frozen, keyword-only values, each checked once where it is built.

:class:`Loader` is how batches are loaded (workers, pinned memory, the shard order's seed, text padding);
:class:`Source` is how shards are read and what an index may name. With
:class:`~lightning_adaptiveload.planning.settings.Batching` and
:class:`~lightning_adaptiveload.planning.settings.PlanSettings` they are what
:class:`~lightning_adaptiveload.datamodule.AdaptiveLoadDataModule` takes; a recipe nests them
(``data.init_args.loader.num_workers``). Pure Python (no Lightning, no torch).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.shards.objstore import RemoteSettings

__all__ = [
    "DATAMODULE_DEFAULTS",
    "DATAMODULE_GROUPS",
    "DataModuleGroups",
    "Loader",
    "OnError",
    "RemoteSettings",
    "Source",
    "StartMethod",
]

#: A bad shard or sample (index build and reading): ``"raise"`` or ``"skip"`` (left out, counted).
OnError = Literal["raise", "skip"]

#: How loader workers are started (``multiprocessing`` start methods).
StartMethod = Literal["fork", "forkserver", "spawn"]
START_METHODS = ("fork", "forkserver", "spawn")


@dataclass(frozen=True, kw_only=True)
class Loader:
    """How each rank loads its planned batches.

    Raises:
        ValueError: in ``__post_init__``, a value out of its range, naming the setting and the value.

    Example:
        >>> Loader(num_workers=0).num_workers
        0
    """

    num_workers: int = 2
    """DataLoader workers per rank (0: load in the training process)."""

    pin_memory: bool = False
    """DataLoader ``pin_memory``."""

    seed: int = 0
    """Seeds the shard order of every epoch (with the epoch number)."""

    text_pad_to: int | None = None
    """Pad every batch's text states to this length L (``text`` (B, L, D), ``text_mask`` (B, L)), for models
    without a text mask or for one shape under ``torch.compile``; a longer text is an error naming the
    sample. None: pad to the batch's longest text."""

    start_method: StartMethod | None = None
    """How the workers start: ``"fork"``, ``"forkserver"`` or ``"spawn"``. None: ``"forkserver"`` when a
    CPU (gloo) process group is up, where a fork at an epoch start can deadlock the new worker
    (``docs/data_path.md``, "Loader workers"), and the platform's default otherwise (fork on Linux). With
    ``"forkserver"`` or ``"spawn"`` a ``sample_transform`` must be picklable, and a script that starts
    training must do so under ``if __name__ == "__main__":``."""

    resume_unverified: bool = False
    """Resume from a saved data position that holds no digest the replay can check (a version 1 state, or
    one whose segment digests are all null), with a warning naming the batches that may be read twice or
    never if the seed, the settings or the planner changed since. False (the default): such a state is
    refused with a ``ResumeStateError`` naming the segment's ``digest``/``digests`` fields."""

    def __post_init__(self) -> None:
        if not isinstance(self.resume_unverified, bool):
            raise ValueError(f"resume_unverified must be True or False, got {self.resume_unverified!r}")
        workers = _integer(self.num_workers, "num_workers")
        if workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {self.num_workers!r}")
        object.__setattr__(self, "num_workers", workers)
        object.__setattr__(self, "seed", _integer(self.seed, "seed"))
        object.__setattr__(self, "pin_memory", bool(self.pin_memory))
        if self.text_pad_to is not None:
            pad = _integer(self.text_pad_to, "text_pad_to")
            if pad < 1:
                raise ValueError(
                    f"text_pad_to must be a positive number of text states or None, got {self.text_pad_to!r}"
                )
            object.__setattr__(self, "text_pad_to", pad)
        if self.start_method is not None and self.start_method not in START_METHODS:
            raise ValueError(
                f"start_method must be one of {', '.join(map(repr, START_METHODS))} or None, got "
                f"{self.start_method!r}"
            )

    def replace(self, **changes: Any) -> Loader:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, kw_only=True)
class Source:
    """How shards are read, and what a loaded ``index.json`` may name (the shard lists given to the
    DataModule are trusted as written).

    Raises:
        ValueError: in ``__post_init__``, a value out of its range, naming the setting and the value.
    """

    on_error: OnError = "raise"
    """A bad shard or sample (index build and reading): ``"raise"`` or ``"skip"``."""

    max_member_bytes: int | None = None
    """The largest shard member read, in bytes; a larger claim is refused (``member_too_large``) before
    anything is allocated. None: ``data.format.MAX_MEMBER_BYTES`` (1 GiB)."""

    index_allow_schemes: tuple[str, ...] = ()
    """URL schemes the shard paths in an ``index.json`` may name (e.g. ``("https",)``); by default an index
    names files in its own folder only, never ``pipe:`` (a ``pipe:`` source is taken only from the shard
    lists themselves)."""

    index_allow_outside: bool = False
    """Let an ``index.json`` name local shards outside its folder."""

    remote: RemoteSettings = dataclasses.field(default_factory=RemoteSettings)
    """How shards in object storage are read by byte range (concurrency, bytes in flight, read-ahead,
    merging, retries, a local cache): :class:`~lightning_adaptiveload.shards.objstore.RemoteSettings`; a
    recipe gives its fields as a mapping (``source.remote.max_concurrency``)."""

    def __post_init__(self) -> None:
        from lightning_adaptiveload.shards.format import check_on_error

        check_on_error(self.on_error)
        if self.max_member_bytes is not None:
            size = _integer(self.max_member_bytes, "max_member_bytes")
            if size < 1:
                raise ValueError(f"max_member_bytes must be a positive number of bytes or None, got {size!r}")
            object.__setattr__(self, "max_member_bytes", size)
        schemes = self.index_allow_schemes
        if isinstance(schemes, str) or not all(isinstance(s, str) for s in schemes or ()):
            raise ValueError(
                f"index_allow_schemes must be a list of URL schemes such as ['https'], got {schemes!r}"
            )
        object.__setattr__(self, "index_allow_schemes", tuple(schemes or ()))
        object.__setattr__(self, "index_allow_outside", bool(self.index_allow_outside))
        remote = self.remote
        if isinstance(remote, Mapping):
            fields = [f.name for f in dataclasses.fields(RemoteSettings)]
            unknown = sorted(set(remote) - set(fields))
            if unknown:
                raise ValueError(f"Source.remote: unknown key(s) {unknown}; RemoteSettings has {fields}")
            remote = RemoteSettings(**remote)
        if not isinstance(remote, RemoteSettings):
            raise ValueError(
                f"Source.remote must be a RemoteSettings or a mapping of its fields, got {remote!r}"
            )
        object.__setattr__(self, "remote", remote)

    def index_trust(self) -> dict[str, Any]:
        """What a loaded index may name, as ``ShardIndex.for_paths`` takes it."""
        return {
            "allow_schemes": self.index_allow_schemes,
            "allow_outside": self.index_allow_outside,
            "max_member_bytes": self.max_member_bytes,
        }

    def replace(self, **changes: Any) -> Source:
        """A copy with ``changes`` (validated again)."""
        return dataclasses.replace(self, **changes)


def _integer(value: Any, name: str) -> int:
    """``value`` as an int (a YAML or NumPy integer arrives as is), or a ValueError naming the setting."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if number != value:
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return number


@dataclass(frozen=True, kw_only=True)
class DataModuleGroups:
    """The settings groups of ``AdaptiveLoadDataModule``, with its defaults."""

    batching: Batching = dataclasses.field(default_factory=Batching)
    # Chunked planning is on by default in the DataModule (plan_epoch's own default plans at once).
    plan: PlanSettings = dataclasses.field(default_factory=lambda: PlanSettings(chunk_samples=500_000))
    loader: Loader = dataclasses.field(default_factory=Loader)
    source: Source = dataclasses.field(default_factory=Source)

    @classmethod
    def of(cls, given: Mapping[str, Any]) -> DataModuleGroups:
        """The groups of a DataModule call: those ``given`` (None or the default object itself: not given, the
        default; a dict: the group's fields, as a checkpoint's hyper-parameters and a recipe hold them).

        Raises:
            TypeError: a group that is neither its settings class, a dict of its fields nor None (the
                message names the group and its class), or a dict with a key that is no field of it.
        """
        groups = {}
        for name, value in given.items():
            if value is None or value is getattr(DATAMODULE_DEFAULTS, name):
                continue
            kind = DATAMODULE_GROUPS[name]
            if isinstance(value, Mapping):
                fields = [f.name for f in dataclasses.fields(kind)]
                unknown = sorted(set(value) - set(fields))
                if unknown:
                    raise TypeError(
                        f"AdaptiveLoadDataModule {name}: unknown key(s) {unknown}; {kind.__name__} has {fields}"
                    )
                value = kind(**value)
            elif not isinstance(value, kind):
                raise TypeError(
                    f"AdaptiveLoadDataModule {name}: expected a {kind.__name__} (or a dict of its fields), got "
                    f"{value!r}"
                )
            groups[name] = value
        return cls(**groups)

    def as_dict(self) -> dict[str, Any]:
        """The groups by name (the values themselves, not copies)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


#: The DataModule's default groups: its signature's default values (a group given is any other object).
DATAMODULE_DEFAULTS = DataModuleGroups()


#: The DataModule's settings groups: its parameter -> the settings class (a recipe nests them under these keys).
DATAMODULE_GROUPS: dict[str, type] = {
    "batching": Batching,
    "plan": PlanSettings,
    "loader": Loader,
    "source": Source,
}
