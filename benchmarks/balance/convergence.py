"""Convergence of the three schedules on CPU: validation loss per epoch for independent, lockstep, packed.

The schedules change what one optimizer step sees: ``lockstep`` gives every step one length class,
``packed`` mixes shapes inside every step, ``independent`` leaves each rank to batch its own samples.
This script trains the ``tiny`` VideoDiT on the same synthetic data with each schedule and several seeds
and records the token-weighted ``val/loss`` after every epoch (the module's own validation: fixed
timesteps, fixed noise per validation batch).

Fairness: the same training and validation shards for every run; the same optimizer, learning rate,
warm-up and epochs; ``mode="equal_tokens"`` with one ``max_tokens`` for all schedules, so that a step
holds at most the same number of tokens whichever the schedule (packs fill to ~97% of it, bucketed
batches hold ``floor(max_tokens / S)`` samples); validation is planned the same way for every schedule
(its plan does not depend on the training schedule). Every sample is seen exactly once per epoch, so
samples per epoch are equal; steps per epoch differ and are recorded. A seed sets the model's
initialisation, the noise and timesteps, and the shard order of the plans (training and validation), so
runs with the same seed start from the same weights and are validated on the same batches: schedules are
compared per seed (paired differences) as well as by mean and spread.

The data are ``content="structured"`` synthetic latents (see
:func:`lightning_adaptiveload.shards.synthetic.structured_latent`): smooth fields in a low-dimensional
channel subspace, partly shared by all shapes and partly owned by each frame count, plus a little noise.
i.i.d. noise latents would leave a model almost nothing to learn.

Matched tokens per step (``--match-tokens``). At one ``max_tokens`` packs fill ~97% of it and bucketed
batches ~82%, so ``packed`` takes fewer, larger steps (every schedule sees the same tokens per epoch).
With ``--match-tokens`` the epochs are planned first, from the index alone, with the training dataset's
own ``make_plan``: ``independent`` and ``lockstep`` keep ``--max-tokens``, and ``packed``'s
``max_tokens`` (the only knob that sets its step size) is bisected until its mean tokens per step over the
planned epochs of every seed meets ``independent``'s. Equal tokens per epoch and equal tokens per step
mean equal steps per epoch. Validation keeps ``--max-tokens`` for every schedule (the same validation
batches and noise). The result records every schedule's cap and its planned and achieved tokens per
step.

With one process (the default) ``independent`` and ``lockstep`` both form single-shape batches (a bucketed
batch is one tensor); only across ranks does an ``independent`` step mix classes. ``--devices 2`` runs
DDP with 2 gloo processes per run (``ddp_spawn``, one thread each).

Usage::

    python benchmarks/balance/convergence.py                       # 3 schedules x seeds 0,1,2: ~12 min on 2 shared cores
    python benchmarks/balance/convergence.py --epochs 2 --seeds 0  # a quick look (~30 s)
    python benchmarks/balance/convergence.py --match-tokens --seeds 0 1 2 3 4  # equal tokens per step
    python benchmarks/balance/convergence.py --from-json RESULT.json  # re-summarise and re-plot, no training

Writes ``benchmarks/results/convergence_cpu_<date>.json`` (settings, machine, every run's per-epoch curve,
summary per schedule) and ``docs/img/convergence_cpu.png``. Results: ``docs/convergence.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import lightning.pytorch as pl
import torch

from lightning_adaptiveload import AdaptiveLoadDataModule, VideoDiTModule
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.models.module import OptimizerSettings, SamplingSettings
from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import cpu_name  # noqa: E402

SCHEDULES = ("independent", "lockstep", "packed")
HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)


def _length_class(batch: dict) -> int:
    """This rank's batch's latent frame count T (its length class: 1 = images), or -1 for a pack that
    mixes frame counts. On the tiny mix the frame count fixes the tokens within 5% (24/25, 72/75, 120/125,
    216/225), so it is also the lockstep class."""
    latents = batch["latents"]
    frames = {int(x.shape[1]) for x in latents} if batch.get("packed") else {int(latents.shape[2])}
    return frames.pop() if len(frames) == 1 else -1


class _Curve(pl.Callback):
    """Records, per training epoch: steps, samples and tokens (all ranks), the steps whose global batch
    mixes length classes (frame counts), the mean train loss (rank 0), and val/loss.

    Under ``ddp_spawn`` the callback lives in the worker processes: rank 0 writes the curve to ``path``.
    """

    def __init__(self, path: str | None = None) -> None:
        self.path = path
        self.epochs: list[dict] = []
        self._cur: dict = {}

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._cur = {"steps": 0, "samples": 0, "tokens": 0, "mixed_steps": 0, "train_loss_sum": 0.0}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        local = torch.tensor(
            [_length_class(batch), len(batch["latents"]), int(batch["num_tokens"])], dtype=torch.float64
        )
        # One small gather per step (every rank's class, samples, tokens): what the optimizer step saw.
        rows = trainer.strategy.all_gather(local).reshape(-1, 3)
        classes = {int(v) for v in rows[:, 0].tolist()}
        c = self._cur
        c["steps"] += 1
        c["samples"] += int(rows[:, 1].sum())
        c["tokens"] += int(rows[:, 2].sum())
        c["mixed_steps"] += int(len(classes) > 1 or -1 in classes)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        # Rank 0's share of the step's token-weighted loss; with one rank, the step's per-token mean.
        c["train_loss_sum"] += float(loss)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not self._cur:
            return
        c = self._cur
        self.epochs.append(
            {
                "epoch": int(trainer.current_epoch),
                "global_step": int(trainer.global_step),
                "steps": c["steps"],
                "samples": c["samples"],
                "tokens": c["tokens"],
                "mixed_steps": c["mixed_steps"],
                "train_loss": c["train_loss_sum"] / max(c["steps"], 1),
                "val_loss": float(trainer.callback_metrics["val/loss"]),
            }
        )
        self._cur = {}

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.path and trainer.global_rank == 0:
            with open(self.path, "w") as f:
                json.dump(self.epochs, f)


class _ValidationAtCap(AdaptiveLoadDataModule):
    """The data module with validation batched at ``val_max_tokens`` whatever the training cap: with
    ``--match-tokens`` packed trains at a lower ``max_tokens``, and its validation batches (hence the fixed
    noise drawn per validation batch) must stay those of the other schedules for the paired comparison."""

    def __init__(self, *, val_max_tokens: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self._val_batcher = DualConstraintBatcher(val_max_tokens, sizing="equal_tokens")

    def _dataset(self, index, schedule, fixed_epoch=None):
        if fixed_epoch is None:  # training
            return super()._dataset(index, schedule, fixed_epoch)
        train_batcher, self.batcher = self.batcher, self._val_batcher
        try:
            return super()._dataset(index, schedule, fixed_epoch)
        finally:
            self.batcher = train_batcher


def make_data(workdir: str, num_samples: int, val_samples: int, mix: str, content: str) -> tuple[str, str]:
    """Training and validation shards, written once and reused by every run (no text states: synthetic
    text would be noise unrelated to the latents)."""
    train, val = os.path.join(workdir, "train"), os.path.join(workdir, "val")
    common = dict(mix=mix, samples_per_shard=32, text_len_range=None, content=content)
    write_synthetic_shards(train, SyntheticShards(num_samples=num_samples, seed=0, **common), progress=False)
    write_synthetic_shards(val, SyntheticShards(num_samples=val_samples, seed=1, **common), progress=False)
    return train, val


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanProbe:
    """Which plans a tokens-per-step measurement covers.

    Attributes:
        world_size: ranks per run (a global step holds one batch per rank).
        seeds: the plans' seeds (the runs' seeds).
        epochs: epochs ``0 .. epochs - 1`` planned per seed.
    """

    world_size: int
    seeds: tuple[int, ...]
    epochs: int


def planned_tokens_per_step(train: str, schedule: str, max_tokens: int, probe: PlanProbe) -> dict:
    """Mean tokens per optimizer step (summed over ranks) and steps per epoch of ``schedule`` at
    ``max_tokens``, from the epoch plans alone (no training): the plans the training runs will follow,
    made by the training dataset's own ``make_plan`` with its settings.

    Returns ``{"max_tokens", "tokens_per_step", "steps_per_epoch", "tokens_per_epoch"}`` (means over the
    probe's seeds and epochs; tokens per step is total tokens over total steps).
    """
    dm = AdaptiveLoadDataModule(
        train_shards=train,
        batching=Batching(max_tokens=max_tokens, sizing="equal_tokens"),
        plan=PlanSettings(schedule=schedule, chunk_samples=500_000),
        loader=Loader(num_workers=0),
    )
    dm.setup("fit")
    ds = dm.train_dataset
    base = ds.plan_settings()
    steps = tokens = 0
    for seed in probe.seeds:
        for epoch in range(probe.epochs):
            plan = ds.make_plan(epoch, settings={**base, "world_size": probe.world_size, "seed": seed})
            steps += plan.steps
            tokens += sum(plan.global_tokens)
    n = len(probe.seeds) * probe.epochs
    return {
        "max_tokens": max_tokens,
        "tokens_per_step": tokens / steps,
        "steps_per_epoch": steps / n,
        "tokens_per_epoch": tokens / n,
    }


def match_max_tokens(
    train: str, schedule: str, target: float, probe: PlanProbe, bounds: tuple[int, int]
) -> dict:
    """The ``max_tokens`` in ``bounds`` (inclusive) at which ``schedule``'s planned mean tokens per step is
    closest to ``target``: a bisection on the planned tokens per step (which grows with ``max_tokens``;
    packs fill to the cap), then the closest of the last bracket. Returns
    :func:`planned_tokens_per_step`'s dict for that value plus ``"relative_gap"`` (achieved / target - 1).

    Raises:
        ValueError: ``bounds`` is empty or its lower end is below 1.
    """
    lo, hi = bounds
    if not 1 <= lo <= hi:
        raise ValueError(
            f"max_tokens bounds must satisfy 1 <= low <= high, got {bounds}: pass e.g. (256, 1024)"
        )
    seen: dict[int, dict] = {}

    def at(m: int) -> dict:
        if m not in seen:
            seen[m] = planned_tokens_per_step(train, schedule, m, probe)
        return seen[m]

    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid)["tokens_per_step"] < target:
            lo = mid
        else:
            hi = mid
    best = min((at(lo), at(hi)), key=lambda r: abs(r["tokens_per_step"] - target))
    return {**best, "relative_gap": best["tokens_per_step"] / target - 1.0}


def matched_max_tokens(train: str, args: argparse.Namespace) -> tuple[dict[str, int], dict]:
    """Per schedule, the ``max_tokens`` of its runs and the planned tokens per step at it.

    Unmatched (``--match-tokens`` off): ``--max-tokens`` for every schedule. Matched: ``independent`` and
    ``lockstep`` keep ``--max-tokens`` (their bucketed batch sizes ``floor(max_tokens / S)`` move in
    steps of whole samples), and ``packed``'s cap, the only knob that sets its step size, is lowered until
    its planned mean tokens per step meets ``independent``'s.
    """
    probe = PlanProbe(world_size=args.devices, seeds=tuple(args.seeds), epochs=args.match_epochs)
    caps = {s: args.max_tokens for s in args.schedules.split(",")}
    planned = {s: planned_tokens_per_step(train, s, caps[s], probe) for s in caps if s != "packed"}
    if args.match_tokens and "packed" in caps:
        reference = planned.get("independent") or planned_tokens_per_step(
            train, "independent", args.max_tokens, probe
        )
        bounds = (args.match_min_tokens, args.max_tokens)
        planned["packed"] = match_max_tokens(train, "packed", reference["tokens_per_step"], probe, bounds)
        caps["packed"] = planned["packed"]["max_tokens"]
    elif "packed" in caps:
        planned["packed"] = planned_tokens_per_step(train, "packed", caps["packed"], probe)
    return caps, {"probe": dataclasses.asdict(probe), "per_schedule": planned}


def run_one(
    schedule: str, seed: int, args: argparse.Namespace, train: str, val: str, workdir: str, max_tokens: int
) -> dict:
    """One training run; returns its per-epoch curve, its initial val/loss and its wall time."""
    pl.seed_everything(seed, workers=True, verbose=False)
    model = VideoDiTModule(
        preset="tiny",
        optimizer=OptimizerSettings(lr=args.lr, warmup_steps=args.warmup_steps),
        sampling=SamplingSettings(shift=1.0),
    )
    # Built here, under the seed, whatever the process count: ddp_spawn copies these weights to its
    # workers and back.
    model.configure_model()
    dm = _ValidationAtCap(
        val_max_tokens=args.max_tokens,
        train_shards=train,
        val_shards=val,
        batching=Batching(max_tokens=max_tokens, sizing="equal_tokens"),
        plan=PlanSettings(schedule=schedule, chunk_samples=500_000),
        loader=Loader(num_workers=0, seed=seed),
    )
    curve_path = os.path.join(workdir, f"curve_{schedule}_{seed}.json")
    curve = _Curve(curve_path)
    common = dict(
        accelerator="cpu",
        devices=args.devices,
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if args.devices > 1:
        common["strategy"] = "ddp_spawn"
    t0 = time.perf_counter()
    # The loss before any step: equal for every schedule of a seed (same weights, same batches). Under
    # no_grad, not inference_mode: the metric's states reset in inference mode could not be updated by fit.
    initial = pl.Trainer(inference_mode=False, **common).validate(model, datamodule=dm, verbose=False)[0][
        "val/loss"
    ]
    trainer = pl.Trainer(
        max_epochs=args.epochs,
        num_sanity_val_steps=0,
        callbacks=[curve],
        reload_dataloaders_every_n_epochs=1,  # every epoch has its own planned length
        **common,
    )
    trainer.fit(model, datamodule=dm)
    with open(curve_path) as f:
        epochs = json.load(f)
    return {
        "schedule": schedule,
        "seed": seed,
        "max_tokens": max_tokens,
        "initial_val_loss": float(initial),
        "epochs": epochs,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def summarise(runs: list[dict]) -> dict:
    """Per schedule: mean, std, min and max of val/loss per epoch; steps per epoch; paired differences."""
    out: dict = {}
    for schedule in SCHEDULES:
        rs = [r for r in runs if r["schedule"] == schedule]
        if not rs:
            continue
        n_epochs = min(len(r["epochs"]) for r in rs)
        per_epoch = []
        for e in range(n_epochs + 1):  # 0: before training
            vals = [r["initial_val_loss"] if e == 0 else r["epochs"][e - 1]["val_loss"] for r in rs]
            per_epoch.append(
                {
                    "epoch": e,
                    "mean": statistics.fmean(vals),
                    "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
                    "min": min(vals),
                    "max": max(vals),
                }
            )
        finals = [r["epochs"][-1]["val_loss"] for r in rs]
        out[schedule] = {
            "seeds": [r["seed"] for r in rs],
            "final_val_loss_mean": statistics.fmean(finals),
            "final_val_loss_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "final_val_loss": finals,
            "steps_per_epoch": sorted({ep["steps"] for r in rs for ep in r["epochs"]}),
            "total_steps_mean": statistics.fmean(r["epochs"][-1]["global_step"] for r in rs),
            "samples_per_epoch": sorted({ep["samples"] for r in rs for ep in r["epochs"]}),
            "tokens_per_step_mean": statistics.fmean(
                ep["tokens"] / ep["steps"] for r in rs for ep in r["epochs"]
            ),
            "tokens_per_epoch": sorted({ep["tokens"] for r in rs for ep in r["epochs"]}),
            "global_step_per_epoch_mean": [
                statistics.fmean(r["epochs"][e]["global_step"] for r in rs) for e in range(n_epochs)
            ],
            "mixed_class_steps_share": statistics.fmean(
                ep["mixed_steps"] / ep["steps"] for r in rs for ep in r["epochs"]
            ),
            "val_loss_per_epoch": per_epoch,
        }
    base = {r["seed"]: r["epochs"][-1]["val_loss"] for r in runs if r["schedule"] == "independent"}
    base_curves = {
        r["seed"]: [ep["val_loss"] for ep in r["epochs"]] for r in runs if r["schedule"] == "independent"
    }
    for schedule in ("lockstep", "packed"):
        diffs = [
            r["epochs"][-1]["val_loss"] - base[r["seed"]]
            for r in runs
            if r["schedule"] == schedule and r["seed"] in base
        ]
        if diffs and schedule in out:
            out[schedule]["paired_final_minus_independent"] = {
                "per_seed": diffs,
                "mean": statistics.fmean(diffs),
                "std": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            }
            per_epoch = []
            for e in range(len(out[schedule]["val_loss_per_epoch"]) - 1):
                d = [
                    r["epochs"][e]["val_loss"] - base_curves[r["seed"]][e]
                    for r in runs
                    if r["schedule"] == schedule and r["seed"] in base_curves
                ]
                per_epoch.append({"epoch": e + 1, "mean": statistics.fmean(d), "min": min(d), "max": max(d)})
            out[schedule]["paired_minus_independent_per_epoch"] = per_epoch
    return out


def plot(result: dict, path: str) -> None:
    """Mean val/loss per schedule against epochs (and tokens seen) and against optimizer steps, with a
    min-max band over seeds, and the paired differences from ``independent`` per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colors = {"independent": "tab:gray", "lockstep": "tab:blue", "packed": "tab:orange"}
    fig, (ax, sx, dx) = plt.subplots(1, 3, figsize=(17, 4.6))
    st = result["settings"]
    caps = st.get("max_tokens_per_schedule") or {}
    for schedule, s in result["summary"].items():
        rows = s["val_loss_per_epoch"][1:]  # epoch 0 (before training, ~1.9) would flatten the curves
        x = [r["epoch"] for r in rows]
        tps = s["tokens_per_step_mean"]
        label = (
            f"{schedule} (max_tokens {caps.get(schedule, st['max_tokens'])}, "
            f"{'/'.join(map(str, s['steps_per_epoch']))} steps/epoch, {tps:.0f} tokens/step)"
        )
        for axis, xs in ((ax, x), (sx, s.get("global_step_per_epoch_mean", x))):
            axis.plot(xs, [r["mean"] for r in rows], "-o", ms=3, color=colors[schedule], label=label)
            axis.fill_between(
                xs,
                [r["min"] for r in rows],
                [r["max"] for r in rows],
                color=colors[schedule],
                alpha=0.18,
                lw=0,
            )
    first = next(iter(result["summary"].values()))
    tokens_per_epoch = first.get("tokens_per_epoch", [0])[0]
    start = first["val_loss_per_epoch"][0]["mean"]
    ax.set_xlabel(f"epochs trained (every sample once per epoch; before training: {start:.2f})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if tokens_per_epoch:
        top = ax.secondary_xaxis(
            "top", functions=(lambda e: e * tokens_per_epoch / 1e6, lambda t: t * 1e6 / tokens_per_epoch)
        )
        top.set_xlabel(
            f"tokens seen (millions; {tokens_per_epoch:,} per epoch in every schedule)", fontsize=8
        )
    ax.set_ylabel("val/loss (token-weighted flow-matching MSE)")
    matched = "matched tokens/step" if st.get("match_tokens") else "one max_tokens for all (unmatched)"
    ax.set_title(
        f"tiny VideoDiT, CPU, {st['devices']} process(es), {matched}, seeds {','.join(map(str, st['seeds']))}",
        fontsize=9,
        pad=30 if tokens_per_epoch else None,
    )
    sx.set_xlabel("optimizer steps")
    sx.set_title("the same curves against optimizer steps: mean, min-max band", fontsize=9)
    for axis in (ax, sx):
        axis.grid(alpha=0.3)
    ax.legend(fontsize=7)
    dx.axhline(0.0, color=colors["independent"], lw=1)
    for schedule, s in result["summary"].items():
        rows = s.get("paired_minus_independent_per_epoch")
        if not rows:
            continue
        x = [r["epoch"] for r in rows]
        dx.plot(
            x,
            [r["mean"] for r in rows],
            "-o",
            ms=3,
            color=colors[schedule],
            label=f"{schedule} - independent",
        )
        dx.fill_between(
            x, [r["min"] for r in rows], [r["max"] for r in rows], color=colors[schedule], alpha=0.18, lw=0
        )
    dx.set_xlabel("epochs trained")
    dx.set_ylabel("val/loss difference, same seed")
    dx.set_title("paired by seed (same initial weights and validation batches): mean, min-max", fontsize=9)
    dx.xaxis.set_major_locator(MaxNLocator(integer=True))
    dx.grid(alpha=0.3)
    dx.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--num-samples", type=int, default=512)
    parser.add_argument("--val-samples", type=int, default=64)
    parser.add_argument("--mix", default="tiny")
    parser.add_argument("--content", default="structured", choices=["structured", "noise"])
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument(
        "--match-tokens",
        action="store_true",
        help="lower packed's max_tokens until its planned mean tokens per step meets independent's",
    )
    parser.add_argument(
        "--match-epochs", type=int, default=None, help="epochs planned per seed to match (default: --epochs)"
    )
    parser.add_argument("--match-min-tokens", type=int, default=256, help="lowest packed max_tokens tried")
    parser.add_argument(
        "--reuse",
        default=None,
        help="an earlier result with the same settings: take its runs of the schedules not in --schedules",
    )
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--devices", type=int, default=1, help="processes per run (>1: DDP over gloo)")
    # One thread: on a shared 2-core machine two threads per process ran 7-10x slower (oversubscription).
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (0: torch default)")
    parser.add_argument("--workdir", default=None, help="where the shards go (default: a temp folder)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "convergence_cpu.png"))
    parser.add_argument(
        "--from-json", default=None, help="re-summarise and re-plot a result file; no training"
    )
    args = parser.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            result = json.load(f)
        if args.reuse:
            merge_reused(result, args.reuse)
        result["summary"] = summarise(result["runs"])
        write_and_report(result, args.out or args.from_json, args.plot)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # for ddp_spawn's worker processes
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    today = datetime.date.today().isoformat()
    out = args.out or os.path.join(BENCH, "results", f"convergence_cpu_{today}.json")
    workdir = args.workdir or tempfile.mkdtemp(prefix="convergence_")
    t0 = time.perf_counter()
    train, val = make_data(workdir, args.num_samples, args.val_samples, args.mix, args.content)
    args.match_epochs = args.match_epochs or args.epochs
    caps, planned = matched_max_tokens(train, args)
    for schedule, p in planned["per_schedule"].items():
        print(
            f"{schedule:12s} max_tokens {caps[schedule]}: planned {p['tokens_per_step']:.1f} tokens/step, "
            f"{p['steps_per_epoch']:.1f} steps/epoch",
            flush=True,
        )
    runs = []
    for seed in args.seeds:
        for schedule in args.schedules.split(","):
            run = run_one(schedule, seed, args, train, val, workdir, caps[schedule])
            last = run["epochs"][-1]
            print(
                f"{schedule:12s} seed {seed}: val/loss {run['initial_val_loss']:.4f} -> {last['val_loss']:.4f} "
                f"after {len(run['epochs'])} epochs, {last['global_step']} steps, {run['seconds']:.0f}s",
                flush=True,
            )
            runs.append(run)
    schedules = args.schedules.split(",")
    result = {
        "settings": {
            "schedules": schedules,
            "seeds": args.seeds,
            "epochs": args.epochs,
            "num_samples": args.num_samples,
            "val_samples": args.val_samples,
            "mix": args.mix,
            "content": args.content,
            "text": None,
            "max_tokens": args.max_tokens,
            "match_tokens": args.match_tokens,
            "max_tokens_per_schedule": caps,
            "val_max_tokens": args.max_tokens,
            "mode": "equal_tokens",
            "model": "tiny",
            "optimizer": "AdamW",
            "lr": args.lr,
            "warmup_steps": args.warmup_steps,
            "shift": 1.0,
            "val_timesteps": list(SamplingSettings().val_timesteps),
            "devices": args.devices,
            "precision": "32-true",
            "threads_per_process": args.threads,
            "mixed_steps": "steps whose global batch (all ranks) holds more than one frame count",
        },
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "lightning": pl.__version__,
            "python": platform.python_version(),
        },
        "date": today,
        "planned": planned,
        "runs": runs,
        "summary": summarise(runs),
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    if args.reuse:
        merge_reused(result, args.reuse)
        result["summary"] = summarise(result["runs"])
    write_and_report(result, out, args.plot)


# The settings a reused run must share with this invocation (besides the seed).
_REUSE_KEYS = (
    "epochs",
    "num_samples",
    "val_samples",
    "mix",
    "content",
    "max_tokens",
    "lr",
    "warmup_steps",
    "devices",
)


def merge_reused(result: dict, path: str) -> None:
    """Add to ``result`` the runs of ``path`` (an earlier result) for the schedules it did not run and the
    seeds it ran, each marked ``"reused_from"``: a schedule whose cap and settings are unchanged need not be
    trained again (a run is deterministic for its seed up to float32 rounding: its val/loss curve agrees to ~1e-7).

    Raises:
        ValueError: the earlier result was made with other settings (names the key), or lacks a seed.
    """
    with open(path) as f:
        earlier = json.load(f)
    st = result["settings"]
    for key in _REUSE_KEYS:
        if st.get(key) != earlier["settings"].get(key):
            raise ValueError(
                f"--reuse {path}: its settings[{key!r}] is {earlier['settings'].get(key)!r}, this run's is "
                f"{st.get(key)!r}; reuse only a result made with the same settings"
            )
    reused = []
    for schedule in SCHEDULES:
        if schedule in st["schedules"]:
            continue
        have = {r["seed"]: r for r in earlier["runs"] if r["schedule"] == schedule}
        if not have:
            continue
        missing = sorted(set(st["seeds"]) - set(have))
        if missing:
            raise ValueError(
                f"--reuse {path}: no {schedule} run for seeds {missing}; run them or drop the seeds"
            )
        cap = (
            earlier["settings"]
            .get("max_tokens_per_schedule", {})
            .get(schedule, earlier["settings"]["max_tokens"])
        )
        for seed in st["seeds"]:
            reused.append({**have[seed], "max_tokens": cap, "reused_from": os.path.relpath(path, ROOT)})
        st.setdefault("max_tokens_per_schedule", {})[schedule] = cap
    result["runs"] = reused + result["runs"]
    st["schedules"] = [s for s in SCHEDULES if any(r["schedule"] == s for r in result["runs"])]
    st["reused_runs_from"] = os.path.relpath(path, ROOT)


def write_and_report(result: dict, out: str, plot_path: str | None) -> None:
    """Write the result JSON, print the summary, draw the plot."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out}")
    for schedule, s in result["summary"].items():
        paired = s.get("paired_final_minus_independent")
        print(
            f"{schedule:12s} final val/loss {s['final_val_loss_mean']:.4f} +- {s['final_val_loss_std']:.4f} "
            f"(steps/epoch {s['steps_per_epoch']}, mixed-class steps {100 * s['mixed_class_steps_share']:.0f}%)"
            + (f", paired vs independent {paired['mean']:+.4f} +- {paired['std']:.4f}" if paired else "")
        )
    if plot_path:
        try:
            plot(result, plot_path)
            print(f"wrote {plot_path}")
        except ImportError:
            print("matplotlib is not installed: no plot")


if __name__ == "__main__":
    main()
