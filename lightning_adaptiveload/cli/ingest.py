"""``lightning-adaptiveload ingest``: videos and images to latent shards.

The command line of :func:`lightning_adaptiveload.data.ingest.ingest` (Wan's VAE through
``Trainer.predict``, resumable); prints a JSON summary. See ``docs/ingest.md``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
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
    p.add_argument("--samples-per-shard", type=int, default=100, help="samples per output shard (100)")
    p.add_argument(
        "--latent-dtype",
        choices=("float16", "float32"),
        default="float16",
        help="dtype of the stored latents",
    )
    p.add_argument(
        "--on-error", choices=("skip", "raise"), default="skip", help="a corrupt input: count it, or stop"
    )
    p.add_argument("--num-workers", type=int, default=2, help="decoding processes per rank")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="encoder compute dtype"
    )
    p.add_argument("--accelerator", default="auto", help="Trainer accelerator (default auto)")
    p.add_argument("--devices", default="auto", help="'auto', a count, or a list such as 0,1")
    p.add_argument("--num-nodes", type=int, default=1, help="Trainer num_nodes (default 1)")
    p.add_argument("--strategy", default="auto", help="Trainer strategy (default auto)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str]) -> int:
    """``lightning-adaptiveload ingest INPUTS --out DIR --vae VAE_DIR [...]``: see ``docs/ingest.md``.

    Exits 0 when every input was written (or was already), 1 when some were skipped, 2 on bad arguments.
    """
    args = _parser().parse_args(list(argv))
    from lightning_adaptiveload.data.ingest import ingest

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
