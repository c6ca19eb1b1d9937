"""Ingest throughput on CPU: decode + sizing, Wan 2.1 VAE encode, and the whole ``ingest`` job.

Measures, on this machine (clips written by the script with PyAV, 30 fps, smooth random colour fields):

1. **Decode + size** (``decode_input``): 480x832 clips of 3 s to 16 fps, up to 33 frames (-> 33), the
   ``wan480p`` buckets; samples/s and frames/s. No model.
2. **VAE encode** (``encode_video``) with the **full Wan 2.1 VAE architecture** (diffusers'
   ``AutoencoderKLWan`` default config, random weights: the same arithmetic as the released weights) on
   one clip per shape; seconds per sample. A 9-frame 240x416 clip takes minutes on 2 busy cores, so
   480p shapes (17 and 81 frames) run only with ``--full``.
3. **The whole job** (``ingest()``: Trainer.predict, one rank, a data-loader worker decoding, the writer)
   with the library's tiny random VAE (``data.demo.tiny_random_vae``, what ``ingest --vae tiny-random``
   uses) on small clips (128x224, 17 frames), so that the number is the pipeline's own overhead:
   samples/s.

The clips come from ``data.demo.write_demo_clips`` (the generator behind ``ingest --demo-clips``).

Writes ``benchmarks/results/ingest_<cpu>_<date>.json`` with the CPU name, thread count and the load
average before and after (the development box is shared; a load above the core count means the numbers
are lower bounds). Never asserts a time. Run::

    python benchmarks/data/bench_ingest.py            # ~5 min on 2 busy cores
    python benchmarks/data/bench_ingest.py --full     # adds 480x832 VAE encodes of 17 and 81 frames (very slow on CPU)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import cpu_name

from lightning_adaptiveload.ingest import job as ing
from lightning_adaptiveload.ingest.demo import (
    DEMO_ENCODER,
    TINY_VAE_CONFIG,
    tiny_random_vae,
    write_demo_clips,
)
from lightning_adaptiveload.ingest.settings import IngestSettings
from lightning_adaptiveload.monitor.report import jsonable


def save(result: dict, out_dir: str) -> str:
    """Write the result file (called after every stage, so that a stopped run keeps what it measured)."""
    os.makedirs(out_dir, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", result["device"].lower()).strip("-")[:40]
    path = os.path.join(out_dir, f"ingest_{slug}_{datetime.date.today().isoformat()}.json")
    with open(path, "w") as f:
        json.dump(jsonable(result), f, indent=1)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clips", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--full", action="store_true", help="also encode 480x832 x 17 and x 81 frames with the full VAE"
    )
    p.add_argument(
        "--out", default=os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from diffusers import AutoencoderKLWan

    result: dict = {
        "device": cpu_name(),
        "torch_threads": args.threads,
        "cpu_count": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "in")
        write_demo_clips(src, count=args.clips, fps=30, size=(480, 832), seconds=3.0, image=False)
        items = ing.find_inputs(src)

        # 1. Decode + size.
        buckets = ing.parse_buckets("wan480p")
        t0 = time.perf_counter()
        frames = 0
        for it in items:
            pixels, meta = ing.decode_input(it, 16.0, 33, buckets)
            frames += pixels.shape[1]
        dt = time.perf_counter() - t0
        result["decode_size"] = {
            "clip": "480x832, 3 s at 30 fps -> 16 fps, max 33 frames, wan480p buckets",
            "samples": len(items),
            "frames_out": frames,
            "seconds": dt,
            "samples_per_s": len(items) / dt,
            "frames_per_s": frames / dt,
            "output_shape": list(pixels.shape),
        }
        print("decode+size", result["decode_size"])
        save(result, args.out)

        # 2. The full Wan 2.1 VAE.
        vae = AutoencoderKLWan().eval()
        shapes = [(9, 240, 416)] + ([(17, 480, 832), (81, 480, 832)] if args.full else [])
        result["vae_encode"] = []
        for t, h, w in shapes:
            x = torch.rand(1, 3, t, h, w) * 2 - 1
            t0 = time.perf_counter()
            z = ing.encode_video(vae, x)
            dt = time.perf_counter() - t0
            row = {
                "frames": t,
                "height": h,
                "width": w,
                "latent": list(z.shape[1:]),
                "seconds_per_sample": dt,
            }
            result["vae_encode"].append(row)
            print("vae", row)
            save(result, args.out)
        del vae

        # 3. The whole job, tiny VAE (pipeline overhead), on small clips so that the tiny VAE stays cheap.
        small = os.path.join(tmp, "small")
        write_demo_clips(small, count=args.clips, fps=30, size=(128, 224), seconds=2.0, image=False)
        # The tiny VAE alone on one such clip: the job's time less this is the pipeline's overhead.
        tiny_vae = tiny_random_vae()
        x = torch.rand(1, 3, 17, 128, 224) * 2 - 1
        ing.encode_video(tiny_vae, x)  # first call: allocator and kernel warm-up
        t0 = time.perf_counter()
        for _ in range(3):
            ing.encode_video(tiny_vae, x)
        tiny_encode = (time.perf_counter() - t0) / 3
        del tiny_vae
        t0 = time.perf_counter()
        summary = ing.ingest(
            small,
            os.path.join(tmp, "out"),
            DEMO_ENCODER,
            settings=IngestSettings(fps=16.0, max_frames=17, buckets="128x224", num_workers=1),
            progress=False,
            trainer_kwargs={"accelerator": "cpu", "devices": 1},
        )
        dt = time.perf_counter() - t0
        result["ingest_job_tiny_vae"] = {
            "clip": "128x224, 2 s at 30 fps -> 16 fps, 17 frames; 1 rank, 1 worker",
            "vae": f"data.demo.tiny_random_vae: AutoencoderKLWan({TINY_VAE_CONFIG}), random weights",
            "samples": summary["written"],
            "seconds_total": dt,
            "samples_per_s_total": summary["written"] / dt,
            "seconds_predict": summary["seconds"],
            "samples_per_s_predict": summary["samples_per_s"],
            "video_hours": summary["video_hours"],
            "tiny_vae_encode_seconds_per_sample": tiny_encode,
            "pipeline_overhead_seconds_per_sample": dt / max(summary["written"], 1) - tiny_encode,
        }
        print("ingest job", result["ingest_job_tiny_vae"])
    result["loadavg_after"] = os.getloadavg()
    path = save(result, args.out)
    print("wrote", path, file=sys.stderr)


if __name__ == "__main__":
    main()
