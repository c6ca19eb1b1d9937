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
:func:`lightning_adaptiveload.data.synthetic.structured_latent`): smooth fields in a low-dimensional
channel subspace, partly shared by all shapes and partly owned by each frame count, plus a little noise.
i.i.d. noise latents would leave a model almost nothing to learn.

With one process (the default) ``independent`` and ``lockstep`` both form single-shape batches (a bucketed
batch is one tensor); only across ranks does an ``independent`` step mix classes. ``--devices 2`` runs
DDP with 2 gloo processes per run (``ddp_spawn``, one thread each).

Usage::

    python benchmarks/balance/convergence.py                       # 3 schedules x seeds 0,1,2: ~12 min on 2 shared cores
    python benchmarks/balance/convergence.py --epochs 2 --seeds 0  # a quick look (~30 s)
    python benchmarks/balance/convergence.py --from-json RESULT.json  # re-summarise and re-plot, no training

Writes ``benchmarks/results/convergence_cpu_<date>.json`` (settings, machine, every run's per-epoch curve,
summary per schedule) and ``docs/img/convergence_cpu.png``. Results: ``docs/convergence.md``.
"""

from __future__ import annotations

import argparse
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
from lightning_adaptiveload.data import write_synthetic_shards

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


def make_data(workdir: str, num_samples: int, val_samples: int, mix: str, content: str) -> tuple[str, str]:
    """Training and validation shards, written once and reused by every run (no text states: synthetic
    text would be noise unrelated to the latents)."""
    train, val = os.path.join(workdir, "train"), os.path.join(workdir, "val")
    common = dict(mix=mix, samples_per_shard=32, text_len_range=None, content=content, progress=False)
    write_synthetic_shards(train, num_samples=num_samples, seed=0, **common)
    write_synthetic_shards(val, num_samples=val_samples, seed=1, **common)
    return train, val


def run_one(schedule: str, seed: int, args: argparse.Namespace, train: str, val: str, workdir: str) -> dict:
    """One training run; returns its per-epoch curve, its initial val/loss and its wall time."""
    pl.seed_everything(seed, workers=True, verbose=False)
    model = VideoDiTModule(preset="tiny", lr=args.lr, warmup_steps=args.warmup_steps, shift=1.0)
    # Built here, under the seed, whatever the process count: ddp_spawn copies these weights to its
    # workers and back.
    model.configure_model()
    dm = AdaptiveLoadDataModule(
        train_shards=train,
        val_shards=val,
        max_tokens=args.max_tokens,
        mode="equal_tokens",
        schedule=schedule,
        num_workers=0,
        seed=seed,
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
    trainer = pl.Trainer(max_epochs=args.epochs, num_sanity_val_steps=0, callbacks=[curve], **common)
    trainer.fit(model, datamodule=dm)
    with open(curve_path) as f:
        epochs = json.load(f)
    return {
        "schedule": schedule,
        "seed": seed,
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
    """Mean val/loss per epoch per schedule with a min-max band over seeds (and each seed thin)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colors = {"independent": "tab:gray", "lockstep": "tab:blue", "packed": "tab:orange"}
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(12, 4.4))
    for schedule, s in result["summary"].items():
        rows = s["val_loss_per_epoch"][1:]  # epoch 0 (before training, ~1.9) would flatten the curves
        x = [r["epoch"] for r in rows]
        ax.plot(
            x,
            [r["mean"] for r in rows],
            "-o",
            ms=3,
            color=colors[schedule],
            label=f"{schedule} ({'/'.join(map(str, s['steps_per_epoch']))} steps/epoch)",
        )
        ax.fill_between(
            x, [r["min"] for r in rows], [r["max"] for r in rows], color=colors[schedule], alpha=0.18, lw=0
        )
    st = result["settings"]
    first = next(iter(result["summary"].values()))["val_loss_per_epoch"][0]["mean"]
    ax.set_xlabel(f"epochs trained (every sample once per epoch; before training: {first:.2f})")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("val/loss (token-weighted flow-matching MSE)")
    ax.set_title(
        f"tiny VideoDiT, CPU, {st['devices']} process(es), {st['num_samples']} {st['content']} samples, "
        f"seeds {','.join(map(str, st['seeds']))}: mean, min-max band",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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
    runs = []
    for seed in args.seeds:
        for schedule in args.schedules.split(","):
            run = run_one(schedule, seed, args, train, val, workdir)
            last = run["epochs"][-1]
            print(
                f"{schedule:12s} seed {seed}: val/loss {run['initial_val_loss']:.4f} -> {last['val_loss']:.4f} "
                f"after {len(run['epochs'])} epochs, {last['global_step']} steps, {run['seconds']:.0f}s",
                flush=True,
            )
            runs.append(run)
    result = {
        "settings": {
            "schedules": args.schedules.split(","),
            "seeds": args.seeds,
            "epochs": args.epochs,
            "num_samples": args.num_samples,
            "val_samples": args.val_samples,
            "mix": args.mix,
            "content": args.content,
            "text": None,
            "max_tokens": args.max_tokens,
            "mode": "equal_tokens",
            "model": "tiny",
            "optimizer": "AdamW",
            "lr": args.lr,
            "warmup_steps": args.warmup_steps,
            "shift": 1.0,
            "val_timesteps": list(VideoDiTModule().hparams.val_timesteps),
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
        "runs": runs,
        "summary": summarise(runs),
        "total_seconds": round(time.perf_counter() - t0, 1),
    }
    write_and_report(result, out, args.plot)


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
