"""``lightning-adaptiveload ingest``: videos and images to latent shards.

The command line of :func:`lightning_adaptiveload.ingest.job.ingest` (Wan's VAE through
``Trainer.predict``, resumable); prints a JSON summary. See ``docs/ingest.md``.

``--vae tiny-random`` (and ``--text-encoder tiny-random``) runs the pipeline with the random-weight stand-ins
of :mod:`lightning_adaptiveload.ingest.demo`, with small buckets and clips unless given, and ``--demo-clips N``
first writes N generated clips into INPUTS: the whole path on a CPU in a minute, without downloads. Its
shards are demo data, NOT for training.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from lightning_adaptiveload.ingest.demo import DEMO_BUCKETS, DEMO_ENCODER, DEMO_MAX_FRAMES, is_demo_encoder

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
        "--vae",
        required=True,
        help="folder of a diffusers AutoencoderKLWan (e.g. <Wan2.1-Diffusers>/vae), or 'tiny-random': a "
        "random-weight tiny VAE to try the pipeline on a CPU without downloads (DEMO shards, NOT for training)",
    )
    p.add_argument(
        "--text-encoder",
        default=None,
        help="folder of a transformers UMT5EncoderModel (e.g. <Wan2.1-Diffusers>/text_encoder), or "
        "'tiny-random' (demo, with its own tokenizer); omit for no text states (captions stay in the .json)",
    )
    p.add_argument("--tokenizer", default=None, help="folder of its tokenizer (default: --text-encoder)")
    p.add_argument("--fps", type=float, default=16.0, help="target frame rate; 0 = the source's (default 16)")
    p.add_argument(
        "--max-frames",
        type=int,
        default=None,
        help=f"at most this many frames, cut to 4k+1 (default 81; {DEMO_MAX_FRAMES} with --vae {DEMO_ENCODER})",
    )
    p.add_argument(
        "--buckets",
        default=None,
        help="'wan480p' (480x832, 832x480, 624x624; the default), 'HxW,HxW,...', or 'native' (own size "
        f"rounded down to 16); with --vae {DEMO_ENCODER} the default is {DEMO_BUCKETS}",
    )
    p.add_argument(
        "--demo-clips",
        type=int,
        default=0,
        metavar="N",
        help="first write N generated clips (moving colour fields, with captions) and one image into INPUTS, "
        "to try the pipeline without videos of your own (default 0: none)",
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
    demo = is_demo_encoder(args.vae) or is_demo_encoder(args.text_encoder)
    if args.buckets is None:
        args.buckets = DEMO_BUCKETS if is_demo_encoder(args.vae) else "wan480p"
    if args.max_frames is None:
        args.max_frames = DEMO_MAX_FRAMES if is_demo_encoder(args.vae) else 81
    if args.demo_clips:
        if os.path.isfile(args.inputs):
            print(
                f"ingest: --demo-clips writes clips into a folder; {args.inputs} is a file", file=sys.stderr
            )
            return 2
        from lightning_adaptiveload.ingest.demo import write_demo_clips

        written = write_demo_clips(args.inputs, count=args.demo_clips)
        print(
            f"ingest: wrote {len(written)} demo inputs (generated clips, one image) to {args.inputs}",
            file=sys.stderr,
        )
    elif not os.path.exists(args.inputs):
        print(
            f"ingest: {args.inputs} does not exist; pass a folder of videos/images or a CSV/JSONL manifest "
            "(or add --demo-clips 6 to generate a few clips there)",
            file=sys.stderr,
        )
        return 2
    from lightning_adaptiveload.ingest.job import IngestSettings, ingest

    devices: Any = args.devices
    if devices != "auto":
        devices = [int(d) for d in devices.split(",") if d] if "," in devices else int(devices)
    summary = ingest(
        args.inputs,
        args.out,
        args.vae,
        text_encoder=args.text_encoder,
        tokenizer=args.tokenizer,
        settings=IngestSettings(
            fps=args.fps or None,
            max_frames=args.max_frames,
            buckets=args.buckets,
            samples_per_shard=args.samples_per_shard,
            latent_dtype=args.latent_dtype,
            on_error=args.on_error,
            num_workers=args.num_workers,
            dtype=args.dtype,
        ),
        trainer_kwargs=dict(
            accelerator=args.accelerator, devices=devices, num_nodes=args.num_nodes, strategy=args.strategy
        ),
        progress=not args.no_progress,
    )
    print(json.dumps({"out": args.out, **summary}))
    if not os.path.exists(os.path.join(args.out, "index.json")):
        skipped = sum(summary["skipped"].values())
        print(
            f"ingest: no sample was written to {args.out}, so it has no index.json: {skipped} of "
            f"{summary['assigned']} inputs were skipped (reasons above; records in {args.out}/ingest-skipped-r*.jsonl)",
            file=sys.stderr,
        )
        return 1
    if args.text_encoder is None and summary["written"]:
        print(
            "ingest: no --text-encoder: no text states were written (captions are kept in each sample's .json); "
            "a model trains on these samples unconditionally. See docs/ingest.md for the umT5 download.",
            file=sys.stderr,
        )
    if demo:
        print(
            f"ingest: {args.out} holds DEMO shards (random-weight encoders), NOT for training. To see them go "
            "through training (the tiny model, a few steps on the CPU):\n"
            f"  lightning-adaptiveload fit --config quickstart --data.init_args.train_shards={args.out} "
            "--data.init_args.synthetic=null --data.init_args.val_shards=null --trainer.max_steps=20\n"
            "For real data pass Wan's VAE (and umT5): docs/ingest.md.",
            file=sys.stderr,
        )
    return 1 if summary["skipped"] else 0
