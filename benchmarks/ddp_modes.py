"""Real data-parallel comparison of the batching modes: equal_tokens vs dual vs lockstep, wan-1.3b at 480p.

Runs, on one machine with 2 (or more) GPUs, the recipes ``recipes/wan13b_480p_<mode>.yaml`` through the
package's LightningCLI (``python -m lightning_adaptiveload fit --config ...``) for the same number of steps
and the same ``max_tokens`` (memory ceiling) in every mode, over synthetic shards of the wan21_480p mix
generated on the machine. Each run's :class:`~lightning_adaptiveload.monitor.callback.LoadBalanceMonitor` writes
``load_balance_ranks.csv`` (one row per rank and step) into ``<out>/<mode>/...``; the logger's
``metrics.csv`` holds the loss. ``benchmarks/ddp_modes_report.py <out>`` turns them into the comparison
table, JSON and plots.

A device call may last 10 minutes at most: run one mode per call (``--modes lockstep``); the shards are
reused when the machine is still warm (same settings: nothing is rewritten). Budget about 40 to 80 steps
per mode (a wan-1.3b step at 32760 tokens takes 1.2 to 2.8 s on an H200, plus a minute of start-up).

Example (2 x H200)::

    python benchmarks/ddp_modes.py --modes equal_tokens --steps 60 --out $OUT/ddp
    python benchmarks/ddp_modes.py --modes dual --steps 60 --out $OUT/ddp
    python benchmarks/ddp_modes.py --modes lockstep --steps 60 --out $OUT/ddp
    python benchmarks/ddp_modes_report.py $OUT/ddp      # on any machine, with the three folders together
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MODES = ("equal_tokens", "dual", "lockstep")
# mode -> (the DataModule's batching mode, its schedule)
_MODE_SETTINGS = {
    "equal_tokens": ("equal_tokens", "independent"),
    "dual": ("dual", "independent"),
    "lockstep": ("dual", "lockstep"),
}


def _recipe(pattern: str, mode: str) -> str | None:
    for name in (pattern.format(mode=mode), pattern.format(mode="dual")):
        path = name if os.path.isabs(name) else os.path.join(ROOT, name)
        if os.path.isfile(path):
            return path
    return None


def _samples_needed(steps: int, world: int, max_tokens: int, mix_name: str) -> int:
    """Samples for ``steps`` steps on ``world`` ranks in the mode with the biggest batches, plus 25%."""
    from lightning_adaptiveload.data.mixes import load_mix

    mix = load_mix(mix_name)
    per_batch = 1.0 / sum(b.p / max(1, max_tokens // b.tokens) for b in mix.buckets)
    return int(steps * world * per_batch * 1.25) + 8 * world


def make_shards(data_dir: str, num_samples: int, mix: str, text_dim: int, seed: int) -> str:
    """Write (or reuse) synthetic shards; returns the index path."""
    from lightning_adaptiveload.data import write_synthetic_shards

    index = write_synthetic_shards(
        data_dir,
        mix=mix,
        num_samples=num_samples,
        samples_per_shard=16,
        seed=seed,
        text_len_range=(64, 512),
        text_dim=text_dim,
        dtype="float16",
        progress=True,
        overwrite=True,
    )
    return index.source or os.path.join(data_dir, "index.json")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated; one per device call is safest")
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per mode (trainer.max_steps)")
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32760, help="the same in every mode (memory ceiling)")
    ap.add_argument("--mix", default="wan21_480p")
    ap.add_argument("--data", default=os.environ.get("DDP_MODES_DATA", "/tmp/adaptiveload_ddp_modes_shards"))
    ap.add_argument(
        "--text-dim", type=int, default=4096, help="umT5-XXL width, as the wan-1.3b preset expects"
    )
    ap.add_argument(
        "--samples", type=int, default=None, help="synthetic samples (default: enough for --steps)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", os.path.join(HERE, "results")), "ddp")
    )
    ap.add_argument(
        "--recipe",
        default="recipes/wan13b_480p_{mode}.yaml",
        help="{mode} is replaced; a mode without its own recipe uses the dual one (mode and schedule are set "
        "on the command line in any case)",
    )
    ap.add_argument("--set", action="append", default=[], help="extra CLI override KEY=VALUE, repeatable")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args(argv)

    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"error: unknown mode(s) {unknown}; choose from {MODES}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    n = args.samples or _samples_needed(args.steps, args.devices, args.max_tokens, args.mix)
    if not args.dry_run:
        t0 = time.perf_counter()
        make_shards(args.data, n, args.mix, args.text_dim, args.seed)
        print(f"shards: {n} samples in {args.data} ({time.perf_counter() - t0:.0f} s)", flush=True)
    runs = []
    for mode in modes:
        recipe = _recipe(args.recipe, mode)
        if recipe is None:
            print(
                f"error: no recipe {args.recipe.format(mode=mode)} (nor a dual one) under {ROOT}",
                file=sys.stderr,
            )
            return 2
        root = os.path.join(args.out, mode)
        batching, schedule = _MODE_SETTINGS[mode]
        cmd = [
            sys.executable,
            "-m",
            "lightning_adaptiveload",
            "fit",
            "--config",
            recipe,
            "--seed_everything",
            str(args.seed),
            "--trainer.max_steps",
            str(args.steps),
            "--trainer.max_epochs",
            "-1",
            "--trainer.devices",
            str(args.devices),
            "--trainer.default_root_dir",
            root,
            # One logger per mode, in the mode's folder, whatever the recipe logs to: the report reads its
            # metrics.csv for the loss curve.
            "--trainer.logger",
            "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir",
            root,
            "--trainer.limit_val_batches",
            "0",
            # A benchmark keeps no checkpoints (a wan-1.3b one with AdamW state is about 17 GB): the monitor
            # is the only callback.
            "--trainer.callbacks",
            '[{"class_path": "lightning_adaptiveload.monitor.callback.LoadBalanceMonitor"}]',
            "--trainer.enable_checkpointing",
            "false",
            # Every step is gathered and logged (one collective of a few floats: well under 1% of a step).
            "--trainer.log_every_n_steps",
            "1",
            "--data.init_args.train_shards",
            args.data,
            "--data.init_args.val_shards",
            "null",
            "--data.init_args.synthetic",
            "null",
            "--data.init_args.max_tokens",
            str(args.max_tokens),
            "--data.init_args.mode",
            batching,
            "--data.init_args.schedule",
            schedule,
        ]
        for item in args.set:
            key, _, value = item.partition("=")
            cmd += [key if key.startswith("--") else f"--{key}", value]
        print("$ " + shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        t0 = time.perf_counter()
        rc = subprocess.call(cmd, cwd=ROOT)
        runs.append({"mode": mode, "rc": rc, "seconds": time.perf_counter() - t0, "cmd": cmd})
        print(f"{mode}: rc={rc} in {runs[-1]['seconds']:.0f} s", flush=True)
        if rc != 0:
            break
    if runs:
        with open(os.path.join(args.out, f"runs_{'_'.join(modes)}.json"), "w") as f:
            json.dump(
                {"steps": args.steps, "devices": args.devices, "max_tokens": args.max_tokens, "runs": runs}, f
            )
    return max([r["rc"] for r in runs], default=0)


if __name__ == "__main__":
    sys.exit(main())
