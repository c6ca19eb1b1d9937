"""``lightning-adaptiveload calibrate``: measure the model on the target device, write a recipe fragment.

What it does, in order:

1. Builds the training model and its optimizer, whose state is allocated by one real step, so that memory
   is measured as in training. :func:`calibrate`: ``VideoDiTModule`` from a preset (overrides, precision,
   activation checkpointing, compile) and AdamW. :func:`calibrate_module`: any LightningModule (a recipe's
   ``model.class_path``, which the command line instantiates), built by its own ``configure_model`` and
   ``configure_optimizers`` outside a Trainer, and refused with the reason (before anything is measured)
   when one probe step of it cannot run.
2. **Token budget**: at the longest latent shape, finds the largest batch whose forward + backward peak
   memory stays within ``--vram-fraction`` of the device memory (doubling, then bisection; an
   out-of-memory error counts as "does not fit"), then checks that budget at the shortest shape and lowers
   it if needed. ``max_tokens = B * S`` of the largest fitting batch. On CUDA the peak is the allocator's
   ``max_memory_allocated``; on CPU it is an estimate (parameters, gradients and optimizer state plus the
   tensors autograd saves), which is what makes the command testable without a GPU.
3. **Timing**: forward + backward of the actual training step (:meth:`VideoDiTModule.compute_loss`, or a
   recipe's module's own ``training_step`` on the DataModule's batch dicts, and ``backward``; no optimizer
   step, whose cost does not depend on the batch) at every selected shape and
   batch size: ``--warmup`` untimed runs, then the median of ``--repeats`` timed runs (CUDA events on GPU).
   With packs (the default where the model takes them: ``VideoDiTModule``, or a module whose class sets
   ``runs_packed_batches = True``) the selected shapes are timed as single samples and a designed set of
   packs at ``max_tokens`` runs through the packed forward
   (:mod:`~lightning_adaptiveload.tools.calibrate_packs`: images, clips, clip + images, mixed shapes).
4. Fits :class:`~lightning_adaptiveload.planning.cost_model.CostModel`: with packs, ``c0 + sum alpha*S_i +
   beta*S_i^2`` to every step (:meth:`CostModel.fit_packs`; each point's relative error is reported, and
   whether the mean is within 5% and every point within 15%); without, per sample to the batch times.
   ``max_compute`` is resolved with the batcher's ``"auto"`` rule on the measured shapes, with the fitted
   model (``c0`` included), so that the ``dual`` batcher plans with what was measured.
5. Writes a YAML fragment for a second ``--config``::

       data:
         init_args:
           batching:
             max_tokens: ...
             max_compute: ...
             cost_model: {kind: quadratic, alpha: ..., beta: ..., gamma: ..., fit_info: {...}}

   preceded by a comment block recording the device, software, the model measured (class path and init
   args), precision, shapes, every timing and every memory probe.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import platform
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

import torch

from lightning_adaptiveload.tools.calibrate_bench import (
    Bench,
    CannotCalibrate,
    auto_checkpointing,
    physical_memory,
)
from lightning_adaptiveload.tools.calibrate_settings import (
    CalibratedTraining,
    CalibrateSettings,
    MemorySearch,
    ModuleBatches,
    Precision,
)

__all__ = [
    "PRECISIONS",
    "CannotCalibrate",
    "CalibratedTraining",
    "CalibrateSettings",
    "CalibrationResult",
    "MemorySearch",
    "ModuleBatches",
    "calibrate",
    "calibrate_module",
    "shape_for_seq_len",
]

PRECISIONS = get_args(Precision)
_GIB = 1024**3


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass
class Timing:
    """One timed point: ``seconds`` is the median forward + backward time of a batch of ``batch_size``."""

    latent_shape: tuple[int, int, int, int]
    seq_len: int
    batch_size: int
    seconds: float | None  # None: did not fit in memory
    runs: list[float] = field(default_factory=list)


@dataclass
class MemoryProbe:
    """One memory trial of the budget search (bytes; ``peak`` None when it ran out of memory)."""

    latent_shape: tuple[int, int, int, int]
    batch_size: int
    tokens: int
    peak: int | None
    fits: bool


@dataclass
class CalibrationResult:
    """Everything :func:`calibrate` measured, and the recipe values derived from it.

    Attributes:
        max_tokens: the token budget per batch (``data.init_args.batching.max_tokens``).
        max_compute: compute cap from the ``"auto"`` rule on the measured shapes, in the cost model's
            unit (seconds per batch), or ``"auto"`` when asked to leave it to the data module.
        cost_model: the fitted :class:`CostModel`.
        timings, probes: the raw measurements.
        info: device, software, model and settings, for the comment block.
        model: the module measured: ``class_path``, the ``init_args`` it was built with and its number of
            ``parameters`` (also in ``--results``).
    """

    max_tokens: int
    max_compute: float | str
    cost_model: Any
    timings: list[Timing]
    probes: list[MemoryProbe]
    info: dict[str, Any]
    points: list[Any] = field(default_factory=list)  # PackTiming: every fitted step, with its error
    model_args: dict[str, Any] = field(
        default_factory=dict
    )  # model.init_args to set (compile, auto checkpointing)
    model: dict[str, Any] = field(
        default_factory=dict
    )  # what was measured: class_path, init_args, parameters

    def to_results(self) -> dict[str, Any]:
        """Everything measured, as a plain dict for a results file (``--results``): the fragment, the
        settings, every fitted point with its prediction and relative error, the memory probes."""
        return {
            "model": dict(self.model),
            "info": dict(self.info),
            "fragment": self.fragment(),
            "fit": dict(self.cost_model.fit_info or {}),
            "points": [p.to_dict() for p in self.points],
            "timings": [
                {
                    "shape": "x".join(map(str, t.latent_shape)),
                    "seq_len": t.seq_len,
                    "batch_size": t.batch_size,
                    "seconds": t.seconds,
                    "runs": list(t.runs),
                }
                for t in self.timings
            ],
            "probes": [
                {
                    "shape": "x".join(map(str, p.latent_shape)),
                    "batch_size": p.batch_size,
                    "tokens": p.tokens,
                    "peak_bytes": p.peak,
                    "fits": p.fits,
                }
                for p in self.probes
            ],
        }

    def fragment(self) -> dict[str, Any]:
        """The recipe fragment as a dict (``{"data": {"init_args": {"batching": {...}}}}``, and ``model`` with compile or
        auto checkpointing)."""
        model = {"model": {"init_args": dict(self.model_args)}} if self.model_args else {}
        return {
            **model,
            "data": {
                "init_args": {
                    "batching": {
                        "max_tokens": int(self.max_tokens),
                        "max_compute": self.max_compute,
                        "cost_model": self.cost_model.to_dict(),
                    }
                }
            },
        }

    def to_yaml(self) -> str:
        """The fragment as YAML text with a comment block recording what was measured."""
        import yaml

        lines = ["# Written by `lightning-adaptiveload calibrate`; include with a second --config:"]
        lines.append("#   python -m lightning_adaptiveload fit --config RECIPE.yaml --config THIS.yaml")
        for key, value in self.info.items():
            lines.append(f"# {key}: {value}")
        lines.append("#")
        lines.append("# forward+backward of one training step (median), per (latent shape, batch size):")
        lines.append(f"#   {'latent (C,T,H,W)':<22} {'S':>7} {'B':>4} {'seconds':>10} {'tokens/s':>11}")
        for t in self.timings:
            shape = "x".join(map(str, t.latent_shape))
            if t.seconds is None:
                lines.append(f"#   {shape:<22} {t.seq_len:>7} {t.batch_size:>4} {'OOM':>10}")
            else:
                tps = t.batch_size * t.seq_len / t.seconds
                lines.append(
                    f"#   {shape:<22} {t.seq_len:>7} {t.batch_size:>4} {t.seconds:>10.5f} {tps:>11.0f}"
                )
        lines.append("#")
        lines.append("# memory probes (peak bytes of forward+backward with optimizer state):")
        for p in self.probes:
            shape = "x".join(map(str, p.latent_shape))
            peak = "OOM" if p.peak is None else f"{p.peak / _GIB:.3f} GiB"
            lines.append(
                f"#   {shape:<22} B={p.batch_size:<4} tokens={p.tokens:<8} {peak:>12}  {'fits' if p.fits else 'over'}"
            )
        fit = self.cost_model.fit_info or {}
        if self.points:
            lines.append("#")
            lines.append(
                "# fitted steps (packed: the packed forward; bucketed: one shape), measured vs model:"
            )
            lines.append(
                f"#   {'step':<22} {'path':<9} {'N':>4} {'tokens':>8} {'seconds':>10} {'model':>10} {'error':>8}"
            )
            for p in self.points:
                measured = "OOM" if p.seconds is None else f"{p.seconds:.5f}"
                model = "-" if p.predicted is None else f"{p.predicted:.5f}"
                err = "-" if p.rel_error is None else f"{100 * p.rel_error:+.1f}%"
                lines.append(
                    f"#   {p.name:<22} {p.path:<9} {len(p.seq_lens):>4} {sum(p.seq_lens):>8} {measured:>10} "
                    f"{model:>10} {err:>8}"
                )
        unit = "seconds per step (c0) and per sample" if self.cost_model.c0 else "seconds per sample"
        lines.append("#")
        lines.append(
            f"# cost model: {self.cost_model.describe()} {unit}; fit rmse {fit.get('rmse', float('nan')):.3g} s, "
            f"mean rel. error {100 * fit.get('mean_rel_error', float('nan')):.1f}%, "
            f"max {100 * fit.get('max_rel_error', float('nan')):.1f}%"
            + (
                ""
                if "meets_targets" not in fit
                else f" (targets mean <= 5%, max <= 15%: {'met' if fit['meets_targets'] else 'NOT met'})"
            )
        )
        body = yaml.safe_dump(self.fragment(), sort_keys=False, default_flow_style=False)
        return "\n".join(lines) + "\n" + body


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def shape_for_seq_len(seq_len: int, channels: int, patch: Sequence[int]) -> tuple[int, int, int, int]:
    """A latent shape (C, T, H, W) with exactly ``seq_len`` tokens for ``patch`` (for ``--seq-lens``)."""
    # One frame, the most square grid with seq_len tokens: only S matters to the cost.
    pt, ph, pw = patch
    h = max(d for d in range(1, int(math.isqrt(seq_len)) + 1) if seq_len % d == 0)
    return (channels, pt, h * ph, (seq_len // h) * pw)


def _select_shapes(
    shapes: list[tuple[int, int, int, int]], patch, num: int
) -> list[tuple[int, int, int, int]]:
    """Distinct shapes, one per token count, ``num`` of them spread evenly over the token range (the
    shortest and the longest always included)."""
    from lightning_adaptiveload.planning.sizing import tokens_per_sample

    by_tokens: dict[int, tuple[int, int, int, int]] = {}
    for s in shapes:
        by_tokens.setdefault(tokens_per_sample(s, patch), tuple(s))
    ordered = [by_tokens[k] for k in sorted(by_tokens)]
    if num <= 0 or num >= len(ordered):
        return ordered
    if num == 1:
        return [ordered[-1]]
    picks = sorted({round(i * (len(ordered) - 1) / (num - 1)) for i in range(num)})
    return [ordered[i] for i in picks]


def _largest_fitting_batch(
    bench: Bench, shape, seq_len: int, budget: int, max_batch: int, probes, bar, first: int = 1
) -> int:
    """Largest B <= max_batch with peak(shape, B) <= budget (0 if B = 1 does not fit). ``first`` is tried
    first: when it fits, the search goes up from there."""

    def fits(b: int) -> bool:
        peak = bench.peak_bytes(shape, b)
        ok = peak is not None and peak <= budget
        probes.append(MemoryProbe(tuple(shape), b, b * seq_len, peak, ok))
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"S={seq_len} B={b} {'fits' if ok else 'over'}")
        return ok

    # Invariant: B = lo fits (0 trivially), B = hi does not (max_batch + 1 by definition).
    lo, hi = 0, max_batch + 1
    b = max(1, min(first, max_batch))
    while True:  # gallop up from ``first``
        if not fits(b):
            hi = b
            break
        lo = b
        if b >= max_batch:
            return lo
        b = min(2 * b, max_batch)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


# --------------------------------------------------------------------------------------------------
# The calibration
# --------------------------------------------------------------------------------------------------


def calibrate(
    preset: str = "wan-1.3b",
    model_overrides: dict[str, Any] | None = None,
    settings: CalibrateSettings | None = None,
    *,
    progress: bool = True,
    timer: Callable[[list[tuple[int, int, int, int]]], float | None] | None = None,
) -> CalibrationResult:
    """Measure ``VideoDiTModule``'s model, fit the cost model and find the token budget; see the module docstring.

    A recipe's own LightningModule is measured by :func:`calibrate_module` instead.

    Args:
        preset, model_overrides: the model (``VideoDiTConfig.preset(preset, **model_overrides)``).
        settings: what to measure and fit (a
            :class:`~lightning_adaptiveload.tools.calibrate_settings.CalibrateSettings`, with the measured step's
            ``training`` and the budget's ``memory`` search); the fields are documented there.
        progress: show progress bars (stderr).
        timer: seconds of one step of the given latent shapes (None: out of memory), used instead of running
            the model for every timing; for tests and for timings taken elsewhere. The memory search
            still runs the model (skip it with ``settings.memory.max_tokens``).

    Returns:
        A :class:`CalibrationResult`; ``.to_yaml()`` is the fragment.

    Raises:
        ValueError: no settings, no CUDA for a CUDA device, a shape the model cannot take, or even one sample
            of the longest shape does not fit the budget (bad settings are rejected by the settings classes).
    """
    from lightning_adaptiveload.models.module import MemorySettings, OptimizerSettings, VideoDiTModule

    cfg_all = _settings(settings)
    run = cfg_all.training
    dev, precision, ddp = _resolve_device(run.device, run.precision, run.ddp)
    module = VideoDiTModule(
        preset=preset,
        model_overrides=model_overrides,
        optimizer=OptimizerSettings(weight_dtype=run.weight_dtype),
        memory=MemorySettings(
            activation_checkpointing=run.activation_checkpointing, checkpoint_policy=run.checkpoint_policy
        ),
        compile=run.compile,
    )
    cfg = module.model_config
    patch = cfg.patch_size
    all_shapes, mix_name = _shapes_to_measure(cfg_all.shapes, cfg_all.mix, cfg.in_channels, patch)
    text_len = cfg_all.text_len
    if text_len is None:
        text_len = 512 if cfg.text_dim == 4096 else 16

    torch.manual_seed(cfg_all.seed)
    module.configure_model()
    if precision == "bf16-true":
        module.model.to(torch.bfloat16)
    module.model.to(dev)
    module.model.train()
    bench = Bench(module, dev, precision, text_len, ddp, cfg_all.seed)
    chosen = _select_shapes(all_shapes, patch, cfg_all.num_shapes)
    bench.allocate_optimizer_state(chosen[0])

    def model_args_after_budget(max_tokens: int, budget: int, seq: dict) -> tuple[dict[str, Any], str | None]:
        memory_args, memory_note = (
            auto_checkpointing(bench, run.checkpoint_policy, chosen[-1], chosen[0], seq, max_tokens, budget)
            if run.checkpoint_blocks == "auto"
            else ({}, None)
        )
        # The fragment's model.init_args, in the module's settings groups (a second --config merges them).
        model_args: dict[str, Any] = {}
        if run.compile:  # what was measured: the fragment must not be trained eagerly by mistake
            model_args["compile"] = True
        if run.weight_dtype == "bf16":  # what was measured (its memory differs from fp32 weights')
            model_args["optimizer"] = {"weight_dtype": "bf16"}
        if memory_args:
            model_args["memory"] = {"activation_checkpointing": True, **memory_args}
        return model_args, memory_note

    init_args = {"preset": preset, "model_overrides": dict(model_overrides or {})}
    checkpointing = ("count per batch (auto)" if run.checkpoint_blocks == "auto" else
                     "every block" if run.activation_checkpointing else "off")  # fmt: skip
    return _measure(
        _Run(
            bench=bench,
            settings=cfg_all,
            all_shapes=all_shapes,
            mix_name=mix_name,
            patch=patch,
            device=dev,
            precision=precision,
            ddp=ddp,
            use_packs=cfg_all.packs is not False and cfg_all.kind == "quadratic",
            model={"class_path": VIDEO_DIT_MODULE, "init_args": init_args, "parameters": bench.num_params},
            model_info={
                "model": f"{preset} {json.dumps(model_overrides or {})} ({VIDEO_DIT_MODULE}, "
                f"{_parameters(bench.num_params)})",
                "precision": precision,
                "activation_checkpointing": run.activation_checkpointing,
                "compile": run.compile,
                "weight_dtype": run.weight_dtype,
                "checkpointing": f"{run.checkpoint_policy}, {checkpointing}",
                "text_len": text_len,
            },
            after_budget=model_args_after_budget,
        ),
        progress,
        timer,
    )


def calibrate_module(
    module: Any,
    settings: CalibrateSettings | None = None,
    batches: ModuleBatches | None = None,
    *,
    class_path: str | None = None,
    init_args: Mapping[str, Any] | None = None,
    notes: Mapping[str, str] | None = None,
    progress: bool = True,
    timer: Callable[[list[tuple[int, int, int, int]]], float | None] | None = None,
) -> CalibrationResult:
    """Measure any LightningModule through its own ``training_step``, fit the cost model, find the token budget.

    What :func:`calibrate` does for ``VideoDiTModule``, on a recipe's own module
    (:class:`~lightning_adaptiveload.tools.calibrate_bench.ModuleBench`): ``configure_model`` and
    ``configure_optimizers`` run outside a Trainer, then every timed step is the module's ``training_step``
    and the backward of the loss it returns, on the DataModule's batch dicts shaped by the data's latent
    shapes and ``batches`` (bucketed; packs too where the class sets ``runs_packed_batches = True``, as the
    DataModule asks). Before anything is measured, one probe step (one sample of the shortest shape, and a
    pack where packs are timed) must run and reach the parameters.

    Args:
        module: the LightningModule, as its recipe builds it (``configure_model`` not yet run).
        settings: what to measure and fit; its ``training`` group's model settings (activation checkpointing,
            compile, weight dtype, checkpoint policy and blocks) are ``VideoDiTModule``'s and must be left at
            their defaults: the module's own arguments say how it trains.
        batches: the batch contract's fields (patch size, text, dtype, the recipe's schedule); None: the
            defaults of :class:`~lightning_adaptiveload.tools.calibrate_settings.ModuleBatches`.
        class_path, init_args: how the recipe names the module, for the record (default: its class's import
            path, and no arguments).
        notes: more lines for the record (e.g. where the class was imported from).
        progress, timer: as for :func:`calibrate`.

    Returns:
        A :class:`CalibrationResult` whose record and ``model`` name the module that was measured.

    Raises:
        CannotCalibrate: (a ``ValueError``) the module cannot be measured: no ``training_step`` of its own,
            manual optimization, a hook or the probe step fails, packs asked of a module that does not take
            them; the message names the class and why.
        ValueError: bad settings, no CUDA for a CUDA device, or one sample of the longest shape does not fit.
    """
    from lightning_adaptiveload.planning.schedules import SCHEDULE_TYPES
    from lightning_adaptiveload.tools.calibrate_bench import ModuleBench, prepare_module

    cfg_all = _settings(settings)
    batches = batches if batches is not None else ModuleBatches()
    if not isinstance(batches, ModuleBatches):
        raise TypeError(f"calibrate_module: batches must be a ModuleBatches, got {type(batches).__name__}")
    name = class_path or f"{type(module).__module__}.{type(module).__qualname__}"
    run = cfg_all.training
    video_dit_only = {
        f.name: getattr(run, f.name)
        for f in dataclasses.fields(CalibratedTraining)
        if f.name in _VIDEO_DIT_TRAINING and getattr(run, f.name) != f.default
    }
    if video_dit_only:
        raise CannotCalibrate(
            f"calibrate: {', '.join(f'{k}={v!r}' for k, v in video_dit_only.items())} set VideoDiTModule's model, "
            f"but the model measured is {name}: set how it trains in its own init_args (the recipe's "
            "model.init_args) instead"
        )
    dev, precision, ddp = _resolve_device(run.device, run.precision, run.ddp)
    patch = batches.patch_size
    all_shapes, mix_name = _shapes_to_measure(cfg_all.shapes, cfg_all.mix, None, patch)
    takes_packs = bool(getattr(module, "runs_packed_batches", False))
    schedule = SCHEDULE_TYPES.get(batches.schedule) if batches.schedule else None
    if schedule is not None and schedule.always_packs and not takes_packs:
        raise CannotCalibrate(
            f"calibrate: cannot measure {name}: the recipe's schedule 'packed' gives every training step a pack, "
            f"but {type(module).__name__} does not set runs_packed_batches = True, so it cannot take them (the "
            "DataModule refuses it too): set data.init_args.plan.schedule to 'lockstep' or 'independent', or make "
            "its training_step take packs and set runs_packed_batches = True (docs/data_path.md, 'Packed batches')"
        )
    if cfg_all.packs is True and not takes_packs:
        raise CannotCalibrate(
            f"calibrate: cannot time packs of {name}: its class does not set runs_packed_batches = True, so its "
            "training_step takes bucketed batches only; leave packs to the model (--packs not given) or --no-packs"
        )
    use_packs = takes_packs and cfg_all.packs is not False and cfg_all.kind == "quadratic"
    if use_packs:
        packs_note = "timed through its training_step (runs_packed_batches = True)"
    elif not takes_packs:
        packs_note = f"not timed: {type(module).__name__} does not set runs_packed_batches = True (bucketed batches only)"
    else:
        packs_note = (
            "not timed (" + ("--no-packs" if cfg_all.packs is False else f"kind {cfg_all.kind}") + ")"
        )
    text_len = cfg_all.text_len
    if batches.text_dim is None:
        text_len = 0
    elif text_len is None:
        text_len = batches.text_pad_to or 16

    torch.manual_seed(cfg_all.seed)
    optimizers = prepare_module(module, dev, precision, name)
    bench = ModuleBench(module, dev, precision, ddp, cfg_all.seed, batches, text_len, optimizers, name)
    chosen = _select_shapes(all_shapes, patch, cfg_all.num_shapes)
    probe_pack = None
    if use_packs:
        distinct = _select_shapes(all_shapes, patch, 0)
        probe_pack = distinct[:2] if len(distinct) > 1 else distinct * 2
    bench.probe(chosen[0], probe_pack)
    bench.allocate_optimizer_state(chosen[0])
    text = "no text" if text_len == 0 else f"text {text_len} x {batches.text_dim}"
    if text_len and batches.text_pad_to:
        text += f" padded to {max(batches.text_pad_to, text_len)}"
    args_json = json.dumps(dict(init_args or {}), sort_keys=True, default=str)
    optimizer_names = ", ".join(type(o).__name__ for o in optimizers) or "none"
    return _measure(
        _Run(
            bench=bench,
            settings=cfg_all,
            all_shapes=all_shapes,
            mix_name=mix_name,
            patch=patch,
            device=dev,
            precision=precision,
            ddp=ddp,
            use_packs=use_packs,
            model={"class_path": name, "init_args": dict(init_args or {}), "parameters": bench.num_params},
            model_info={
                "model": f"{name} {args_json} ({_parameters(bench.num_params)})",
                **dict(notes or {}),
                "step": f"{type(module).__name__}.training_step + backward of its loss, outside a Trainer "
                "(one process; self.log off)",
                "batches": f"the DataModule's batch dicts: latents {batches.dtype}, {text}, patch "
                f"{list(patch)}; packs {packs_note}",
                "optimizer": f"{optimizer_names} (configure_optimizers; its state allocated by one step)",
                "precision": precision,
                "text_len": text_len,
            },
            after_budget=None,
            pack_path="its training_step",
        ),
        progress,
        timer,
    )


# The CalibratedTraining fields that set VideoDiTModule's model (a recipe's own module has its own).
_VIDEO_DIT_TRAINING = frozenset(
    {"activation_checkpointing", "checkpoint_policy", "checkpoint_blocks", "compile", "weight_dtype"}
)
VIDEO_DIT_MODULE = "lightning_adaptiveload.VideoDiTModule"


def _parameters(n: int) -> str:
    return f"{n / 1e6:.1f}M parameters" if n >= 100_000 else f"{n:,} parameters"


def _settings(settings: CalibrateSettings | None) -> CalibrateSettings:
    if settings is None:
        return CalibrateSettings()  # raises: the shapes or a mix must be given
    if not isinstance(settings, CalibrateSettings):
        raise TypeError(f"calibrate: settings must be a CalibrateSettings, got {type(settings).__name__}")
    return settings


@dataclass
class _Run:
    """One calibration's bench and what the record says of its model."""

    bench: Any
    settings: CalibrateSettings
    all_shapes: list[tuple[int, ...]]
    mix_name: str | None
    patch: Sequence[int]
    device: torch.device
    precision: str
    ddp: bool
    use_packs: bool
    model: dict[str, Any]
    model_info: dict[str, Any]
    # (max_tokens, budget bytes, tokens per shape) -> (the fragment's model.init_args, a memory note)
    after_budget: Callable[[int, int, dict], tuple[dict[str, Any], str | None]] | None
    pack_path: str = "the packed forward"  # what a pack runs through, for the record


def _measure(r: _Run, progress: bool, timer: Callable | None) -> CalibrationResult:
    """The budget search, the timings and the fit, on a bench whose model and optimizer state are ready."""
    from lightning_adaptiveload.planning.sizing import tokens_per_sample

    cfg, mem, bench, patch = r.settings, r.settings.memory, r.bench, r.patch
    chosen = _select_shapes(r.all_shapes, patch, cfg.num_shapes)
    seq = {s: tokens_per_sample(s, patch) for s in chosen}
    longest, shortest = chosen[-1], chosen[0]
    total, device_name = _device_memory(r.device)
    budget = (
        int(mem.memory_budget_gb * _GIB)
        if mem.memory_budget_gb is not None
        else int(mem.vram_fraction * total)
    )
    probes: list[MemoryProbe] = []
    max_tokens = mem.max_tokens
    if max_tokens is None:
        max_tokens = _search_token_budget(
            bench, longest, shortest, seq, budget, mem.max_batch, probes, progress
        )
    elif max_tokens < seq[longest]:
        raise ValueError(
            f"calibrate: max_tokens={max_tokens} is below the longest shape's {seq[longest]} tokens per sample"
        )
    model_args, memory_note = r.after_budget(max_tokens, budget, seq) if r.after_budget else ({}, None)
    batch_sizes = cfg.batch_sizes
    if r.use_packs and not batch_sizes:
        batch_sizes = [1]
    timings = _time_points(
        bench, chosen, seq, batch_sizes, mem.max_batch, max_tokens, cfg.warmup, cfg.repeats, progress, timer
    )
    points: list[Any] = []
    if r.use_packs:
        cost, points = _fit_with_packs(
            bench, timings, r.all_shapes, patch, max_tokens, cfg.warmup, cfg.repeats, progress, timer
        )
        cap = _resolve_cap(cost, cfg.max_compute, max_tokens, patch, r.all_shapes)
    else:
        cost, cap = _fit_cost_model(timings, cfg.kind, cfg.max_compute, max_tokens, patch, r.all_shapes)
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{device_name}, {total / _GIB:.1f} GiB",
        "software": f"torch {torch.__version__}, CUDA {torch.version.cuda}, python {platform.python_version()}",
        **r.model_info,
        "shapes": f"{len(chosen)} of {len(set(r.all_shapes))} distinct"
        + (f" from mix {r.mix_name}" if r.mix_name else ""),
        "memory": _memory_note(budget, total, mem.vram_fraction, mem.memory_budget_gb, r.device, r.ddp),
        "timing": f"median of {cfg.repeats} after {cfg.warmup} warm-up, forward+backward, no optimizer step"
        + (", injected timer" if timer is not None else "")
        + (f"; {len(points) - len(timings)} designed packs through {r.pack_path}" if r.use_packs else ""),
        "max_tokens": f"{max_tokens} "
        + (
            f"(= largest fitting batch at the longest shape, {seq[longest]} tokens per sample)"
            if probes
            else "(given; no memory search)"
        ),
        **({"activation_memory": memory_note} if memory_note else {}),
        "max_compute": "auto rule on the measured shapes"
        if cap != "auto"
        else "auto (resolved by the data module)",
    }
    return CalibrationResult(max_tokens, cap, cost, timings, probes, info, points, model_args, dict(r.model))


# --------------------------------------------------------------------------------------------------
# The steps of the calibration
# --------------------------------------------------------------------------------------------------


def _resolve_device(
    device: str | None, precision: str | None, ddp: bool | None
) -> tuple[torch.device, str, bool]:
    """The device, the precision and ``ddp`` with their defaults filled in (the values were checked by
    :class:`CalibratedTraining`); a CUDA device without CUDA is an error."""
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"calibrate: device {device!r} requested but CUDA is not available; use --device cpu"
        )
    precision = precision or ("bf16-mixed" if dev.type == "cuda" else "32-true")
    if ddp is None:
        ddp = dev.type == "cuda"
    return dev, precision, ddp


def _shapes_to_measure(
    shapes: Sequence[Sequence[int]] | None, mix: str | None, channels: int | None, patch: Sequence[int]
) -> tuple[list[tuple[int, ...]], str | None]:
    """The latent shapes given, or those of the mix's buckets, checked against the model's ``channels`` (None:
    one channel count for all, as one VAE writes them); and the mix name."""
    from lightning_adaptiveload.planning.sizing import tokens_per_sample

    mix_name = None  # CalibrateSettings made sure that one of shapes and mix is given
    if shapes is None:
        from lightning_adaptiveload.shards.mixes import load_mix

        loaded = load_mix(mix)
        mix_name = loaded.name
        shapes = [b.latent_shape for b in loaded.buckets]
    shapes = [tuple(int(d) for d in s) for s in shapes]
    if channels is None and shapes:
        channels = shapes[0][0]
        if len({s[0] for s in shapes}) > 1:
            raise ValueError(
                f"calibrate: the latent shapes have {sorted({s[0] for s in shapes})} channels; the data of one "
                "model has one channel count (one VAE)"
            )
    for s in shapes:
        if s[0] != channels:
            raise ValueError(
                f"calibrate: latent shape {list(s)} has {s[0]} channels but the model expects {channels}"
            )
        tokens_per_sample(s, patch)  # raises on shapes the patch does not divide
    return shapes, mix_name


def _device_memory(dev: torch.device) -> tuple[int, str]:
    """Total memory of the device in bytes (physical memory on CPU) and a name for the record."""
    if dev.type == "cuda":
        return torch.cuda.get_device_properties(dev).total_memory, torch.cuda.get_device_name(dev)
    name = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    return physical_memory(), name


def _search_token_budget(
    bench: Bench, longest, shortest, seq: dict, budget: int, max_batch: int, probes: list, progress: bool
) -> int:
    """``max_tokens`` from the largest batch that fits at the longest shape, lowered if the shortest needs it."""
    from tqdm.auto import tqdm

    bar = tqdm(desc="memory budget", unit="probe", disable=not progress, leave=False)
    try:
        b_long = _largest_fitting_batch(bench, longest, seq[longest], budget, max_batch, probes, bar)
        if b_long == 0:
            raise ValueError(
                f"calibrate: one sample of the longest shape {list(longest)} ({seq[longest]} tokens) needs more "
                f"than the budget of {budget / _GIB:.2f} GiB; enable activation checkpointing, raise "
                "--vram-fraction / --memory-budget-gb, or leave the longest buckets out of the data"
            )
        max_tokens = b_long * seq[longest]
        # The same budget must also fit at the shortest shape (per-token memory can differ).
        b_short = max_tokens // seq[shortest]
        if shortest != longest and b_short >= 1:
            b_fit = _largest_fitting_batch(
                bench, shortest, seq[shortest], budget, b_short, probes, bar, first=b_short
            )
            if b_fit < b_short:
                max_tokens = max(seq[longest], b_fit * seq[shortest])
    finally:
        bar.close()
    return max_tokens


def _time_points(
    bench: Bench,
    chosen: list,
    seq: dict,
    batch_sizes: Sequence[int] | None,
    max_batch: int,
    max_tokens: int,
    warmup: int,
    repeats: int,
    progress: bool,
    timer: Callable | None = None,
) -> list[Timing]:
    """Time every (shape, batch size) point: the given sizes, or 1 and the budget's batch at that shape;
    through ``timer`` (one step of a list of shapes) when one is given."""
    from tqdm.auto import tqdm

    points = []
    for s in chosen:
        sizes = (
            list(batch_sizes) if batch_sizes else sorted({1, max(1, min(max_batch, max_tokens // seq[s]))})
        )
        points.extend((s, b) for b in sizes)
    timings: list[Timing] = []
    for s, b in tqdm(points, desc="timing", unit="point", disable=not progress, leave=False):
        if timer is None:
            median, runs = bench.time(s, b, warmup, repeats)
        else:
            from lightning_adaptiveload.tools.calibrate_packs import time_packs

            one = time_packs([("batch", [s] * b)], lambda x, n=seq[s]: n, timer, repeats, warmup)[0]
            median, runs = one.seconds, one.runs
        timings.append(Timing(s, seq[s], b, median, runs))
    return timings


def _fit_with_packs(bench, timings, all_shapes, patch, max_tokens, warmup, repeats, progress, timer):
    """Time the designed packs, then fit c0, alpha, beta to them and the bucketed points together."""
    from tqdm.auto import tqdm

    from lightning_adaptiveload.planning.sizing import tokens_per_sample
    from lightning_adaptiveload.tools.calibrate_packs import (
        PackTiming,
        design_packs,
        fit_pack_terms,
        time_packs,
    )

    distinct = sorted(set(tuple(s) for s in all_shapes))
    lens = [tokens_per_sample(s, patch) for s in distinct]
    design = design_packs(distinct, lens, max_tokens)
    bar = tqdm(total=len(design), desc="packs", unit="pack", disable=not progress, leave=False)
    try:
        packed = time_packs(
            design,
            lambda s: tokens_per_sample(s, patch),
            timer if timer is not None else bench.time_pack,
            repeats,
            warmup,
            progress=bar,
        )
    finally:
        bar.close()
    single = "single sample"
    bucketed = [
        PackTiming(
            single if t.batch_size == 1 else f"batch of {t.batch_size}",
            [tuple(t.latent_shape)] * t.batch_size,
            [t.seq_len] * t.batch_size,
            "bucketed",
            t.seconds,
            list(t.runs),
        )
        for t in timings
    ]
    points = bucketed + packed
    return fit_pack_terms(points), points


def _resolve_cap(cost, max_compute: str, max_tokens: int, patch, all_shapes) -> float | str:
    """``max_compute`` by the batcher's ``"auto"`` rule with the fitted model, or ``"auto"`` left open."""
    from lightning_adaptiveload.planning.batching import DualConstraintBatcher

    if max_compute == "auto":
        return "auto"
    batcher = DualConstraintBatcher(
        max_tokens, "auto", cost_model=cost, sizing="dual", patch_size=patch, oversize="skip"
    )
    return float(batcher.resolve_max_compute(all_shapes))


def _fit_cost_model(timings: list[Timing], kind: str, max_compute: str, max_tokens: int, patch, all_shapes):
    """Fit the cost model to the points that ran; ``max_compute`` by the batcher's ``"auto"`` rule, or
    ``"auto"`` left for the data module."""
    from lightning_adaptiveload.planning.cost_model import CostModel

    ok = [t for t in timings if t.seconds is not None]
    if not ok:
        raise ValueError("calibrate: every timed point ran out of memory; lower --batch-sizes")
    cost = CostModel.fit(
        [t.seq_len for t in ok], [t.seconds for t in ok], kind=kind, batch_sizes=[t.batch_size for t in ok]
    )
    return cost, _resolve_cap(cost, max_compute, max_tokens, patch, all_shapes)


def _memory_note(
    budget: int,
    total: int,
    vram_fraction: float,
    memory_budget_gb: float | None,
    dev: torch.device,
    ddp: bool,
) -> str:
    """The record's line on the memory budget and how the peak was measured."""
    return (
        f"budget {budget / _GIB:.2f} GiB"
        + (f" ({vram_fraction:.2f} of {total / _GIB:.1f} GiB)" if memory_budget_gb is None else "")
        + (
            " measured with the CUDA allocator"
            if dev.type == "cuda"
            else " CPU estimate: params+grads+optimizer state+saved activations"
        )
        + (", DDP gradient buckets counted" if ddp else "")
    )
