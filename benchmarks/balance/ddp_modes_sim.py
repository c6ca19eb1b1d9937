"""The simulated half of ``ddp_modes_report.py``: the pack cost model fitted to the measured packs, the step
times the simulator replays (:func:`calibrated_table`), the simulator's prediction for a run's own settings
(:func:`predict_mode`), the measured noise replayed (the simulator's ``noisy_balance``), and more ranks
than were run (:func:`simulate_more_ranks`). Every figure here is a simulation, and the report labels it so."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
from ddp_modes_runs import calibration_steps, flat_data_args, kept_steps, pack_rows, square_sums

from lightning_adaptiveload.tools.replay import noisy_balance
from lightning_adaptiveload.tools.simulate_settings import SimulateSettings

# ----------------------------------------------------------------------------------- the pack cost model


def pack_statistics(per_mode: dict[str, dict], warmup: int) -> dict[str, np.ndarray]:
    """Every measured pack of every mode: N, sum S, sum S^2 (and whether exact), compute seconds."""
    cols: dict[str, list] = {"n": [], "s1": [], "s2": [], "exact": [], "seconds": [], "mode": []}
    for mode, m in per_mode.items():
        ranks, plan_cost = m["ranks"], m["plan_cost"]
        keep = calibration_steps(ranks, warmup)[:, None] & pack_rows(ranks, mode)
        keep &= np.isfinite(ranks["compute_time_s"]) & (ranks["compute_time_s"] > 0)
        s2, exact = square_sums(ranks, plan_cost)
        cols["n"].append(ranks["batch_size"][keep])
        cols["s1"].append(ranks["num_tokens"][keep])
        cols["s2"].append(s2[keep])
        cols["exact"].append(exact[keep])
        cols["seconds"].append(ranks["compute_time_s"][keep])
        cols["mode"].append(np.full(int(keep.sum()), mode, dtype=object))
    if not cols["n"]:
        return {k: np.zeros(0) for k in cols}
    return {k: np.concatenate(v) for k, v in cols.items()}


def fit_pack_model(packs: dict[str, np.ndarray], given: Any = None) -> tuple[Any, dict[str, Any]]:
    """The pack cost model that prices packs in the simulation, and how it was obtained.

    ``given`` (a :class:`CostModel`) wins; else ``c0 + sum(alpha*S + beta*S^2)`` fitted to the measured packs
    (:meth:`CostModel.fit_pack_sums`), with its error on every pack; None when fewer than 3 packs with two
    distinct sample counts or token sums were measured (the simulation then prices packs by the bucketed
    steps' per-sample fit, and says so).
    """
    from lightning_adaptiveload.planning.cost_model import CostModel

    info: dict[str, Any] = {
        "packs_measured": int(len(packs["n"])),
        "sum_sq_estimated": int((~packs["exact"].astype(bool)).sum()),
    }
    model = None
    if given is not None:
        model = given
        info["source"] = "given (--pack-cost-model)"
    elif len(packs["n"]) >= 3 and (len(np.unique(packs["n"])) > 1 or len(np.unique(packs["s1"])) > 1):
        try:
            model = CostModel.fit_pack_sums(packs["n"], packs["s1"], packs["s2"], packs["seconds"])
            info["source"] = "fitted to this run's packs"
        except ValueError as err:
            info["source"] = f"not fitted ({err})"
    else:
        info["source"] = "none: fewer than 3 distinct packs measured"
    if model is not None:
        info["model"] = model.to_dict()
        info["formula"] = model.describe()
        if len(packs["n"]):
            pred = model.c0 + model.alpha * packs["s1"] + model.beta * packs["s2"] + model.gamma * packs["n"]
            err = np.abs(pred - packs["seconds"]) / packs["seconds"]
            info["mean_rel_error"] = float(err.mean())
            info["max_rel_error"] = float(err.max())
    return model, info


def bucketed_step_model(per_mode: dict[str, dict], warmup: int):
    """``c0 + B*(alpha*S + beta*S^2)`` fitted to the bucketed steps of these modes (each rank's batch of B
    samples of S tokens, its compute seconds): a step's fixed cost apart from its samples', so that it can
    price a pack of any shapes (:meth:`CostModel.fit_pack_sums` with B, B*S and B*S^2)."""
    from lightning_adaptiveload.planning.cost_model import CostModel

    cols: dict[str, list] = {"n": [], "s1": [], "s2": [], "seconds": []}
    for mode, m in per_mode.items():
        ranks = m["ranks"]
        keep = calibration_steps(ranks, warmup)[:, None] & ~pack_rows(ranks, mode)
        keep &= np.isfinite(ranks["compute_time_s"]) & (ranks["compute_time_s"] > 0)
        b, seq = ranks["batch_size"][keep], ranks["seq_len"][keep]
        cols["n"].append(b)
        cols["s1"].append(b * seq)
        cols["s2"].append(b * seq * seq)
        cols["seconds"].append(ranks["compute_time_s"][keep])
    n, s1, s2, y = (np.concatenate(cols[k]) if cols[k] else np.zeros(0) for k in ("n", "s1", "s2", "seconds"))
    return CostModel.fit_pack_sums(n, s1, s2, y)


# ---------------------------------------------------------------------------------------- the simulator


def calibrated_table(
    csvs: list[str], mix_name: str, warmup: int, pack_model: Any, exclude: dict[str, list[int]] | None = None
):
    """The simulator's step times measured in these runs: bucketed medians (without the ``exclude``d
    ``batch_idx`` values of each CSV: the stalls), and packs by ``pack_model``."""
    from lightning_adaptiveload.shards.mixes import load_mix
    from lightning_adaptiveload.tools.simulate import StepTimeTable

    mix = load_mix(mix_name)
    shapes = [b.latent_shape for b in mix.buckets]
    table = StepTimeTable.from_monitor_csv(csvs, shapes, warmup_steps=warmup, exclude=exclude)
    table.pack_model = pack_model
    return table


def _plan_settings(config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """The data module's planning settings of a run (its saved config; the recipe's defaults without one)."""
    data = config.get("data") or {}
    return {
        "max_tokens": int(data.get("max_tokens") or meta.get("max_tokens") or 32760),
        "max_compute": data.get("max_compute", "auto") if data.get("max_compute") is not None else "auto",
        "num_workers": int(data.get("num_workers", 4)),
        "seed": int(data.get("seed", 0)),
        "patch": tuple(int(v) for v in data.get("patch_size", (1, 2, 2))),
        "plan_options": {
            "lockstep_tail": data.get("lockstep_tail", "packed"),
            "lockstep_tolerance": float(data.get("lockstep_tolerance", 0.05)),
            "max_buffered_samples": data.get("max_buffered_samples"),
        },
    }


def pooled_noise(per_mode: dict[str, dict]) -> float:
    """Every mode's :func:`identical_work_noise`, weighted by its identical-work steps; nan without one."""
    pairs = [
        (m["summary"].get("identical_work_noise", math.nan), m["summary"].get("identical_work_steps", 0))
        for m in per_mode.values()
    ]
    pairs = [(v, n) for v, n in pairs if math.isfinite(v) and n > 0]
    return float(np.average([v for v, _ in pairs], weights=[n for _, n in pairs])) if pairs else math.nan


def predict_mode(
    mode: str,
    m: dict[str, Any],
    index: Any,
    table: Any,
    overhead_s: float,
    meta: dict[str, Any],
    warmup: int,
    noise: float = math.nan,
) -> dict[str, Any]:
    """The simulator's figures for one measured mode, over the same steps (see the module docstring). With a
    finite ``noise`` (:func:`identical_work_noise`), also its tokens/s and wait with every replayed rank time
    scaled by ``1 + noise * N(0, 1)``: the mean over the simulator's default ``noise_draws`` seeded draws (``noisy_balance``)."""
    from lightning_adaptiveload import stats
    from lightning_adaptiveload.tools.replay import run_variant
    from lightning_adaptiveload.tools.step_times import BatchCoster

    ranks = m["ranks"]
    world = int(ranks["compute_time_s"].shape[1])
    s = _plan_settings(m["config"], meta)
    coster = BatchCoster(table, s["patch"], 0.0)
    batch_idx = np.nan_to_num(ranks["batch_idx"][:, 0], nan=-1).astype(np.int64)
    keep = kept_steps(ranks, warmup)
    need = int(batch_idx.max()) + 1
    seconds, tokens, cost = [], [], []
    epoch = 0
    while sum(len(x) for x in seconds) < need and epoch < 50:
        _, _, rep, _ = run_variant(
            index,
            world,
            mode,
            max_tokens=s["max_tokens"],
            max_compute=s["max_compute"],
            plan_cost=m["plan_cost"],
            coster=coster,
            patch=s["patch"],
            num_workers=s["num_workers"],
            seed=s["seed"],
            epoch=epoch,
            plan_options=s["plan_options"],
        )
        seconds.append(rep.seconds)
        tokens.append(rep.tokens)
        cost.append(rep.cost)
        epoch += 1
    sec, tok, cst = (np.concatenate(x) for x in (seconds, tokens, cost))
    rows = batch_idx[keep]
    rows = rows[(rows >= 0) & (rows < len(sec))]
    if rows.size == 0:
        return {"error": "no measured step to compare with"}
    sec, tok, cst = sec[rows], tok[rows], cst[rows]
    measured_tokens = ranks["num_tokens"][np.isin(batch_idx, rows)]
    wall = sec.max(axis=1) + overhead_s
    noisy: dict[str, float] = {}
    if math.isfinite(noise) and noise > 0:
        replayed = noisy_balance(sec, tok, noise, SimulateSettings().noise_draws, overhead_s=overhead_s)
        noisy = {
            "noise": float(noise),
            "tokens_per_s_with_noise": replayed["tokens_per_s"],
            "straggler_wait_with_noise": replayed["straggler_wait"],
        }
    # The whole first epoch, beside the measured steps: how far the steps a run measured stand from an epoch.
    first = seconds[0].max(axis=1) + overhead_s
    return {
        **noisy,
        "tokens_per_s_epoch0": float(tokens[0].sum() / first.sum()),
        "epoch0_steps": int(len(first)),
        "steps": int(len(rows)),
        "epochs_planned": epoch,
        "plan_match": float(np.mean(np.abs(measured_tokens - tok) < 0.5)),
        "tokens_per_s": float(tok.sum() / wall.sum()),
        "compute_cv_mean": float(np.mean(stats.balance_rows(sec)[0])),
        "straggler_wait": stats.straggler_wait(sec),
        # The planner's cost model on the replayed batches: the same steps, and the whole first epoch.
        "planner_straggler_wait": stats.straggler_wait(cst),
        "planner_straggler_wait_epoch0": stats.straggler_wait(cost[0]),
    }


def simulate_more_ranks(
    table: Any,
    sizes: list[int],
    modes: list[str],
    mix_name: str,
    max_tokens: int,
    steps_per_rank: int,
    noise: float = 0.0,
) -> dict[str, Any]:
    """Simulate more ranks than were run (mix population), with the step times measured in these runs and,
    when finite and above 0, the noise measured on their identical work (each row's ``wait_share_noise``)."""
    from lightning_adaptiveload.shards.mixes import load_mix
    from lightning_adaptiveload.tools.simulate import simulate

    noise = noise if math.isfinite(noise) else 0.0  # SimulateSettings refuses a bad one, said by the caller
    result = simulate(
        load_mix(mix_name),
        settings=SimulateSettings(
            world_sizes=sizes,
            variants=modes,
            max_tokens=max_tokens,
            min_steps_per_rank=steps_per_rank,
            noise=noise,
        ),
        times=table,
        progress=False,
    )
    print(f"\nSIMULATED: more ranks, step times calibrated on this run ({mix_name} population):")
    print(result.table())
    for note in result.notes:
        print(f"  note: {note}")
    keys = ("variant", "world_size", "cv_mean", "cv_p95", "imbalance_mean", "wait_share", "tokens_per_s_ratio")
    keys += ("noise", "wait_share_noise", "tokens_per_s_ratio_noise") if noise else ()
    return {
        "rows": [{k: r[k] for k in keys} for r in result.rows],
        "targets": result.targets(),
        "notes": result.notes,
    }


def load_cost_model(path: str):
    """A cost model from a JSON file (CostModel.to_dict) or a calibration fragment (data.init_args.cost_model)."""
    import yaml

    from lightning_adaptiveload.planning.cost_model import CostModel

    with open(path, encoding="utf-8") as f:
        data = yaml.safe_load(f)
    args = flat_data_args((((data or {}).get("data") or {}).get("init_args")) or {})
    spec = args.get("cost_model", data)
    if isinstance(spec, dict) and "cost_model" in spec:
        spec = spec["cost_model"]
    return CostModel.from_dict(spec)


def run_index(path: str, mix: str, meta: dict[str, Any], world: int, notes: list[str]):
    """The shards the runs trained on (``data_index.json``), else a population of the mix (said in a note)."""
    from lightning_adaptiveload.shards.index import ShardIndex
    from lightning_adaptiveload.shards.mixes import load_mix
    from lightning_adaptiveload.tools.replay import mix_population

    if os.path.isfile(path):
        return ShardIndex.load(path)
    n = int(meta.get("samples") or 768)
    notes.append(
        f"no {os.path.basename(path)} in the run folder: the simulation plans a {n}-sample population of {mix}, "
        "not the runs' shards (its batches are not the run's)"
    )
    return mix_population(load_mix(mix), n, max(world * 4, n // 16), int(meta.get("seed") or 0))
