"""The per-step table of the LoadBalanceMonitor, from the blocks its ranks gathered.

Owns the layout of the record every rank sends per step (:data:`FIELDS`), the check that the ranks' blocks
line up (:func:`split_blocks`), the statistics across ranks of every step (:func:`step_table`), and what a
logging window or the whole run reports from that table (:func:`window_metrics`, :func:`summarize_table`).
Plain numpy: every formula is a call into :mod:`lightning_adaptiveload.stats`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lightning_adaptiveload import stats

__all__ = [
    "as_float",
    "FIELDS",
    "NUM_FIELDS",
    "FIELD_INDEX",
    "HEADER",
    "FLAG_COUNTED",
    "FLAG_HOOK",
    "FLAG_COMPILED",
    "FLAG_PACKED",
    "FLAG_EPOCH_END",
    "STEP_COLUMNS",
    "MAX_PLOTTED_RANKS",
    "GIB",
    "split_blocks",
    "step_table",
    "balance_figures",
    "measured_straggler_wait",
    "throughput",
    "window_metrics",
    "rank_band",
    "compiled_steps",
    "summarize_table",
    "step_rows",
    "epoch_ends",
    "history",
]

GIB = float(1 << 30)

# Per-step record gathered from every rank, in this order (one float each). Batches that lack a field, and
# memory on a device without CUDA, give nan: such fields are absent from the logs, empty in the CSV.
FIELDS = (
    "batch_idx",  # trainer.fit_loop.total_batch_idx of the batch: the same on every rank (checked)
    "step",  # trainer.global_step after the batch
    "epoch",  # trainer.current_epoch of the batch
    "cost",  # batch["cost"]: cost-model estimate of the batch
    "num_tokens",  # batch["num_tokens"]
    "batch_size",  # batch["batch_size"]
    "seq_len",  # batch["seq_len"]
    "token_sq_sum",  # sum of S_i^2 over the batch's samples (batch["token_sq_sum"] of a pack, else B * S^2)
    "flops",  # model FLOPs of forward + backward (3x forward)
    "compute_time_s",  # the rank's own compute: step start -> end of its backward (or the whole step)
    "sync_wait_s",  # end of its backward -> end of its gradient synchronisation, measured (nan: not timed)
    "step_time_s",  # step start -> step end (on_train_batch_start -> on_train_batch_end), waiting included
    "iter_time_s",  # previous step end -> this step end: data loading, step and callbacks
    "data_time_s",  # previous step end -> this step start (nan for the first step and after validation)
    "peak_allocated_bytes",  # torch.cuda peak allocated within the step (reset at the step start)
    "peak_reserved_bytes",
    "alloc_retries",  # cumulative cudaMalloc retries (torch.cuda.memory_stats "num_alloc_retries")
    "ooms",  # cumulative out-of-memory errors
    "flags",  # bit 0: warm-up step (FLOPs counted on a meta copy before it, or torch.compile compiled in
    # it: its times are inflated); bit 1: compute timed to the end of the backward; bit 2: torch.compile
    # compiled in it; bit 3: the batch was a pack of mixed shapes (batch["packed"]); bit 4: the last batch of
    # its epoch (batch_idx + 1 == trainer.num_training_batches)
)
NUM_FIELDS = len(FIELDS)
FIELD_INDEX = {name: i for i, name in enumerate(FIELDS)}
HEADER = ("num_steps", "peak_flops", "device_total_bytes")  # per-rank block header
FLAG_COUNTED = 1
FLAG_HOOK = 2
FLAG_COMPILED = 4
FLAG_PACKED = 8
FLAG_EPOCH_END = 16

# Columns of the per-step table (load_balance_steps.csv, the "steps" of load_balance.json).
STEP_COLUMNS = (
    "step",
    "batch_idx",
    "epoch",
    "counted",  # 1 if some rank counted FLOPs or compiled (warm-up) at the step: its time statistics are left out
    "hook_timed",  # 1 if every rank's compute time ended at its backward's end (not the whole step)
    "packed",  # 1 if some rank's batch was a pack of mixed shapes (the packed schedule, lockstep's packed tail)
    "epoch_end",  # 1 for the last batch of an epoch (the plan's remainder: docs/monitor.md, "Summary")
    "compute_cv",
    "compute_imbalance",
    "token_cv",
    "step_time_cv",
    "imbalance",
    "straggler_wait",
    "compute_time_max_s",
    "measured_wait",  # mean over ranks of the measured wait for peers / slowest compute (stats.measured_wait_rows)
    "sync_tail_s",  # the gradient collective's own tail: the least measured synchronisation wait of the step
    "step_time_s",
    "iter_time_s",
    "data_share",
    "tokens",
    "samples",
    "flops",
    "tokens_per_s",
    "samples_per_s",
    "tflops_per_device",
    "mfu",
    "vram_efficiency_mean",
    "vram_efficiency_min",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "fill",  # mean over ranks of tokens / max_tokens of the data module's batcher (nan when unknown)
)
# Summarised over every step: the work balance, then iteration time and the table's rates and memory.
_SUMMARY_ALL_STEPS = (
    "compute_cv",
    "compute_imbalance",
    "token_cv",
    "iter_time_s",
    *STEP_COLUMNS[STEP_COLUMNS.index("tokens_per_s") :],
)
_SUMMARY_TIMED_STEPS = (
    "step_time_cv",
    "imbalance",
    "straggler_wait",
    "measured_wait",
    "sync_tail_s",
    "data_share",
    "compute_time_max_s",
    "step_time_s",
)
MAX_PLOTTED_RANKS = 16  # above this, plots and history keep min/mean/max over ranks instead of every rank


def _nanmean(values: np.ndarray) -> float:
    x = np.asarray(values, dtype=np.float64)
    return float(np.nanmean(x)) if (~np.isnan(x)).any() else math.nan  # no "empty slice" warning


def _nanmax(values: np.ndarray) -> float:
    x = np.asarray(values, dtype=np.float64)
    return float(np.nanmax(x)) if (~np.isnan(x)).any() else math.nan


def split_blocks(gathered: list[list[float]]) -> np.ndarray:
    """Turn the ranks' flat blocks into an array (steps, ranks, fields), checking that the ranks line up.

    Args:
        gathered: one flat block per rank: :data:`HEADER` then :data:`NUM_FIELDS` floats per step.

    Raises:
        RuntimeError: the ranks buffered different step counts, or different batches at one step.
    """
    counts = [int(g[0]) for g in gathered]
    if len(set(counts)) != 1:
        raise RuntimeError(
            f"LoadBalanceMonitor: the ranks buffered different step counts {counts} (index = rank); every rank "
            "must run the same number of training batches (unequal counts also hang DDP)."
        )
    h = len(HEADER)
    a = np.asarray([g[h:] for g in gathered], dtype=np.float64).reshape(len(gathered), counts[0], NUM_FIELDS)
    a = a.transpose(1, 0, 2)
    idx = a[:, :, FIELD_INDEX["batch_idx"]]
    bad = np.flatnonzero((idx != idx[:, :1]).any(axis=1))
    if bad.size:
        raise RuntimeError(
            f"LoadBalanceMonitor: the ranks' batches are out of step: batch indices {idx[bad[0]].tolist()} "
            "(index = rank) were gathered together; every rank must call the training hooks for the same batches."
        )
    return a


def step_table(
    steps: np.ndarray,
    peaks_flops: np.ndarray,
    totals: np.ndarray,
    max_tokens: float = math.nan,
    sequence_degree: int = 1,
) -> dict[str, np.ndarray]:
    """Statistics across ranks of every step.

    Args:
        steps: float64 (steps, ranks, NUM_FIELDS), the gathered records.
        peaks_flops: float64 (ranks,), dense peak FLOP/s of each rank's device (nan if unknown).
        totals: float64 (ranks,), device memory in bytes (nan without CUDA).
        max_tokens: the batcher's token cap per rank and step, for ``fill`` (nan: unknown).
        sequence_degree: G, the ranks of a sequence-parallel group (1: none). Every rank of a group
            records its group's batch (tokens, samples, FLOPs); the job's totals count each group once,
            so the sums over ranks are divided by G.

    Returns:
        One float64 array of shape (steps,) per name of :data:`STEP_COLUMNS`; nan where a value is unknown.
    """

    def col(name: str) -> np.ndarray:
        return steps[:, :, FIELD_INDEX[name]]

    world = steps.shape[1]
    flags = col("flags").astype(np.int64)
    t: dict[str, np.ndarray] = {
        "step": col("step")[:, 0],
        "batch_idx": col("batch_idx")[:, 0],
        "epoch": col("epoch")[:, 0],
        "counted": ((flags & FLAG_COUNTED) > 0).any(axis=1).astype(np.float64),
        "hook_timed": ((flags & FLAG_HOOK) > 0).all(axis=1).astype(np.float64),
        "packed": ((flags & FLAG_PACKED) > 0).any(axis=1).astype(np.float64),
        "epoch_end": ((flags & FLAG_EPOCH_END) > 0).any(axis=1).astype(np.float64),
    }
    costs = stats.balance_rows(col("cost"))  # a negative or missing estimate is left out (nan), never raised
    t["compute_cv"], t["compute_imbalance"], _ = costs
    t["token_cv"], _, _ = stats.balance_rows(col("num_tokens"))
    times = stats.balance_rows(col("compute_time_s"))  # a bad reading is left out (nan), never raised
    t["step_time_cv"], t["imbalance"], t["straggler_wait"] = times
    # Not CSV columns: counted in the summary (step_rows, epoch_ends).
    t["bad_time_reading"] = times.bad.astype(np.float64)
    t["bad_time_reason"] = _reasons(col("compute_time_s"), times.bad)
    t["bad_cost_reading"] = costs.bad.astype(np.float64)
    with np.errstate(invalid="ignore"):
        t["rank_tokens_max"] = col("num_tokens").max(axis=1)
        t["rank_tokens_min"] = col("num_tokens").min(axis=1)
    t["compute_time_max_s"] = col("compute_time_s").max(axis=1)
    t["measured_wait"], t["sync_tail_s"] = stats.measured_wait_rows(col("sync_wait_s"), col("compute_time_s"))
    t["step_time_s"] = col("step_time_s").max(axis=1)
    wall = col("iter_time_s").max(axis=1)  # a synchronous step ends for everyone with the slowest rank
    t["iter_time_s"] = wall
    with np.errstate(divide="ignore", invalid="ignore"):
        share = col("data_time_s") / col("iter_time_s")
        n = (~np.isnan(share)).sum(axis=1)
        t["data_share"] = np.where(n > 0, np.nansum(share, axis=1) / np.maximum(n, 1), np.nan)
        g = float(sequence_degree)
        t["tokens"] = col("num_tokens").sum(axis=1) / g
        t["samples"] = col("batch_size").sum(axis=1) / g
        t["flops"] = col("flops").sum(axis=1) / g
        t["tokens_per_s"] = t["tokens"] / wall
        t["samples_per_s"] = t["samples"] / wall
        t["tflops_per_device"] = t["flops"] / wall / world / 1e12
        t["mfu"] = t["flops"] / wall / peaks_flops.sum()
        eff = col("peak_allocated_bytes") / totals[None, :]
    t["vram_efficiency_mean"] = eff.mean(axis=1)
    t["vram_efficiency_min"] = eff.min(axis=1)
    t["peak_allocated_gib"] = col("peak_allocated_bytes").max(axis=1) / GIB
    t["peak_reserved_gib"] = col("peak_reserved_bytes").max(axis=1) / GIB
    t["fill"] = col("num_tokens").mean(axis=1) / max_tokens
    return t


def _reasons(x: np.ndarray, bad: np.ndarray) -> np.ndarray:
    """Per row: 0, or 1 + the index in :data:`stats.BAD_READINGS` of the reason :func:`stats.balance_rows` left
    the row out for (asked of it row by row: bad rows are rare)."""
    out = np.zeros(len(bad), dtype=np.float64)
    for i in np.flatnonzero(bad):
        skipped = stats.balance_rows(x[i : i + 1]).skipped
        out[i] = 1 + next(k for k, r in enumerate(stats.BAD_READINGS) if skipped.get(r))
    return out


def balance_figures(table: dict[str, np.ndarray]) -> dict[str, float]:
    """:data:`stats.BALANCE_FIGURES` of the compute times over the table's timed steps (FLOP-counting steps
    left out): the names and definitions the simulator reports, so measured and simulated runs compare."""
    timed = table["counted"] == 0
    return stats.summarize_steps(
        table["step_time_cv"][timed],
        table["imbalance"][timed],
        table["straggler_wait"][timed],
        table["compute_time_max_s"][timed],
    )


def measured_straggler_wait(table: dict[str, np.ndarray]) -> float:
    """``straggler_wait``'s time-weighting (by the slowest compute time) applied to the wait the ranks
    measured (:func:`stats.measured_wait_rows`), over the timed steps; nan when no step measured it."""
    timed = table["counted"] == 0
    measured = table["measured_wait"][timed]
    seconds = table["compute_time_max_s"][timed]
    ok = ~(np.isnan(measured) | np.isnan(seconds))
    if not ok.any() or seconds[ok].sum() <= 0:
        return math.nan
    return float(np.average(measured[ok], weights=seconds[ok]))


def throughput(table: dict[str, np.ndarray], world: int, peaks_flops: np.ndarray | None) -> dict[str, float]:
    """Job throughput over the steps of ``table``, summed over ranks, FLOP-counting steps included.

    Those steps are the job's real time, the monitor's cost with it; leaving them out would flatter it.
    """
    wall = float(table["iter_time_s"].sum())
    flops = float(table["flops"].sum())
    peak = float(peaks_flops.sum()) if peaks_flops is not None else math.nan
    return {
        "tokens_per_s": stats.achieved_flops_per_s(float(table["tokens"].sum()), wall),
        "samples_per_s": stats.achieved_flops_per_s(float(table["samples"].sum()), wall),
        "tflops_per_device": stats.achieved_flops_per_s(flops, wall) / world / 1e12,
        "mfu": stats.mfu(flops, wall, peak),
    }


def window_metrics(
    steps: np.ndarray, table: dict[str, np.ndarray], peaks_flops: np.ndarray | None, high_water: float
) -> dict[str, float]:
    """The logged values of one window: means over its steps (time balance over un-counted steps only).

    Args:
        steps: float64 (steps, ranks, NUM_FIELDS), the window's gathered records.
        table: :func:`step_table` of ``steps``.
        peaks_flops: float64 (ranks,) dense peak FLOP/s, or None.
        high_water: the job's running peak allocated bytes, for ``peak_vram_util_eff``.

    Returns:
        The finite values only, by name (without the logging prefix).
    """
    timed = table["counted"] == 0
    out: dict[str, float] = {}
    for key in (
        "compute_cv",
        "compute_imbalance",
        "token_cv",
        "vram_efficiency_mean",
        "vram_efficiency_min",
        "fill",
    ):
        out[key] = _nanmean(table[key])
    for key in ("step_time_cv", "imbalance", "data_share"):
        out[key] = _nanmean(table[key][timed])
    figures = balance_figures(table)
    out["straggler_wait"] = figures["straggler_wait"]  # time-weighted over the window's timed steps
    out["measured_straggler_wait"] = measured_straggler_wait(table)
    out["step_wait_mean"] = figures["step_wait_mean"]
    for key in ("peak_allocated_gib", "peak_reserved_gib"):
        out[key] = _nanmax(table[key])
    out.update(throughput(table, steps.shape[1], peaks_flops))
    peaks = steps[:, :, FIELD_INDEX["peak_allocated_bytes"]]
    if peaks.size and not np.isnan(peaks).any():
        out["peak_vram_util_eff"] = stats.peak_vram_utilisation_efficiency(peaks.ravel(), high_water)
    return {k: float(v) for k, v in out.items() if math.isfinite(v)}


def rank_band(steps: np.ndarray, name: str) -> np.ndarray:
    """One field of every rank, float32 (steps, ranks); min/mean/max over ranks (steps, 3) on large jobs."""
    x = steps[:, :, FIELD_INDEX[name]]
    if x.shape[1] > MAX_PLOTTED_RANKS:  # keep a band, not every rank, on large jobs
        x = np.stack([x.min(axis=1), x.mean(axis=1), x.max(axis=1)], axis=1)
    return x.astype(np.float32)


def compiled_steps(steps: np.ndarray) -> int:
    """How many steps of ``steps`` some rank compiled (torch.compile) in."""
    flags = steps[:, :, FIELD_INDEX["flags"]].astype(np.int64)
    return int(((flags & FLAG_COMPILED) > 0).any(axis=1).sum())


def summarize_table(
    table: dict[str, np.ndarray],
    world: int,
    peaks_flops: np.ndarray,
    rank_peaks: list[np.ndarray],
    high_water: float,
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """The whole run's statistics from its per-step table.

    Args:
        table: the run's :func:`step_table`, every flush concatenated (may be empty).
        world: the number of ranks.
        peaks_flops: float64 (ranks,) dense peak FLOP/s (nan if unknown).
        rank_peaks: the :func:`rank_band` blocks of ``peak_allocated_bytes``, one per flush.
        high_water: the job's peak allocated bytes.

    Returns:
        ``(described, overall)``: :func:`stats.describe` of each summarised column, and the whole-job
        throughput, balance figures, totals and peak VRAM utilisation efficiency.
    """
    described: dict[str, dict[str, float]] = {}
    overall: dict[str, float] = {}
    if not len(table.get("step", ())):
        return described, overall
    timed = table["counted"] == 0
    for key in _SUMMARY_ALL_STEPS:
        described[key] = stats.describe(table[key].tolist())
    for key in _SUMMARY_TIMED_STEPS:
        described[key] = stats.describe(table[key][timed].tolist())
    overall.update(throughput(table, world, peaks_flops))
    overall.update(balance_figures(table))
    overall["measured_straggler_wait"] = measured_straggler_wait(table)
    overall["tokens"] = float(np.nansum(table["tokens"]))
    overall["samples"] = float(np.nansum(table["samples"]))
    # steps left out of the time statistics: a rank's compute time negative, nan, inf or subnormal
    overall["skipped_time_readings"] = float(np.sum(table.get("bad_time_reading", 0.0)))
    if rank_peaks and world <= MAX_PLOTTED_RANKS:
        peaks = np.concatenate(rank_peaks).astype(np.float64)
        if not np.isnan(peaks).any():
            overall["peak_vram_util_eff"] = stats.peak_vram_utilisation_efficiency(peaks.ravel())
    elif math.isfinite(high_water) and high_water > 0:
        # Large jobs keep min/mean/max per step only; the mean column gives the same mean over ranks.
        means = np.concatenate(rank_peaks)[:, 1].astype(np.float64)
        overall["peak_vram_util_eff"] = float(means.mean() / high_water)
    return described, overall


def step_rows(table: dict[str, np.ndarray]) -> dict[str, Any]:
    """How many steps the measured time figures (``step_time_cv``, ``imbalance``, ``straggler_wait``) used, and
    how many they left out and why; ``used + sum(left_out.values()) == steps``.

    Returns:
        ``{"steps", "used", "left_out": {"warm_up": n, "negative": n, "nan": n, "inf": n, "subnormal": n},
        "cost_left_out"}``: warm-up steps (FLOPs counted or compiling) first, then the bad readings of
        :data:`stats.BAD_READINGS` (a rank's compute time negative, nan, infinite or subnormal) by reason; and
        the steps the planned compute CV left out (a rank's ``batch["cost"]`` missing or a bad reading).
    """
    n = len(table.get("step", ()))
    if not n:
        return {"steps": 0, "used": 0, "left_out": {}, "cost_left_out": 0}
    warm = table["counted"] > 0
    reason = np.asarray(table.get("bad_time_reason", np.zeros(n)))
    left_out = {"warm_up": int(warm.sum())}
    for k, name in enumerate(stats.BAD_READINGS):
        left_out[name] = int(((reason == k + 1) & ~warm).sum())
    cost_left_out = int(np.sum(table.get("bad_cost_reading", np.zeros(n))))
    return {
        "steps": n,
        "used": n - sum(left_out.values()),
        "left_out": left_out,
        "cost_left_out": cost_left_out,
    }


def epoch_ends(table: dict[str, np.ndarray]) -> dict[str, Any]:
    """The last step of each epoch beside the other steps: where an epoch's remainder (the samples its plan could
    not pair into equal steps) runs, its balance differs.

    Returns:
        ``{}`` without such a step or without another step; else ``{"steps", "packed" (how many of them were
        packs), "token_cv", "compute_cv" (their means), "others_token_cv", "others_compute_cv", "other_steps",
        "others_packed",
        "worst": {"step", "epoch", "token_cv", "rank_tokens_max", "rank_tokens_min"}, "stands_out"}``;
        ``stands_out`` when their mean token or compute CV is over 5% and over twice the other steps'.
    """
    ends = np.asarray(table.get("epoch_end", ()), dtype=np.float64) > 0
    if not ends.any() or ends.all():
        return {}
    others = ~ends
    token_cv, compute_cv = table["token_cv"], table["compute_cv"]
    figures = {
        "token_cv": _nanmean(token_cv[ends]),
        "compute_cv": _nanmean(compute_cv[ends]),
        "others_token_cv": _nanmean(token_cv[others]),
        "others_compute_cv": _nanmean(compute_cv[others]),
    }
    stands_out = any(
        figures[k] > 0.05 and not figures[k] <= 2 * figures["others_" + k]
        for k in ("token_cv", "compute_cv")
        if math.isfinite(figures[k])
    )
    idx = np.flatnonzero(ends)
    cvs = np.where(np.isnan(token_cv[idx]), -1.0, token_cv[idx])
    w = int(idx[int(np.argmax(cvs))])
    return {
        "steps": int(ends.sum()),
        "packed": int((table["packed"][ends] > 0).sum()),
        **figures,
        "other_steps": int(others.sum()),
        "others_packed": int((table["packed"][others] > 0).sum()),
        "worst": {
            "step": int(table["step"][w]),
            "epoch": int(table["epoch"][w]),
            "token_cv": float(token_cv[w]),
            "rank_tokens_max": float(table["rank_tokens_max"][w]),
            "rank_tokens_min": float(table["rank_tokens_min"][w]),
        },
        "stands_out": bool(stands_out),
    }


def history(tables: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """The per-step tables of several flushes as one table (empty without a flush)."""
    if not tables:
        return {}
    return {k: np.concatenate([t[k] for t in tables]) for k in tables[0]}


def as_float(value: Any) -> float:
    """A batch's scalar (a number, a one-element tensor, None) as a float; nan where it is none of these."""
    if value is None:
        return math.nan
    if callable(getattr(value, "numel", None)):  # a tensor, without importing torch here
        return float(value.item()) if value.numel() == 1 else math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan
