"""The batch sizing rule, torch-free: tokens per sample, and the batch size of a latent shape.

A batch holds B samples of one latent shape (C, T, H, W). With S tokens per sample
(:func:`tokens_per_sample`), a :class:`BatchSizer` gives

- ``sizing="equal_tokens"``: ``B = floor(max_tokens / S)``;
- ``sizing="dual"``: ``B = max(1, min(floor(max_tokens / S), floor((max_compute - c0) / cost(S))))``
  (``c0``: the cost model's per-step constant, 0 unless fitted to packs);

and ``B = 0`` for an *oversize* shape (``S > max_tokens``). The ``"auto"`` compute cap is
:meth:`BatchSizer.auto_max_compute`. This module is the one place of the rule: the batcher's pipeline
stage (:mod:`.batching`, torch) and the epoch planner (:mod:`.planner`, no torch) both size batches here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from lightning_adaptiveload.planning.cost_model import CostModel

__all__ = ["SIZINGS", "BatchSizer", "BucketSize", "tokens_per_sample"]

#: The sizing rules of a batch (``BatchSizer.sizing``, ``Batching.sizing``).
SIZINGS = ("dual", "equal_tokens")
# Relative slack on the compute cap: the "auto" cap is itself a batch cost, and floor(cap / cost) must
# not lose a sample to the last bit of a float division.
_COMPUTE_RTOL = 1e-9


def _patch(patch_size: Sequence[int]) -> tuple[int, int, int]:
    try:
        patch = tuple(int(x) for x in patch_size)
    except (TypeError, ValueError):
        patch = ()
    if len(patch) != 3 or min(patch) < 1:
        raise ValueError(f"patch_size must be 3 positive ints (pt, ph, pw), got {patch_size!r}")
    return patch  # type: ignore[return-value]


def _is_positive_int(value: Any) -> bool:
    """Whether ``value`` is an integer (an int, a NumPy integer or an integral float) of at least 1."""
    if isinstance(value, bool):
        return False
    try:
        return int(value) == value and int(value) >= 1
    except (TypeError, ValueError, OverflowError):
        return False


def tokens_per_sample(latent_shape: Sequence[int], patch_size: Sequence[int] = (1, 2, 2)) -> int:
    """Tokens of one sample: ``(T / pt) * (H / ph) * (W / pw)`` for a latent (C, T, H, W).

    Args:
        latent_shape: (C, T, H, W); a 3-tuple (T, H, W) is accepted too.
        patch_size: (pt, ph, pw).

    Raises:
        ValueError: wrong number of dims, non-positive sizes, or T, H, W not divisible by the patch;
            the message names the shape and the patch size.
    """
    shape = tuple(int(x) for x in latent_shape)
    patch = _patch(patch_size)
    if len(shape) == 4:
        shape = shape[1:]
    if len(shape) != 3 or min(shape) < 1:
        raise ValueError(f"latent shape {list(latent_shape)} must be (C, T, H, W) with every size >= 1")
    t, h, w = shape
    pt, ph, pw = patch
    if t % pt or h % ph or w % pw:
        raise ValueError(
            f"latent shape {list(latent_shape)} is not divisible by patch size {list(patch)}: T, H, W must be "
            "multiples of (pt, ph, pw); crop or pad the latent, or use the model's patch size"
        )
    return (t // pt) * (h // ph) * (w // pw)


class BucketSize(NamedTuple):
    """The sizes of one latent shape: tokens per sample and samples per batch."""

    seq_len: int  # S, tokens per sample
    batch_size: int  # B, samples per batch; 0 for an oversize shape (S > max_tokens)


@dataclass(frozen=True)
class BatchSizer:
    """Batch sizes under a token cap and (``sizing="dual"``) a compute cap.

    Args:
        max_tokens: token cap per batch (``B * S <= max_tokens``); also the largest sample allowed.
        sizing: ``"dual"`` or ``"equal_tokens"``.
        max_compute: compute cap per batch in the cost model's unit (``B * cost(S) <= max_compute``). With
            ``sizing="dual"`` None means not fixed yet ("auto" before :meth:`auto_max_compute` is applied):
            sizing a shape within the token cap then raises. Dropped (None) with ``sizing="equal_tokens"``.
        cost_model: the cost of one sample of S tokens.
        patch_size: (pt, ph, pw) of the model.

    Example:
        >>> BatchSizer(4096, sizing="equal_tokens").size((16, 1, 8, 12))
        BucketSize(seq_len=24, batch_size=170)
    """

    max_tokens: int
    sizing: str = "dual"
    max_compute: float | None = None
    cost_model: CostModel = field(default_factory=CostModel.default)
    patch_size: tuple[int, int, int] = (1, 2, 2)
    _cache: dict[tuple[int, ...], BucketSize] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        # The one check of these settings (max_tokens, sizing, patch_size, a numeric max_compute), whether they
        # come through Batching, DualConstraintBatcher or this class.
        if self.sizing not in SIZINGS:
            raise ValueError(f"sizing must be one of {SIZINGS}, got {self.sizing!r}")
        max_tokens = self.max_tokens
        if not _is_positive_int(max_tokens):
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        object.__setattr__(self, "max_tokens", int(max_tokens))
        object.__setattr__(self, "patch_size", _patch(self.patch_size))
        cap = self.max_compute
        if self.sizing != "dual":
            cap = None
        elif cap is not None:
            value = float(cap) if isinstance(cap, numbers.Real) and not isinstance(cap, bool) else math.nan
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"max_compute must be a positive number, got {cap!r}")
            cap = value
        object.__setattr__(self, "max_compute", cap)

    def size(self, latent_shape: Sequence[int]) -> BucketSize:
        """(S, B) of a latent shape (C, T, H, W); B = 0 when S > max_tokens. Cached per shape.

        Raises:
            ValueError: the shape does not fit the patch, or (``dual``) the compute cap is not fixed yet
                or the cost is not positive at S.
        """
        shape = tuple(int(x) for x in latent_shape)
        hit = self._cache.get(shape)
        if hit is not None:
            return hit
        s = tokens_per_sample(shape, self.patch_size)
        if s > self.max_tokens:
            out = BucketSize(s, 0)
        else:
            b = self.max_tokens // s
            if self.sizing == "dual":
                if self.max_compute is None:
                    raise ValueError(
                        "max_compute='auto' is not resolved yet: call batcher.resolve_max_compute(latent_shapes) "
                        "with the data set's shapes (the DataModule and plan_epoch do it from the index)"
                    )
                c = self.cost_model.cost(s)
                if not c > 0:
                    self.cost_model.check_positive([s])
                # A step of B samples costs c0 + B * cost(S) (the pack cost model): the per-step constant
                # comes off the cap once, as in satisfies(); a single sample is always allowed.
                room = self.max_compute * (1 + _COMPUTE_RTOL) - self.cost_model.c0
                b = max(1, min(b, math.floor(room / c)))
            out = BucketSize(s, b)
        self._cache[shape] = out
        return out

    def satisfies(self, batch_size: int, seq_len: int) -> bool:
        """Whether a batch of ``batch_size`` samples of ``seq_len`` tokens meets the constraints.

        ``B * S <= max_tokens`` and (dual) ``B * cost(S) <= max_compute``, except that a single sample
        (B = 1) within the token cap is always allowed.
        """
        if batch_size < 1 or batch_size * seq_len > self.max_tokens:
            return False
        if self.sizing != "dual" or batch_size == 1:
            return True
        if self.max_compute is None:
            raise ValueError("max_compute='auto' is not resolved yet: call resolve_max_compute first")
        return self.cost_model.batch_cost(batch_size, seq_len) <= self.max_compute * (1 + _COMPUTE_RTOL)

    def auto_max_compute(self, latent_shapes: Iterable[Sequence[int]]) -> float:
        """The ``"auto"`` compute cap of a data set: the compute of its cheapest full bucket at the token cap.

        ``min over the distinct buckets b of floor(max_tokens / S_b) * cost(S_b)``, over the buckets that fit
        the token cap (whatever this sizer's own ``max_compute``).

        Raises:
            ValueError: no shape fits the token cap, or the cost is not positive at some length.
        """
        lens = {tokens_per_sample(s, self.patch_size) for s in set(tuple(x) for x in latent_shapes)}
        fitting = sorted(s for s in lens if s <= self.max_tokens)
        if not fitting:
            raise ValueError(
                f"max_compute='auto' found no sample within max_tokens={self.max_tokens} (smallest has "
                f"{min(lens) if lens else 'no'} tokens); raise max_tokens"
            )
        self.cost_model.check_positive(fitting)
        return min(self.cost_model.batch_cost(self.max_tokens // s, s) for s in fitting)

    def oversize_message(
        self,
        latent_shape: Sequence[Any],
        seq_len: int,
        where: str = "",
        largest: int | None = None,
        over: str = "",
    ) -> str:
        """The error for a shape of ``seq_len`` tokens over ``max_tokens``; ``where`` names the sample.

        ``largest``: the most tokens of any sample in the data (the floor ``max_tokens`` must reach; default
        ``seq_len``); ``over``: how many are over the cap, in words (``"3 samples of 2 shapes"``)."""
        floor = max(seq_len, largest or 0)
        also = f" ({over} are over it; the largest has {floor} tokens)" if over else ""
        return (
            f"{where}latent shape {list(latent_shape)} has {seq_len} tokens, more than max_tokens={self.max_tokens}"
            f"{also}; raise max_tokens to at least {floor}, or set oversize='skip' to leave such samples out "
            "(counted)"
        )
