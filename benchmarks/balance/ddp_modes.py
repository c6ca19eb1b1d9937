"""Real data-parallel comparison of the schedules: equal_tokens, dual, lockstep and packed, wan-1.3b at 480p.

Runs, on one machine with 2 or more GPUs, the recipes ``recipes/wan13b_480p_<mode>.yaml`` through the
package's LightningCLI (``python -m lightning_adaptiveload fit --config ...``) for the same number of steps
and the same ``max_tokens`` (memory ceiling) in every mode, over synthetic shards of the wan21_480p mix
generated on the machine. Each run's :class:`~lightning_adaptiveload.callbacks.load_balance.LoadBalanceMonitor`
writes ``load_balance_ranks.csv`` (one row per rank and step: compute time to the end of the rank's own
backward, and its measured ``sync_wait_s``) into ``<out>/<mode>/...``; the logger's ``metrics.csv`` holds
the loss, LightningCLI's ``config.yaml`` the settings. ``benchmarks/balance/ddp_modes_report.py <out>`` turns them
into the comparison table (beside the simulator's prediction for the same settings), JSON and plots.

Modes (``--modes``): ``equal_tokens`` (the baseline: ``B = max_tokens // S`` per rank), ``dual`` (the
AdaptiveLoad compute cap per rank), ``lockstep`` (every rank the same length class at every step, dual caps,
a packed tail) and ``packed`` (one pack of mixed shapes per rank and step).

Settings (``--settings``):

- ``fast``: the recipes as shipped (``docs/recipes.md``, "Fast by default"): per-block ``compile``, bf16
  weights with fp32 masters in ``MasterWeightAdamW``, ``checkpoint_policy: save_matmuls`` with
  ``checkpoint_blocks: auto`` and the recipes' activation memory model (``--activation-memory`` takes a
  calibration's own), ``attention_backend: auto``, the allocator's expandable segments;
- ``eager``: the eager variant, as overrides of the recipe: no compile, fp32 weights, every block
  checkpointed in full, the default attention backends, the allocator as the environment sets it.

The data does not depend on ``--steps``, ``--modes`` or ``--settings``: ``--samples`` (default 768, about
4 GB) samples drawn with ``--seed`` into a folder named by those settings, reused when it is there (a warm
machine) and written identically when it is not (a fresh one). So modes split over several device calls
train on the same data. ``--epochs 1`` runs a whole epoch in each mode instead of ``--steps``: each mode then
trains on the same samples (over a window of steps, each schedule draws other lengths, and a long clip's token
costs more than a short one's). The shards' ``index.json`` is copied to ``<out>/data_index.json``: the report
plans the same epochs over it for the simulator's prediction.

A device call lasts 10 minutes at most. ``--time-budget-s`` bounds this call's runs: each mode gets an equal
share of what is left (``trainer.max_time`` stops it cleanly, its files written; a hard timeout backs it
up), so the last mode is never cut off by the call's end. ``benchmarks/balance/gpu_ddp_modes_x4.sh`` is the
one-call script (build, shards, modes, report, tarball).

Example (4 GPUs, two calls, then the report over both)::

    python benchmarks/balance/ddp_modes.py --devices 4 --settings fast --modes equal_tokens,lockstep --steps 60 --out $RUN
    python benchmarks/balance/ddp_modes.py --devices 4 --settings fast --modes dual,packed --steps 60 --out $RUN
    python benchmarks/balance/ddp_modes_report.py $RUN
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.dirname(HERE)
ROOT = os.path.dirname(BENCH)
MODES = ("equal_tokens", "dual", "lockstep", "packed")
SETTINGS = ("eager", "fast")
# mode -> (the DataModule's batching mode, its schedule). The packed schedule sizes no batches: its batcher
# only carries max_tokens and the cost model, and equal_tokens is the mode that needs no max_compute (as in
# lightning_adaptiveload.tools.replay.VARIANTS).
_MODE_SETTINGS = {
    "equal_tokens": ("equal_tokens", "independent"),
    "dual": ("dual", "independent"),
    "lockstep": ("dual", "lockstep"),
    "packed": ("equal_tokens", "packed"),
}
DEFAULT_SAMPLES = 768
TEXT_LEN_RANGE = (64, 512)
# Seconds a run needs outside trainer.max_time (4 processes importing, each building the 1.4B-parameter model
# on the CPU, NCCL, loader workers; torch.compile runs inside the train loop, so inside max_time), and a
# margin after it (the monitor's files and plots). The hard timeout of a run is its share plus the margin.
_STARTUP_S = {"eager": 45.0, "fast": 50.0}
_MARGIN_S = 20.0


def eager_overrides() -> list[str]:
    """The command-line overrides of the ``eager`` settings (``--KEY VALUE`` pairs, flattened)."""
    return [
        "--model.init_args.compile",
        "false",
        "--model.init_args.optimizer.weight_dtype",
        "fp32",
        # The whole group: every block checkpointed in full, the allocator left to the environment.
        "--model.init_args.memory",
        json.dumps(
            {
                "activation_checkpointing": True,
                "checkpoint_policy": "full",
                "checkpoint_blocks": None,
                "expandable_segments": False,
            }
        ),
        "--model.init_args.attention_backend",
        "default",
    ]


def fast_overrides(activation_memory: dict | None) -> list[str]:
    """The command-line overrides of the ``fast`` settings: none but a calibrated activation memory model
    (the recipes ship the fast settings)."""
    if activation_memory is None:
        return []
    return [
        "--model.init_args.memory.activation_memory",
        json.dumps(activation_memory, separators=(",", ":")),
    ]


def load_activation_memory(value: str | None) -> dict | None:
    """``--activation-memory``: None (the recipe's own model), a JSON object, or a calibration fragment (YAML or
    JSON file holding ``model.init_args.memory.activation_memory``, as ``calibrate`` writes it; the flat
    ``model.init_args.activation_memory`` of earlier fragments is read too)."""
    if value is None:
        return None
    if os.path.isfile(value):
        import yaml

        with open(value, encoding="utf-8") as f:
            data = yaml.safe_load(f)
        init_args = ((data or {}).get("model") or {}).get("init_args") or {}
        memory = (init_args.get("memory") or {}).get("activation_memory") or init_args.get(
            "activation_memory"
        )
        if not isinstance(memory, dict):
            raise ValueError(
                f"--activation-memory {value}: no model.init_args.memory.activation_memory in it; pass the fragment "
                "`calibrate --checkpoint-blocks auto` wrote, or the model's numbers as a JSON object"
            )
        return memory
    try:
        memory = json.loads(value)
    except json.JSONDecodeError as err:
        raise ValueError(f"--activation-memory {value!r}: neither a file nor a JSON object ({err})") from None
    if not isinstance(memory, dict):
        raise ValueError(f"--activation-memory must be a JSON object, got {value!r}")
    return memory


def _recipe(pattern: str, mode: str) -> str | None:
    for name in (pattern.format(mode=mode), pattern.format(mode="dual")):
        path = name if os.path.isabs(name) else os.path.join(ROOT, name)
        if os.path.isfile(path):
            return path
    return None


#: Callbacks of a recipe that a benchmark run leaves out: checkpoints (a wan-1.3b one with AdamW state is about
#: 17 GB) and the monitor (set again with the run's arguments).
_LEFT_OUT = ("ModelCheckpoint", "LoadBalanceMonitor")


def recipe_callbacks(recipe: str) -> list[dict]:
    """The recipe's own ``trainer.callbacks`` (``KernelWarmup`` in the GPU recipes), but for :data:`_LEFT_OUT`:
    a benchmark runs the recipe as shipped."""
    import yaml

    with open(recipe) as f:
        conf = yaml.safe_load(f) or {}
    out = []
    for cb in (conf.get("trainer") or {}).get("callbacks") or []:
        path = cb.get("class_path", "") if isinstance(cb, dict) else str(cb)
        if path.rsplit(".", 1)[-1] not in _LEFT_OUT:
            out.append(cb if isinstance(cb, dict) else {"class_path": path})
    return out


def shard_dir(base: str, mix: str, samples: int, seed: int, text_dim: int) -> str:
    """The shards' folder under ``base``, named by everything the data depends on (so a call with other
    settings never overwrites, and one with the same settings finds them)."""
    lo, hi = TEXT_LEN_RANGE
    return os.path.join(base, f"{mix}_n{samples}_seed{seed}_text{lo}-{hi}x{text_dim}")


def make_shards(data_dir: str, num_samples: int, mix: str, text_dim: int, seed: int) -> tuple[str, bool]:
    """Write the synthetic shards, or reuse them when ``data_dir`` holds the same ones; deterministic for a
    seed. Returns ``(index path, reused)``."""
    import dataclasses

    from lightning_adaptiveload.shards.synthetic import (
        NotSyntheticDataError,
        SyntheticShards,
        write_synthetic_shards,
    )

    index_path = os.path.join(data_dir, "index.json")
    before = os.path.getmtime(index_path) if os.path.isfile(index_path) else None
    settings = SyntheticShards(
        mix=mix,
        num_samples=num_samples,
        samples_per_shard=16,
        seed=seed,
        text_len_range=TEXT_LEN_RANGE,
        text_dim=text_dim,
        dtype="float16",
    )
    try:
        index = write_synthetic_shards(data_dir, settings, progress=True)
    except NotSyntheticDataError:
        raise
    except FileExistsError:
        # Shards of other settings in this folder (only a hand-given --data can hold them): replace them.
        index = write_synthetic_shards(data_dir, dataclasses.replace(settings, overwrite=True), progress=True)
    path = index.source or index_path
    reused = before is not None and os.path.getmtime(path) == before
    return path, reused


def build_command(
    mode: str,
    *,
    recipe: str,
    out: str,
    data: str,
    steps: int,
    devices: int,
    epochs: int | None = None,
    max_tokens: int,
    seed: int,
    settings: str,
    activation_memory: dict | None = None,
    max_time_s: float | None = None,
    stall_stacks_s: float | None = None,
    callbacks: list[dict] = (),
    without: list[str] = (),
    extra: list[str] = (),
    python: str = sys.executable,
) -> tuple[dict[str, str], list[str]]:
    """The environment additions and the command line of one mode's run.

    Returns:
        ``(env, argv)``: the variables to set (none today: the recipes set the allocator) and the ``fit`` command.
    """
    if mode not in _MODE_SETTINGS:
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    if settings not in SETTINGS:
        raise ValueError(f"unknown settings {settings!r}; choose from {SETTINGS}")
    root = os.path.join(out, mode)
    batching, schedule = _MODE_SETTINGS[mode]
    # stall_stacks_s: every thread's stack, dumped while a step runs longer (is a stall a compile?)
    monitor_args = {} if stall_stacks_s is None else {"init_args": {"stall_stacks_s": stall_stacks_s}}
    cmd = [
        python,
        "-m",
        "lightning_adaptiveload",
        "fit",
        "--config",
        recipe,
        "--seed_everything",
        str(seed),
        # --epochs: whole epochs (every mode trains on the same samples), else --steps steps.
        "--trainer.max_steps",
        "-1" if epochs else str(steps),
        "--trainer.max_epochs",
        str(epochs) if epochs else "-1",
        "--trainer.devices",
        str(devices),
        "--trainer.default_root_dir",
        root,
        # One logger per mode, in the mode's folder, whatever the recipe logs to: the report reads its
        # metrics.csv for the loss curve. Flushed every 10 steps, so a run cut short keeps its loss.
        "--trainer.logger",
        "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir",
        root,
        "--trainer.logger.init_args.flush_logs_every_n_steps",
        "10",
        "--trainer.limit_val_batches",
        "0",
        # The monitor, the recipe's own callbacks but checkpoints (_LEFT_OUT), then --callback's.
        "--trainer.callbacks",
        json.dumps(_callbacks(recipe, monitor_args, callbacks, without)),
        "--trainer.enable_checkpointing",
        "false",
        # Every step is gathered and logged (one collective of a few floats: well under 1% of a step).
        "--trainer.log_every_n_steps",
        "1",
        "--data.init_args.train_shards",
        data,
        "--data.init_args.val_shards",
        "null",
        "--data.init_args.synthetic",
        "null",
        "--data.init_args.batching.max_tokens",
        str(max_tokens),
        "--data.init_args.batching.sizing",
        batching,
        "--data.init_args.plan.schedule",
        schedule,
    ]
    if max_time_s is not None:
        # Lightning's Timer stops the run cleanly (end-of-fit files written) when the time is up.
        secs = max(30, int(max_time_s))
        cmd += ["--trainer.max_time", f"00:{secs // 3600:02d}:{secs % 3600 // 60:02d}:{secs % 60:02d}"]
    env: dict[str, str] = {}
    cmd += fast_overrides(activation_memory) if settings == "fast" else eager_overrides()
    for item in extra:
        key, _, value = item.partition("=")
        cmd += [key if key.startswith("--") else f"--{key}", value]
    return env, cmd


def _callbacks(recipe: str, monitor_args: dict, extra: list[dict], without: list[str] = ()) -> list[dict]:
    """The monitor, the recipe's callbacks (but those of a class in ``without`` or given again in ``extra``),
    then ``extra``."""

    def name(cb: dict) -> str:
        return cb["class_path"].rsplit(".", 1)[-1]

    given = {name(cb) for cb in extra} | set(without)
    kept = [cb for cb in recipe_callbacks(recipe) if name(cb) not in given]
    return [
        {"class_path": "lightning_adaptiveload.callbacks.load_balance.LoadBalanceMonitor", **monitor_args},
        *kept,
        *extra,
    ]


def _callback_arg(text: str) -> dict:
    """``--callback``: a JSON object with a ``class_path`` (an ``argparse`` type: a bad one is a usage error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict) or not isinstance(value.get("class_path"), str):
        raise argparse.ArgumentTypeError(
            f'want {{"class_path": "pkg.mod.Class", "init_args": {{...}}}}, got {text!r}'
        )
    return value


def _run(cmd: list[str], env: dict[str, str], timeout_s: float | None) -> int:
    """Run one mode in its own process group; on the hard timeout the group (DDP's ranks with it) ends."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env}, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"hard timeout after {timeout_s:.0f} s: ending the run's process group", flush=True)
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            return proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}")
    ap.add_argument(
        "--settings", default="eager", choices=SETTINGS, help="eager: the recipes'; fast: see above"
    )
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per mode (trainer.max_steps)")
    ap.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="run whole epochs instead of --steps: every mode then trains on the same samples, so its tokens/s "
        "is an epoch's, not that of the lengths its first steps drew",
    )
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32760, help="the same in every mode (memory ceiling)")
    ap.add_argument("--mix", default="wan21_480p")
    ap.add_argument(
        "--data",
        default=os.environ.get("DDP_MODES_DATA", "/tmp/adaptiveload_ddp_modes_shards"),
        help="base folder of the shards (a sub-folder is named by mix, samples, seed and text settings)",
    )
    ap.add_argument(
        "--text-dim", type=int, default=4096, help="umT5-XXL width, as the wan-1.3b preset expects"
    )
    ap.add_argument(
        "--samples",
        type=int,
        default=DEFAULT_SAMPLES,
        help="synthetic samples (fixed, so every call trains on the same data; about 5.3 MB each)",
    )
    ap.add_argument("--seed", type=int, default=0, help="seeds the data and seed_everything")
    ap.add_argument(
        "--out", default=os.path.join(os.environ.get("OUT", os.path.join(BENCH, "results")), "ddp")
    )
    ap.add_argument(
        "--recipe",
        default="recipes/wan13b_480p_{mode}.yaml",
        help="{mode} is replaced; a mode without its own recipe uses the dual one (mode and schedule are set "
        "on the command line in any case)",
    )
    ap.add_argument(
        "--activation-memory",
        default=None,
        help="fast settings: the memory model for checkpoint_blocks auto, a JSON object or a calibration "
        "fragment (default: gpu_fit_fast.sh's, run 29's bf16 fit plus DDP's gradient buckets)",
    )
    ap.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="wall seconds for all of this call's runs: each mode gets an equal share of what is left",
    )
    ap.add_argument("--set", action="append", default=[], help="extra CLI override KEY=VALUE, repeatable")
    ap.add_argument(
        "--without",
        action="append",
        default=[],
        metavar="CLASS",
        help="leave the recipe's callback of this class name out (e.g. KernelWarmup), repeatable",
    )
    ap.add_argument(
        "--callback",
        action="append",
        default=[],
        type=_callback_arg,
        help='a callback beside the monitor, as JSON {"class_path": ..., "init_args": {...}}, repeatable '
        "(e.g. benchmarks.balance.step_probe.StepProbe; needs the repository root on PYTHONPATH)",
    )
    ap.add_argument(
        "--stall-stacks-s",
        type=float,
        default=None,
        help="the monitor dumps every thread's stack while a step runs longer than this (stall_stacks_rank*.txt)",
    )
    ap.add_argument("--dry-run", action="store_true", help="print the commands only (no data, no runs)")
    ap.add_argument("--shards-only", action="store_true", help="write (or find) the shards, then stop")
    args = ap.parse_args(argv)

    if args.epochs is not None and args.epochs < 1:
        print(f"error: --epochs {args.epochs}: give 1 or more (or leave it out for --steps)", file=sys.stderr)
        return 2
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        print(f"error: unknown mode(s) {unknown or modes}; choose from {MODES}", file=sys.stderr)
        return 2
    try:
        memory = load_activation_memory(args.activation_memory) if args.settings == "fast" else None
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    started = time.monotonic()
    data_dir = shard_dir(args.data, args.mix, args.samples, args.seed, args.text_dim)
    if not args.dry_run:
        os.makedirs(args.out, exist_ok=True)
        t0 = time.perf_counter()
        index_path, reused = make_shards(data_dir, args.samples, args.mix, args.text_dim, args.seed)
        print(
            f"shards: {args.samples} samples in {data_dir} ({'reused' if reused else 'written'}, "
            f"{time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        shutil.copyfile(index_path, os.path.join(args.out, "data_index.json"))
        if args.shards_only:
            return 0
    runs = []
    for k, mode in enumerate(modes):
        recipe = _recipe(args.recipe, mode)
        if recipe is None:
            print(
                f"error: no recipe {args.recipe.format(mode=mode)} (nor a dual one) under {ROOT}",
                file=sys.stderr,
            )
            return 2
        share = hard = None
        if args.time_budget_s is not None:
            left = args.time_budget_s - (time.monotonic() - started)
            share = left / (len(modes) - k)
            hard = share + _MARGIN_S
            if share < _STARTUP_S[args.settings] + _MARGIN_S + 30:
                print(f"{mode}: skipped, {left:.0f} s left for {len(modes) - k} mode(s)", flush=True)
                runs.append({"mode": mode, "rc": None, "skipped": "no time left"})
                continue
        env, cmd = build_command(
            mode,
            recipe=recipe,
            out=args.out,
            data=data_dir,
            steps=args.steps,
            epochs=args.epochs,
            devices=args.devices,
            max_tokens=args.max_tokens,
            seed=args.seed,
            settings=args.settings,
            activation_memory=memory,
            max_time_s=None if share is None else share - _STARTUP_S[args.settings] - _MARGIN_S,
            stall_stacks_s=args.stall_stacks_s,
            callbacks=args.callback,
            without=args.without,
            extra=args.set,
        )
        prefix = " ".join(f"{key}={shlex.quote(value)}" for key, value in env.items())
        print("$ " + (prefix + " " if prefix else "") + shlex.join(cmd), flush=True)
        if args.dry_run:
            continue
        t0 = time.perf_counter()
        rc = _run(cmd, env, hard)
        runs.append({"mode": mode, "rc": rc, "seconds": time.perf_counter() - t0, "env": env, "cmd": cmd})
        print(f"{mode}: rc={rc} in {runs[-1]['seconds']:.0f} s", flush=True)
    if runs:
        meta = {
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "settings": args.settings,
            "steps": None if args.epochs else args.steps,
            "epochs": args.epochs,
            "devices": args.devices,
            "max_tokens": args.max_tokens,
            "mix": args.mix,
            "samples": args.samples,
            "seed": args.seed,
            "text_len_range": list(TEXT_LEN_RANGE),
            "text_dim": args.text_dim,
            "data": data_dir,
            "activation_memory": memory,
            "time_budget_s": args.time_budget_s,
            "runs": runs,
        }
        name = f"runs_{args.settings}_{'_'.join(modes)}.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(meta, f, indent=1)
    rcs = [r["rc"] for r in runs if r.get("rc") is not None]
    failed = [r for r in runs if r.get("rc") not in (0, None)]
    return 1 if failed or (runs and not rcs) else 0


if __name__ == "__main__":
    sys.exit(main())
