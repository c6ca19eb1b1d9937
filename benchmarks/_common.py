"""Helpers shared by the benchmark scripts (run as scripts: ``python benchmarks/<name>.py``, so this
folder is on ``sys.path``)."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable


def cpu_name() -> str:
    """The CPU model as /proc/cpuinfo names it (for result files), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def results_dir() -> str:
    """Where result files go by default: ``$OUT`` (the GPU machine's output folder), else benchmarks/results."""
    return os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def add_out_arg(ap) -> None:
    """The ``--out`` option every benchmark takes (default :func:`results_dir`)."""
    ap.add_argument(
        "--out", default=results_dir(), help="folder for the results JSON (default: $OUT or results/)"
    )


def write_json(out_dir: str, filename: str, payload: dict) -> str:
    """Writes ``payload`` as indented JSON to ``out_dir/filename`` (the folder made if missing), prints and
    returns the path."""
    import json

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, filename)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
    print("wrote", path)
    return path


def device_tag(name: str) -> str:
    """A device name as it goes into result file names: lower case, runs of other characters as '-'
    ("NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3")."""
    return "".join(ch if ch.isalnum() else "-" for ch in name.lower()).strip("-")


def cuda_event_times(fn: Callable[[], object], iters: int, warmup: int = 0) -> list[float]:
    """Milliseconds of each of ``iters`` calls of ``fn`` on the current CUDA stream (CUDA events, each call
    synchronised), after ``warmup`` untimed calls."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def diffusers_wan(cfg, text_dim: int, num_layers: int | None = None):
    """Diffusers' ``WanTransformer3DModel`` with the sizes of our ``VideoDiTConfig`` ``cfg`` (Wan 2.1's
    patch, cross-attention norm and q/k RMSNorm), random weights, on the CPU in fp32. Needs diffusers."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=cfg.num_heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.in_channels,
        out_channels=cfg.out_channels,
        text_dim=text_dim,
        freq_dim=cfg.freq_dim,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.num_layers if num_layers is None else num_layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
    )
