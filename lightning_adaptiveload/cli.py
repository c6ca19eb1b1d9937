"""Command line: ``python -m lightning_adaptiveload`` / ``lightning-adaptiveload``.

Training goes through :class:`~lightning.pytorch.cli.LightningCLI` (``fit``, ``validate``, ``test``,
``predict`` with ``--config`` YAML recipes whose ``model`` and ``data`` sections take ``class_path`` /
``init_args``); the data tools are plain subcommands dispatched before LightningCLI sees the arguments::

    lightning-adaptiveload fit --config recipes/quickstart.yaml
    lightning-adaptiveload synth --out data/mine --mix tiny
    lightning-adaptiveload index data/mine
    lightning-adaptiveload calibrate --recipe recipes/wan13b_480p_dual.yaml --mix wan21_480p --out cal.yaml
    lightning-adaptiveload simulate ...
    lightning-adaptiveload build-ops
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["build_cli", "main", "COMMANDS"]

# name -> (module, function, one-line help). Imported only when used, so that `fit` does not pay for
# them and a missing optional part only breaks its own command.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "synth": (
        "lightning_adaptiveload.shards",
        "synth_main",
        "write synthetic latent shards following a length mix",
    ),
    "index": ("lightning_adaptiveload.shards", "index_main", "build or verify index.json for latent shards"),
    "calibrate": (
        "lightning_adaptiveload.calibrate",
        "main",
        "time the model on this device, fit the cost model, find the token budget -> YAML fragment",
    ),
    "simulate": (
        "lightning_adaptiveload.simulate",
        "main",
        "simulate batch planning: balance per mode and world size",
    ),
    "build-ops": ("lightning_adaptiveload.ops._build", "main", "compile the fused CUDA op ahead of time"),
    "ingest": (
        "lightning_adaptiveload.cli",
        "ingest_main",
        "encode videos and images into latent shards (Wan VAE)",
    ),
}

_LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


def _load(name: str) -> Any:
    module_name, func_name, _ = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and (err.name == module_name or module_name.startswith(err.name + ".")):
            raise SystemExit(
                f"lightning-adaptiveload {name}: this installation has no {module_name} module; "
                "reinstall the package (pip install -e .) or update it"
            ) from None
        raise SystemExit(
            f"lightning-adaptiveload {name}: {module_name} needs {err.name!r}, which is not installed; "
            f"install it (pip install {err.name})"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise SystemExit(
            f"lightning-adaptiveload {name}: {module_name} has no {func_name}(argv); update the package"
        )
    return func


def build_cli(args: Sequence[str] | None = None, run: bool = True, **kwargs: Any):
    """The package's LightningCLI: any ``VideoDiTModule`` subclass as model, any ``AdaptiveLoadDataModule``
    subclass as data (both with ``class_path`` / ``init_args``), and a saved config that a repeated run
    overwrites instead of failing on.

    Args:
        args: command line (without the program name); None reads ``sys.argv``.
        run: run the subcommand (False: only parse and instantiate, e.g. to check a recipe).
        **kwargs: passed to ``LightningCLI``.
    """
    from lightning.pytorch.cli import LightningCLI

    try:
        from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
        from lightning_adaptiveload.module import VideoDiTModule
    except ModuleNotFoundError as err:
        raise SystemExit(
            f"lightning-adaptiveload: cannot load the training classes ({err}); reinstall the package "
            "(pip install -e .) or install the missing dependency"
        ) from None

    options: dict[str, Any] = dict(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": "Load-balanced training of video DiTs on mixed-length data."},
    )
    options.update(kwargs)
    return LightningCLI(VideoDiTModule, AdaptiveLoadDataModule, args=args, run=run, **options)


def _usage() -> str:
    width = max(len(n) for n in (*COMMANDS, *_LIGHTNING_COMMANDS))
    lines = [
        "usage: lightning-adaptiveload COMMAND [options]",
        "",
        "training (LightningCLI; --config RECIPE.yaml):",
    ]
    lines += [f"  {n:<{width}}  see `lightning-adaptiveload {n} --help`" for n in _LIGHTNING_COMMANDS]
    lines += ["", "tools:"]
    lines += [f"  {n:<{width}}  {help_}" for n, (_, _, help_) in COMMANDS.items()]
    lines += ["", "example: lightning-adaptiveload fit --config recipes/quickstart.yaml"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        return int(_load(argv[0])(argv[1:]) or 0)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    # From the command line LightningCLI reads sys.argv itself (and DDP re-launches the same command).
    build_cli(None if from_command_line else argv)
    return 0


def ingest_main(argv: Sequence[str]) -> int:
    """``lightning-adaptiveload ingest INPUTS --out DIR --vae VAE_DIR [...]``: see ``docs/ingest.md``.

    Exits 0 when every input was written (or was already), 1 when some were skipped, 2 on bad arguments.
    """
    import argparse
    import json

    p = argparse.ArgumentParser(
        prog="lightning-adaptiveload ingest",
        description="Encode videos and images into latent shards with Wan's VAE (Trainer.predict; resumable).",
    )
    p.add_argument(
        "inputs", help="a folder of videos/images (captions in <file>.txt) or a CSV/JSONL manifest"
    )
    p.add_argument("--out", required=True, help="output folder (a rerun skips what is already written)")
    p.add_argument(
        "--vae", required=True, help="folder of a diffusers AutoencoderKLWan (e.g. <Wan2.1-Diffusers>/vae)"
    )
    p.add_argument(
        "--text-encoder", default=None, help="folder of a transformers UMT5EncoderModel; omit for no text"
    )
    p.add_argument("--tokenizer", default=None, help="folder of its tokenizer (default: --text-encoder)")
    p.add_argument("--fps", type=float, default=16.0, help="target frame rate; 0 = the source's (default 16)")
    p.add_argument(
        "--max-frames", type=int, default=81, help="at most this many frames, cut to 4k+1 (default 81)"
    )
    p.add_argument(
        "--buckets",
        default="wan480p",
        help="'wan480p' (480x832, 832x480, 624x624), 'HxW,HxW,...', or 'native' (own size rounded down to 16)",
    )
    p.add_argument("--samples-per-shard", type=int, default=100)
    p.add_argument("--latent-dtype", choices=("float16", "float32"), default="float16")
    p.add_argument(
        "--on-error", choices=("skip", "raise"), default="skip", help="a corrupt input: count it, or stop"
    )
    p.add_argument("--num-workers", type=int, default=2, help="decoding processes per rank")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="encoder compute dtype"
    )
    p.add_argument("--accelerator", default="auto")
    p.add_argument("--devices", default="auto", help="'auto', a count, or a list such as 0,1")
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--strategy", default="auto")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(list(argv))
    from lightning_adaptiveload.ingest import ingest

    devices: Any = args.devices
    if devices != "auto":
        devices = [int(d) for d in devices.split(",") if d] if "," in devices else int(devices)
    summary = ingest(
        args.inputs,
        args.out,
        args.vae,
        text_encoder=args.text_encoder,
        tokenizer=args.tokenizer,
        fps=args.fps or None,
        max_frames=args.max_frames,
        buckets=args.buckets,
        samples_per_shard=args.samples_per_shard,
        latent_dtype=args.latent_dtype,
        on_error=args.on_error,
        num_workers=args.num_workers,
        dtype=args.dtype,
        trainer_kwargs=dict(
            accelerator=args.accelerator, devices=devices, num_nodes=args.num_nodes, strategy=args.strategy
        ),
        progress=not args.no_progress,
    )
    print(json.dumps({"out": args.out, **summary}))
    return 1 if summary["skipped"] else 0
