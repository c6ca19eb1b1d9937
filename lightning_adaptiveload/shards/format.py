"""The shard format's vocabulary: member names, limits, the REASONS table, ShardError, ShardInfo.

A shard is a plain tar file in the WebDataset layout: a sample is the run of members sharing a key
(the member name up to its first dot; keys contain no dots):

- ``<key>.latent.npy``: the VAE latent (C, T, H, W), float16 or float32; required;
- ``<key>.text.npy``: text-encoder states (L, D_text), float16 or float32; optional;
- ``<key>.json``: metadata, a JSON object; optional.

Everything the scan, reader, index, writer and commands agree on lives here: those member names, the
default patch size and member cap, the stable reason names of every problem (with what to do about
it), the :class:`ShardError` that carries them, the per-shard record of the index
(:class:`ShardInfo`), and the patch-size rules (token count, divisibility). See
``docs/data_format.md`` and ``docs/reliability.md``.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_PATCH",
    "IGNORED_REASONS",
    "INDEX_NAME",
    "INDEX_VERSION",
    "LATENT_EXT",
    "MAX_MEMBER_BYTES",
    "MEMBER_REASONS",
    "META_EXT",
    "PICKLE_SUFFIXES",
    "PatchSize",
    "REASONS",
    "ShardError",
    "ShardInfo",
    "TEXT_EXT",
    "check_on_error",
    "check_patch",
    "divisibility_problem",
    "patch_tokens",
]

INDEX_NAME = "index.json"
INDEX_VERSION = 1

LATENT_EXT = "latent.npy"
TEXT_EXT = "text.npy"
META_EXT = "json"
# Extensions whose usual decoders unpickle (torch.load, webdataset's .pyd/.pth handlers, pickle.load).
PICKLE_SUFFIXES = frozenset({"pth", "pt", "pyd", "pkl", "pickle", "ckpt"})
PatchSize = tuple[int, int, int]
# The default cap on a member's size, checked before anything is allocated for it. A Wan 2.1 latent of
# an 81-frame 480x832 clip is 4 MiB in float16; 1 GiB leaves room for long, high-resolution clips.
# Settable per call (``max_member_bytes=``, also on AdaptiveLoadDataModule).
MAX_MEMBER_BYTES = 1 << 30
DEFAULT_PATCH: PatchSize = (1, 2, 2)

# What each problem means for the user: reason -> what to do. The keys are the stable reason names used
# in ShardInfo.skipped, ShardIndex.counts() and iter_shard's stats.
REASONS: dict[str, str] = {
    "missing_shard": "check the path or pattern (under on_error='skip' the shard is counted and left out)",
    "unreadable_shard": "check the file's permissions or the URL",
    "empty_shard": "the shard holds no samples; remove it or regenerate it",
    "truncated_tar": "the file was cut short (interrupted copy or write): copy or write it again, or use "
    "on_error='skip' to keep the samples before the cut",
    "corrupt_tar": "shards must be plain, uncompressed tar files: re-create the shard",
    "missing_latent": "every sample needs a '<key>.latent.npy' member: add it or remove the sample",
    "bad_ndim": "latents are (C, T, H, W) and text states (L, D_text): re-export the sample",
    "bad_shape": "every latent dimension must be at least 1 (and D_text at least 1): re-export the sample",
    "not_divisible": "T, H and W must be multiples of the patch size (pt, ph, pw): crop or pad the latent, or "
    "use the model's patch size",
    "bad_dtype": "store float16 or float32 arrays (e.g. np.save(f, x.astype(np.float16))); object arrays "
    "need pickle, which is never loaded",
    "non_finite": "the array holds NaN or Inf: re-encode the sample or leave it out (on_error='skip')",
    "bad_npy": "the .npy member is corrupt: re-export it with numpy.save",
    "bad_json": "the .json member must be a UTF-8 JSON object: fix it or remove it",
    "duplicate_key": "keys must be unique in a data set: rename the samples (e.g. prefix the shard name), or "
    "use on_error='skip' to keep only the first occurrence",
    "pickle_member": "pickled members (.pth/.pt/.pyd/.pkl/.pickle/.ckpt) are never loaded: store arrays as "
    ".npy and metadata as .json, or use on_error='skip' to ignore such members",
    "stale_index": "the shard changed after it was indexed: rebuild the index "
    "(`lightning-adaptiveload index <shards> --rebuild`)",
    "shape_mismatch": "the shard holds another shape than its index lists (the shard changed after it was "
    "indexed, or the index was edited): rebuild the index (`lightning-adaptiveload index <shards> --rebuild`)",
    "unknown_extension": "members with other extensions are ignored",
    "non_file_member": "directories, links and other non-file members are ignored",
    "bad_member_name": "member names need a key and an extension ('<key>.<ext>'); others are ignored",
    "bad_key": "keys follow the writer's rules (no '/', '\\', '..', '.', control characters or leading '__'): "
    "rename the members, or use on_error='skip' to leave such samples out",
    "member_too_large": "a member claims more bytes than max_member_bytes allows: if the data is genuine, raise "
    "max_member_bytes (also on AdaptiveLoadDataModule); else re-create the shard",
    "sparse_member": "GNU sparse members (tar -S/--sparse) are not supported: re-create the shard without "
    "--sparse",
    "bad_index": "the index file is damaged or was edited by hand: rebuild it with "
    "`lightning-adaptiveload index <shards> --rebuild`",
    "unsafe_index_path": "an index may name shards inside its own folder only: rebuild the index there, list the "
    "shards yourself, or opt in with allow_outside=True / allow_schemes=[...] if you trust the index",
    "bad_range": "the storage answered a ranged read with other bytes than asked for (a short body, another "
    "Content-Range or length, or the whole file): serve the shards from a server with HTTP Range support, or "
    "check the proxy in between",
    "unreachable_shard": "the storage did not answer within RemoteSettings.retry_wait_s (Source.remote): check "
    "the URL, the network and the credentials, or raise the wait",
}
# Members ignored (counted, never an error); every other reason is a problem for the sample or shard.
IGNORED_REASONS = frozenset({"unknown_extension", "non_file_member", "bad_member_name"})
# Problems of an index file rather than of a shard.
_INDEX_REASONS = frozenset({"bad_index", "unsafe_index_path"})
#: Reasons that count members, not samples, in iter_shard's stats: ignored members, and members refused
#: under on_error="skip" (a pickle beside a good latent); the sample itself is still read.
MEMBER_REASONS = IGNORED_REASONS | {"pickle_member"}


class ShardError(ValueError):
    """A bad shard or sample: the message names the shard, the key and the problem, and what to do.

    Args:
        shard: the shard's path or URL (for ``bad_index``/``unsafe_index_path``: the index file).
        key: the sample key, or None when the problem concerns the whole shard.
        problem: what is wrong.
        reason: the stable reason name (a key of :data:`REASONS`), e.g. ``"non_finite"``.
        hint: what to do; defaults to ``REASONS[reason]``.
        member: the tar member (or, for an index, the entry such as ``shards[3].path``), if known.

    Attributes:
        shard, key, problem, reason, hint, member: as given.
    """

    def __init__(
        self,
        shard: str,
        key: str | None = None,
        problem: str | None = None,
        *,
        reason: str | None = None,
        hint: str | None = None,
        member: str | None = None,
    ) -> None:
        self.shard = str(shard)
        self.key = key
        self.problem = problem
        self.reason = reason
        self.member = member
        self.hint = hint if hint is not None else REASONS.get(reason or "")
        if problem is None and key is None:
            # A single preformatted message: torch's DataLoader re-raises worker exceptions as
            # ``type(exc)(message)``, which must not mangle the text.
            message = self.shard
        else:
            if reason in _INDEX_REASONS:
                where = f"index {self.shard}"
            else:
                where = f"shard {self.shard}" + (f", key {key!r}" if key is not None else " (whole shard)")
            if member is not None and member not in (problem or ""):  # details often name it already
                where += f", member {member!r}"
            message = f"{where}: {problem}" + (f" [{reason}]" if reason else "")
            if self.hint:
                message += f". What to do: {self.hint}"
        super().__init__(message)

    def __reduce__(self):
        return (
            _rebuild_shard_error,
            (self.shard, self.key, self.problem, self.reason, self.hint, self.member),
        )


def _rebuild_shard_error(shard, key, problem, reason, hint, member=None) -> ShardError:
    return ShardError(shard, key, problem, reason=reason, hint=hint, member=member)


def check_on_error(on_error: str) -> None:
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def check_patch(patch_size: Sequence[int] | None) -> PatchSize | None:
    if patch_size is None:
        return None
    ps = tuple(int(p) for p in patch_size)
    if len(ps) != 3 or any(p < 1 for p in ps):
        raise ValueError(f"patch_size must be three positive integers (pt, ph, pw), got {patch_size!r}")
    return ps  # type: ignore[return-value]


def patch_tokens(shape: Sequence[int], patch_size: Sequence[int]) -> int:
    _, t, h, w = shape
    pt, ph, pw = patch_size
    return (t // pt) * (h // ph) * (w // pw)


def divisibility_problem(shape: Sequence[int], patch_size: Sequence[int]) -> str | None:
    _, t, h, w = shape
    pt, ph, pw = patch_size
    bad = [
        f"{n}={v} is not a multiple of {p}" for n, v, p in (("T", t, pt), ("H", h, ph), ("W", w, pw)) if v % p
    ]
    if not bad:
        return None
    return f"latent shape {list(shape)} is not divisible by patch size {list(patch_size)} ({', '.join(bad)})"


@dataclass
class ShardInfo:
    """What the index knows of one shard.

    Attributes:
        path: the shard's path (absolute local path) or URL.
        keys: keys of the valid samples, in file order; a sample id is a position in this list.
        latent_shapes: (C, T, H, W) of each valid sample's latent.
        text_lengths: L of each sample's text states, 0 without text.
        num_bytes: the shard file's size in bytes (checked against the file to detect a stale index).
        skipped: samples (or the whole shard, key None) left out under ``on_error="skip"``:
            ``{"key": str | None, "reason": str, "detail": str}``.
        ignored: members ignored but counted, reason -> count (``unknown_extension``, ...).
        spans: each sample's ``(offset, length)`` in the tar, from its first member's header through its
            last member's padded data (what a ranged read fetches), or None when the index has none.
    """

    path: str
    keys: list[str]
    latent_shapes: list[tuple[int, int, int, int]]
    text_lengths: list[int]
    num_bytes: int
    skipped: list[dict[str, Any]] = field(default_factory=list)
    ignored: dict[str, int] = field(default_factory=dict)
    spans: list[tuple[int, int]] | None = None

    @property
    def num_samples(self) -> int:
        """Number of valid samples."""
        return len(self.keys)

    @property
    def empty(self) -> bool:
        """True when the shard holds no sample at all (neither valid nor skipped)."""
        return not self.keys and not self.skipped

    def drop_samples(self, positions: Collection[int], reason: str, details: dict[int, str]) -> None:
        for pos in sorted(positions):
            self.skipped.append({"key": self.keys[pos], "reason": reason, "detail": details[pos]})
        keep = [i for i in range(len(self.keys)) if i not in positions]
        self.keys = [self.keys[i] for i in keep]
        self.latent_shapes = [self.latent_shapes[i] for i in keep]
        self.text_lengths = [self.text_lengths[i] for i in keep]
        if self.spans is not None:
            self.spans = [self.spans[i] for i in keep]
