"""Model FLOPs of a training step without touching the model that trains.

The monitor knows no model: it takes a user's ``flops_fn(batch)``, the module's own ``flops_per_batch``
(for a diffusers Wan, :func:`~lightning_adaptiveload.models.wan_flops.wan_flops_per_batch` gives it), or an
analytic ``flops`` method; else:

- **Counted on a meta-device copy** (:func:`meta_training_flops`): ``FlopCounterMode`` runs over a copy of
  the LightningModule whose parameters are meta tensors (no memory, no arithmetic). Counting on the module
  that trains is what this avoids: in torch 2.13 a compiled module first called under ``FlopCounterMode``
  is never compiled afterwards, silently (see ``tests/monitor/test_flops.py``).

:class:`BatchFlops` picks the first way that works for a module (a user's function and the module's own
``flops_per_batch`` or analytic ``flops`` first) and gives each batch's FLOPs; the callback only calls it.

Training FLOPs are 3x the forward (forward + backward, model FLOPs: activation recomputation is not
counted), the convention of :func:`lightning_adaptiveload.stats.mfu`.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any
from unittest import mock

import torch

from lightning_adaptiveload import stats
from lightning_adaptiveload.stats import TRAINING_FLOPS_PER_FORWARD

__all__ = [
    "resolve_peak",
    "TRAINING_FLOPS_PER_FORWARD",
    "meta_copy",
    "meta_training_flops",
    "BatchFlops",
]


def _to_meta(value: Any) -> Any:
    if torch.is_tensor(value):
        return value.detach().to("meta")
    if isinstance(value, Mapping):
        return {k: _to_meta(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_meta(v) for v in value)
    return value


def meta_copy(module: torch.nn.Module, drop: Any = None) -> torch.nn.Module:
    """A copy of ``module`` whose parameters and buffers are meta tensors, with compilation removed.

    Only the module structure is copied (the weights are not, so this costs no memory for a large model).
    ``torch.compile`` wrappers are replaced by the modules they wrap and ``module.compile()`` is undone on
    the copy, so that running it never enters dynamo.

    Args:
        module: the module to copy.
        drop: an object the copy must not hold (its reference becomes None), e.g. the Trainer.
    """
    memo: dict[int, Any] = {}
    if drop is not None:
        memo[id(drop)] = None
    for t in list(module.parameters()) + list(module.buffers()):
        meta = t.detach().to("meta")
        if isinstance(t, torch.nn.Parameter):
            meta = torch.nn.Parameter(meta, requires_grad=t.requires_grad)
        memo[id(t)] = meta
    for sub in module.modules():
        inner = getattr(sub, "_orig_mod", None)  # torch.compile(module) -> OptimizedModule
        if isinstance(inner, torch.nn.Module) and type(sub).__name__ == "OptimizedModule":
            memo[id(sub)] = copy.deepcopy(inner, memo)
    clone = copy.deepcopy(module, memo)
    for sub in clone.modules():
        if getattr(sub, "_compiled_call_impl", None) is not None:  # nn.Module.compile()
            sub._compiled_call_impl = None
        if isinstance(getattr(sub, "_device", None), torch.device):
            # Lightning's `self.device`: tensors a step makes with device=self.device must be meta too.
            sub._device = torch.device("meta")
    return clone


class _TrainerView:
    """What a training step may read of the Trainer on the meta copy: counts and positions, nothing that acts.

    Collectives (``self.all_gather``), manual optimisation (``self.optimizers()`` goes through the strategy)
    and logging are out of reach: an attribute not listed raises ``AttributeError``, and the count gives up.
    """

    _READABLE = frozenset(
        {
            "world_size", "global_rank", "local_rank", "node_rank", "num_nodes", "num_devices",
            "is_global_zero", "current_epoch", "global_step", "max_epochs", "max_steps", "precision",
            "training", "sanity_checking", "optimizers", "accumulate_grad_batches", "datamodule",
        }
    )  # fmt: skip

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def __getattr__(self, name: str) -> Any:
        if name in _TrainerView._READABLE:
            return getattr(self._trainer, name)
        raise AttributeError(f"trainer.{name} is not available while FLOPs are counted on a meta copy")


def _quiet(*args: Any, **kwargs: Any) -> None:
    return None


class _MetaSafeGenerator(torch.Generator):
    """``torch.Generator`` that is a CPU generator when asked for the meta device, which has none.

    Stands in for ``torch.Generator`` while a step runs on a meta copy: a step that makes
    ``torch.Generator(device=x.device)`` from its inputs (meta there) would raise "META device type not an
    accelerator"; ``torch.randn(..., device="meta", generator=g)`` takes a CPU generator.
    """

    def __new__(cls, device: Any = None) -> _MetaSafeGenerator:
        where = None if device is None else torch.device(device)
        if where is not None and where.type == "meta":
            where = torch.device("cpu")
        return super().__new__(cls) if where is None else super().__new__(cls, where)

    def __init__(self, device: Any = None) -> None:  # the device was taken in __new__
        pass


def meta_training_flops(pl_module: Any, batch: Any, batch_idx: int = 0, clone: Any = None) -> float:
    """Training FLOPs (3x forward) of ``pl_module.training_step(batch)``, counted on a meta copy.

    The copy runs alone: its ``self.trainer`` answers only reads of counts and positions (world size,
    ranks, epoch, step, the optimizers' settings), ``self.log``, ``self.log_dict`` and ``self.print`` do
    nothing, ``torch.distributed`` reads as uninitialised (no collective can start on one rank only and
    hang the others), compiled code runs eagerly (``torch.compiler.set_stance("force_eager")``), gradients
    are off, a ``torch.Generator`` made for the meta device is a CPU one (the meta device has none; meta
    tensors draw from a CPU generator) and the random state is restored afterwards. The live module is not
    called.

    Args:
        pl_module: the LightningModule (or any module with ``training_step(batch, batch_idx)``).
        batch: the batch on its device; tensors are moved to meta (shapes kept).
        batch_idx: passed to ``training_step``.
        clone: a copy made earlier by :func:`meta_copy` (reused across batch shapes); None: make one.

    Returns:
        ``3 * forward FLOPs`` as counted by ``torch.utils.flop_counter.FlopCounterMode``.

    Raises:
        Exception: whatever the training step raises on meta tensors (``.item()``, data-dependent
            control flow): the caller decides what to do.
    """
    import torch.distributed as dist
    from torch.utils.flop_counter import FlopCounterMode

    trainer = getattr(pl_module, "_trainer", None)
    if clone is None:
        clone = meta_copy(pl_module, drop=trainer)
    for sub in clone.modules():
        if hasattr(sub, "_trainer"):  # the LightningModule (and any nested one)
            sub._trainer = None if trainer is None else _TrainerView(trainer)
            sub.log = sub.log_dict = sub.print = _quiet
    meta_batch = _to_meta(batch)
    with ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        stack.enter_context(torch.random.fork_rng(devices=[]))
        stack.enter_context(mock.patch.object(dist, "is_initialized", lambda: False))
        stack.enter_context(mock.patch.object(torch, "Generator", _MetaSafeGenerator))
        set_stance = getattr(torch.compiler, "set_stance", None)
        if set_stance is not None:
            stack.enter_context(set_stance("force_eager"))
        stack.enter_context(torch.no_grad())
        counter = stack.enter_context(FlopCounterMode(display=False))
        clone.training_step(meta_batch, batch_idx)
    return TRAINING_FLOPS_PER_FORWARD * float(counter.get_total_flops())


class BatchFlops:
    """The training FLOPs of each batch of a run, by the first way that works for the module.

    In order: the user's ``flops_fn(batch)``; the module's ``flops_per_batch`` (method or value); the
    analytic ``flops(batch_size, seq_len, text_len)`` of the first (sub)module that has one, times 3;
    else, with ``count_flops``, :func:`meta_training_flops` once per distinct batch shape
    (:meth:`before_step`). When no way works, ``warn`` is called once and every batch gives ``nan``.

    Args:
        pl_module: the LightningModule (or any module with ``training_step``).
        flops_fn: ``flops_fn(batch) -> float``, or None.
        count_flops: allow the count on a meta-device copy.
        warn: ``warn(key, message)``, e.g. a rank-zero warning issued once per key.

    Attributes:
        source: ``"flops_fn"``, ``"flops_per_batch"``, ``"analytic"``, ``"flop_counter"``
            or None (unknown).
    """

    def __init__(
        self,
        pl_module: Any,
        flops_fn: Callable[[Any], float] | None,
        count_flops: bool,
        warn: Callable[[str, str], None],
    ) -> None:
        self.flops_fn = flops_fn
        self.warn = warn
        self.source: str | None = None
        self._analytic: Any = None
        self._cache: dict[Any, float] = {}
        self._meta_clone: Any = None  # the meta-device copy FLOPs are counted on (no weights)
        self._step_key: Any = None
        self._resolve(pl_module, count_flops)

    def _resolve(self, pl_module: Any, count_flops: bool) -> None:
        if self.flops_fn is not None:
            self.source = "flops_fn"
            return
        if hasattr(pl_module, "flops_per_batch"):
            self.source = "flops_per_batch"
            return
        for module in pl_module.modules():  # the LightningModule first, then its submodules
            if callable(getattr(module, "flops", None)):
                self._analytic = module
                self.source = "analytic"
                return
        if count_flops:
            self.source = "flop_counter"  # FlopCounterMode on a meta copy
        else:
            self._unknown("count_flops=False")

    def _unknown(self, why: str) -> None:
        self.source = None
        self.warn(
            "flops",
            f"LoadBalanceMonitor: the model's FLOPs are unknown ({why}); TFLOP/s and MFU are not logged. "
            "Define `flops_per_batch(self, batch) -> float` (training FLOPs, 3x forward) on your "
            "LightningModule, or pass `LoadBalanceMonitor(flops_fn=...)`; for a diffusers Wan use "
            "`lightning_adaptiveload.models.wan_flops.wan_flops_per_batch(config, batch)`.",
        )

    def before_step(self, pl_module: Any, batch: Any, batch_idx: int) -> bool:
        """Count a new batch shape on the meta copy (never on the module that trains); True if it counted."""
        if self.source != "flop_counter":
            return False
        key = self._step_key = _shape_key(batch)
        if key in self._cache:
            return False
        try:
            if self._meta_clone is None:
                self._meta_clone = meta_copy(pl_module, drop=pl_module._trainer)
            self._cache[key] = meta_training_flops(pl_module, batch, batch_idx, clone=self._meta_clone)
        except Exception as err:  # any failure of a user's step on meta tensors: go without FLOPs
            self._meta_clone = None
            self._unknown(f"counting training_step on a meta-device copy failed: {type(err).__name__}: {err}")
            return False
        return True

    def __call__(self, pl_module: Any, batch: Any) -> float:
        """Training FLOPs of ``batch`` on this rank; ``nan`` when unknown."""
        if self.source is None:
            return math.nan
        if self.source == "flops_fn":
            return float(self.flops_fn(batch))  # type: ignore[misc]
        if self.source == "flops_per_batch":
            value = pl_module.flops_per_batch
            return float(value(batch) if callable(value) else value)
        if self.source == "analytic":
            args = _analytic_args(batch)
            if args not in self._cache:
                self._cache[args] = TRAINING_FLOPS_PER_FORWARD * float(self._analytic.flops(*args))
            return self._cache[args]
        # flop_counter: counted on the meta copy at the batch start
        return self._cache.get(self._step_key, math.nan)


def _shape_key(batch: Any) -> Any:
    """A hashable key of the tensor shapes in a batch (dicts, lists and tuples are walked; the rest ignored)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape  # torch.Size is a hashable tuple
    if isinstance(batch, Mapping):
        return tuple(
            (k, _shape_key(v))
            for k, v in batch.items()
            if isinstance(v, (torch.Tensor, Mapping, list, tuple))
        )
    if isinstance(batch, (list, tuple)):
        return tuple(_shape_key(v) for v in batch if isinstance(v, (torch.Tensor, Mapping, list, tuple)))
    return None


def _analytic_args(batch: Any) -> tuple[int, int, int]:
    if not isinstance(batch, Mapping) or "batch_size" not in batch or "seq_len" not in batch:
        raise ValueError(
            "LoadBalanceMonitor: the model's analytic `flops(batch_size, seq_len, text_len)` needs batches with "
            f"'batch_size' and 'seq_len' keys; got {type(batch).__name__}"
            + (f" with keys {sorted(map(str, batch))}" if isinstance(batch, Mapping) else "")
            + ". Pass `flops_fn=` to LoadBalanceMonitor instead."
        )
    text = batch.get("text")
    text_len = int(text.shape[1]) if isinstance(text, torch.Tensor) and text.ndim >= 2 else 0
    return int(batch["batch_size"]), int(batch["seq_len"]), text_len


def resolve_peak(
    peak_flops: float | None,
    device: torch.device,
    device_name: str,
    precision: Any,
    warn_once: Callable[[str, str], None],
) -> tuple[float, str | None]:
    """The dense peak FLOP/s of one device for MFU, and the dtype key it was looked up under: ``peak_flops``
    when given, NaN off CUDA; else :func:`lightning_adaptiveload.stats.peak_flops` for the trainer's
    ``precision`` (fp32 counts as tf32 unless matmul precision is "highest"). NaN, with one warning through
    ``warn_once(key, message)``, where the precision or the device is unknown."""
    if peak_flops is not None:
        return float(peak_flops), None
    if device.type != "cuda":
        return math.nan, None
    try:
        key = stats.normalize_dtype(precision)
    except ValueError:
        warn_once(
            "dtype",
            f"LoadBalanceMonitor: no peak FLOP/s for precision {precision!r}; "
            "MFU is not logged. Pass `peak_flops=` to set it.",
        )
        return math.nan, None
    if key == "fp32" and torch.get_float32_matmul_precision() != "highest":
        key = "tf32"
    peak = stats.peak_flops(device_name, key)
    if peak is None:
        warn_once(
            "peak",
            f"LoadBalanceMonitor: no peak FLOP/s known for {device_name!r} in {key}; MFU is not logged."
            " Pass `LoadBalanceMonitor(peak_flops=...)` (dense FLOP/s of one device) to set it.",
        )
        return math.nan, key
    return peak, key
