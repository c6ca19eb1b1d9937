"""Side-by-side training-step speed of wan-1.3b (ours and diffusers'), one variant per lever.

For each variant (attention kernel, weight dtype, regional compile, checkpoint policy; diffusers' Wan 1.3B
with and without our fused op) and each shape (one 81-frame 480p clip, 21 images, one image, batches of
65,520 and 131,040 tokens), times forward + backward with CUDA events (warm-up, then the median of
``--reps``), the optimizer step apart, the host time to issue the step, the GPU-busy share (kernel time
from ``torch.profiler`` over the step time, on the small shapes where the host can be the limit), peak
memory, and MFU = 3 x forward FLOPs (recompute not counted) / step time / dense bf16 peak. Compile time
and the number of compiled graphs are recorded per variant. A micro-benchmark of the attention kernels
alone (one clip's self-attention, forward + backward) comes first.

Writes ``bench_step_<device>_<date>.json`` into ``--out`` after every measurement (a run cut short keeps
what it measured) and prints a table last.

    python benchmarks/model/bench_step.py                                   # one H100, about 8 minutes
    python benchmarks/model/bench_step.py --device cpu --preset tiny --variants eager,compiled  # smoke test
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch._dynamo
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import add_out_arg, device_tag, diffusers_wan  # noqa: E402

from lightning_adaptiveload.monitor.report import jsonable  # noqa: E402


def _compiled(ckpt, **extra):
    """A variant of ours with fp32 weights, per-block compile and the default attention (unless ``extra``
    names one)."""
    return dict(dict(model="ours", weights="fp32", attention="default", compile=True, ckpt=ckpt), **extra)


# name -> settings. "ours": VideoDiT; weights fp32 (autocast casts them) or bf16 (+ fp32 master in AdamW);
# attention: our backend names; compile: regional per block; ckpt: (policy, num_blocks or None) or None.
VARIANTS = {
    # The step as the issue found it: eager, fp32 weights under autocast, full checkpointing, PyTorch's
    # attention choice, no cross-attention query split (xsplit=1; the model's default is "auto" since run 28).
    "baseline": dict(
        model="ours", weights="fp32", attention="default", compile=False, ckpt=("full", None), xsplit=1
    ),
    "flash": dict(model="ours", weights="fp32", attention="flash", compile=False, ckpt=("full", None)),
    # Isolate the two changes the "bf16w" variant bundles (its eager host time rose on the image step).
    "auto": dict(model="ours", weights="fp32", attention="auto", compile=False, ckpt=("full", None)),
    "bf16w-default-attn": dict(
        model="ours", weights="bf16", attention="default", compile=False, ckpt=("full", None)
    ),
    "compile+sac": dict(
        model="ours", weights="fp32", attention="default", compile=True, ckpt=("save_attention", None)
    ),
    # Checkpoint only some blocks (spread over the depth); the others keep every activation (issue 17).
    "compile+sac20": dict(
        model="ours", weights="fp32", attention="default", compile=True, ckpt=("save_attention", 20)
    ),
    "compile+sac15": dict(
        model="ours", weights="fp32", attention="default", compile=True, ckpt=("save_attention", 15)
    ),
    "compile+sac10": dict(
        model="ours", weights="fp32", attention="default", compile=True, ckpt=("save_attention", 10)
    ),
    # Per batch, the fewest checkpointed blocks that fit a memory budget (a fitted ActivationMemory; the
    # caller probes it: bench_step_mix.py).
    "compile+sac_auto": dict(
        model="ours", weights="fp32", attention="default", compile=True, ckpt=("save_attention", "auto")
    ),
    # The clip's choice under compile+smm_auto (26 of 30), fixed; and with inductor's matmul autotuning.
    "compile+smm26": dict(
        model="ours", weights="fp32", attention="default", compile=True, ckpt=("save_matmuls", 26)
    ),
    "compile+smm26+autotune": dict(
        model="ours",
        weights="fp32",
        attention="default",
        compile=True,
        ckpt=("save_matmuls", 26),
        mode="max-autotune-no-cudagraphs",
    ),
    # The same without our fused op inside the compiled blocks (inductor's own LayerNorm + modulate, which it
    # can fuse with the gated residual before it), and with inductor's coordinate-descent tuning of its
    # generated kernels (issue 17: the elementwise part of the clip step).
    "compile+smm26+nofuse": _compiled(("save_matmuls", 26), fused=False),
    "compile+smm26+cdt": _compiled(("save_matmuls", 26), coordinate_descent_tuning=True),
    # The same with "save_matmuls" blocks: recompute only the elementwise work, at more memory per block.
    "compile+smm_auto": dict(
        model="ours", weights="fp32", attention="default", compile=True, ckpt=("save_matmuls", "auto")
    ),
    # ... and without our fused op in the compiled blocks (inductor fuses LayerNorm + modulate with the gated
    # residual; run 8: 22 ms faster on the clip).
    "compile+smm_auto+nofuse": _compiled(("save_matmuls", "auto"), fused=False),
    # The same two with FlashAttention-4 under PyTorch's FlashAttention backend (attention_backend="fa4":
    # process-wide once active, so these run after the cuDNN variants they are compared with).
    "compile+smm26+nofuse+fa4": _compiled(("save_matmuls", 26), fused=False, attention="fa4"),
    "compile+smm_auto+nofuse+fa4": _compiled(("save_matmuls", "auto"), fused=False, attention="fa4"),
    "compile+smm26+nofuse+auto": _compiled(("save_matmuls", 26), fused=False, attention="auto"),
    # Issue 17, run 16: inductor's 2D-tiled reductions (the GELU backward with its bias gradient ran at ~1.4 TB/s).
    "compile+smm26+nofuse+fa4+tiled": _compiled(
        ("save_matmuls", 26),
        fused=False,
        attention="fa4",
        options={"triton.tile_reductions": True, "triton.prefer_nd_tiling": True},
    ),
    # Where inductor's elementwise kernels lose time (run 16): static shapes instead of symbolic ones, RoPE as a
    # pair swap with full-width tables instead of a stack of the two halves, RMSNorm through F.rms_norm.
    "compile+smm26+nofuse+static": _compiled(("save_matmuls", 26), fused=False, dynamic=False),
    "compile+smm26+nofuse+ropeswap": _compiled(("save_matmuls", 26), fused=False, rope="swap"),
    "compile+smm26+nofuse+rmsnative": _compiled(("save_matmuls", 26), fused=False, rms="native"),
    # ... and inductor's reduction settings: mixed-order reductions (a row and a column reduction of the same
    # tensor in one kernel: LayerNorm backward with the modulation gradients), looped instead of persistent
    # reductions, and multi-kernel (both generated, the faster picked at run time).
    "compile+smm26+nofuse+mor": _compiled(
        ("save_matmuls", 26), fused=False, options={"triton.mix_order_reduction": True}
    ),
    "compile+smm26+nofuse+nopersist": _compiled(
        ("save_matmuls", 26), fused=False, options={"triton.persistent_reductions": False}
    ),
    "compile+smm26+nofuse+multikernel": _compiled(
        ("save_matmuls", 26), fused=False, options={"triton.multi_kernel": 1}
    ),
    # The FFN's first Linear as before run 17 (its bias gradient a column sum that inductor fuses into the GELU
    # backward; layers.MatmulBiasLinear makes it a matmul under compile), and every Linear of the blocks made
    # so (run 18: slower on the clip).
    "compile+smm26+nofuse+fa4+oldffn": _compiled(
        ("save_matmuls", 26), fused=False, attention="fa4", bias_mm="none"
    ),
    "compile+smm_auto+nofuse+fa4+oldffn": _compiled(
        ("save_matmuls", "auto"), fused=False, attention="fa4", bias_mm="none"
    ),
    "compile+smm_auto+nofuse+fa4+alllinears": _compiled(
        ("save_matmuls", "auto"), fused=False, attention="fa4", bias_mm="all"
    ),
    # The Triton norm kernels (ops.norm_kernels): none (inductor's own kernels for every norm, as up to run 18),
    # all (the library's default since run 21, which the variants above use where Triton and CUDA are there),
    # and RMSNorm + RoPE of the self-attention's q and k only (run 21's default: faster, but inductor's
    # LayerNorm backward then gives wrong modulation gradients at batch 1, see ops/norm_kernels.py).
    "compile+smm26+nofuse+nonormk": _compiled(("save_matmuls", 26), fused=False, norm_kernels="none"),
    "compile+smm26+nofuse+allnormk": _compiled(("save_matmuls", 26), fused=False, norm_kernels="all"),
    "compile+smm26+nofuse+ropenormk": _compiled(("save_matmuls", 26), fused=False, norm_kernels="rope"),
    "compile+smm26+nofuse+fa4+nonormk": _compiled(
        ("save_matmuls", 26), fused=False, attention="fa4", norm_kernels="none"
    ),
    "compile+smm_auto+nofuse+fa4+nonormk": _compiled(
        ("save_matmuls", "auto"), fused=False, attention="fa4", norm_kernels="none"
    ),
    "compile+smm_auto+nofuse+fa4+ropenormk": _compiled(
        ("save_matmuls", "auto"), fused=False, attention="fa4", norm_kernels="rope"
    ),
    # bf16 weights with fp32 masters in the optimizer (MasterWeightAdamW, its one-kernel Triton step on CUDA):
    # no weight casts in the forward, the recompute or the weight gradients (run 27).
    "compile+smm26+nofuse+bf16w": _compiled(("save_matmuls", 26), fused=False, weights="bf16"),
    "compile+smm26+nofuse+fa4+bf16w": _compiled(
        ("save_matmuls", 26), fused=False, attention="fa4", weights="bf16"
    ),
    # The same without FlashAttention-4 (cuDNN where PyTorch picks it): the fast settings on a stock image.
    "compile+smm_auto+nofuse+bf16w": _compiled(("save_matmuls", "auto"), fused=False, weights="bf16"),
    "compile+smm_auto+nofuse+fa4+bf16w": _compiled(
        ("save_matmuls", "auto"), fused=False, attention="fa4", weights="bf16"
    ),
    # The cross-attention without its query split (attention.sdpa_split_queries, the model's default since
    # run 28 for one long sample): the variants above before that run.
    "compile+smm26+nofuse+fa4+nosplit": _compiled(
        ("save_matmuls", 26), fused=False, attention="fa4", xsplit=1
    ),
    "compile+smm_auto+nofuse+fa4+nosplit": _compiled(
        ("save_matmuls", "auto"), fused=False, attention="fa4", xsplit=1
    ),
    # CUDA graphs per block (torch.compile mode="reduce-overhead"): the host-bound single image (issue 17).
    "compile+noac+cg": dict(
        model="ours", weights="fp32", attention="default", compile=True, ckpt=None, mode="reduce-overhead"
    ),
    # The whole forward as one compiled graph with CUDA graphs (fixed shape): one replay per forward and one
    # per backward instead of a launch per kernel or per block.
    "whole+cg": dict(
        model="ours", weights="fp32", attention="default", compile="model", ckpt=None, mode="reduce-overhead"
    ),
    "whole": dict(model="ours", weights="fp32", attention="default", compile="model", ckpt=None),
    # The same with each block a nested compile region (acceleration.compile_whole): traced once, not 30 times.
    "whole+nested+cg": dict(
        model="ours", weights="fp32", attention="default", compile="nested", ckpt=None, mode="reduce-overhead"
    ),
    "bf16w": dict(model="ours", weights="bf16", attention="auto", compile=False, ckpt=("full", None)),
    "bf16w+compile": dict(model="ours", weights="bf16", attention="auto", compile=True, ckpt=("full", None)),
    "bf16w+compile+sac": dict(
        model="ours", weights="bf16", attention="auto", compile=True, ckpt=("save_attention", None)
    ),
    "bf16w+compile+noac": dict(model="ours", weights="bf16", attention="auto", compile=True, ckpt=None),
    # The same without our fused op: inductor fuses the eager LayerNorm + modulate itself.
    "bf16w+compile+sac+nofuse": dict(
        model="ours",
        weights="bf16",
        attention="auto",
        compile=True,
        ckpt=("save_attention", None),
        fused=False,
    ),
    "diffusers": dict(model="diffusers", fused=False, compile=False, attention="default"),
    "diffusers+fused": dict(model="diffusers", fused=True, compile=False, attention="default"),
    "diffusers+fused+compile": dict(model="diffusers", fused=True, compile=True, attention="auto"),
    # ... with FlashAttention-4 through diffusers' "_native_flash" (set_attention_backend(model, "fa4")).
    "diffusers+fused+compile+fa4": dict(model="diffusers", fused=True, compile=True, attention="fa4"),
    "diffusers+compile+fa4": dict(model="diffusers", fused=False, compile=True, attention="fa4"),
    # CPU smoke test
    "eager": dict(model="ours", weights="fp32", attention="auto", compile=False, ckpt=("full", None)),
    "compiled": dict(
        model="ours", weights="fp32", attention="auto", compile=True, ckpt=("save_attention", None)
    ),
}
# name -> (B, T, H, W) latent batch.
SHAPES = {
    "clip": (1, 21, 60, 104),
    "images": (21, 1, 60, 104),
    "image": (1, 1, 60, 104),
    "tok65k": (2, 21, 60, 104),
    "tok131k": (4, 21, 60, 104),
    # tiny preset (CPU)
    "tiny_clip": (1, 5, 8, 8),
    "tiny_images": (3, 1, 8, 8),
}
PROFILED = {"image", "images", "tiny_images"}


def _rope_swap(x, cos, sin):
    """RoPE as ``x * cos2 + swap(x) * sin2`` with (S, d) tables (each angle twice; sin signed -, +) and the
    channel pairs swapped: the same rotation as ``layers.apply_rope``, written without ``stack``."""
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    cos2 = cos.repeat_interleave(2, dim=-1)[:, None, :]
    sin2 = torch.stack([-sin, sin], dim=-1).flatten(-2)[:, None, :]
    return (xf * cos2 + swapped * sin2).to(x.dtype)


def _rms_native(self, x):
    return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


_ORIGINAL_LAYERS = {}
# Sites of ops.norm_kernels per variant setting: the library's default (all), none, all, and RMSNorm + RoPE of
# the self-attention's q and k only (run 21's "compile+smm26+nofuse", the default of that run).
_NORM_KERNEL_SITES = {}


def _norm_kernel_sites():
    from lightning_adaptiveload.ops import norm_kernels

    if not _NORM_KERNEL_SITES:
        default = dict(norm_kernels.ENABLED)
        _NORM_KERNEL_SITES.update(
            default=default,
            none=dict.fromkeys(default, False),
            all=dict.fromkeys(default, True),
            rope=dict(dict.fromkeys(default, False), rms_norm_rope=True),
        )
    return _NORM_KERNEL_SITES


def _set_experimental_layers(spec) -> None:
    """The rope/rms variants replace the model's functions for this variant only (restored for the others);
    they are about inductor's own kernels, so they run without the Triton norm kernels, as does a variant
    with ``norm_kernels="none"``."""
    from lightning_adaptiveload.models import layers
    from lightning_adaptiveload.ops import norm_kernels

    if not _ORIGINAL_LAYERS:
        _ORIGINAL_LAYERS.update(rope=layers.apply_rope, rms=layers.RMSNorm.forward)
    layers.apply_rope = _rope_swap if spec.get("rope") == "swap" else _ORIGINAL_LAYERS["rope"]
    layers.RMSNorm.forward = _rms_native if spec.get("rms") == "native" else _ORIGINAL_LAYERS["rms"]
    which = spec.get("norm_kernels", "default" if "rope" not in spec and "rms" not in spec else "none")
    norm_kernels.ENABLED = dict(_norm_kernel_sites()[which])


def _set_bias_matmul(model, which) -> None:
    """ "none": no Linear of the blocks takes its bias gradient as a matmul; "all": every one does."""
    from lightning_adaptiveload.models.layers import Linear, MatmulBiasLinear

    for block in model.blocks:
        for m in block.modules():
            if which == "all" and type(m) is Linear:
                m.__class__ = MatmulBiasLinear
            if isinstance(m, MatmulBiasLinear):
                m.bias_grad_by_matmul = which == "all"


def _sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _init_optimizer_state(model, opt):
    """One optimizer step on zero gradients, so that AdamW's state (8 bytes per parameter) exists before any
    measured peak: otherwise the first shape of a variant is measured without it (runs 1-5 did so)."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _build(spec, cfg, dev, text_dim):
    """(model, optimizer, forward(x, t, ctx) -> out, info)."""
    info = {}
    if spec["model"] == "ours":
        from lightning_adaptiveload.fusion import fuse_norm_modulate
        from lightning_adaptiveload.models import VideoDiT
        from lightning_adaptiveload.models.master_weights import MasterWeightAdamW

        _set_experimental_layers(spec)
        torch.manual_seed(0)
        model = VideoDiT(cfg).to(dev).train()
        torch.nn.init.normal_(model.head.head.weight, std=0.02)
        if spec["ckpt"] is None:
            model.set_activation_checkpointing(False)
        elif spec["ckpt"][1] == "auto":  # every block until the caller has probed the memory model
            model.set_activation_checkpointing(True, spec["ckpt"][0])
        else:
            # (At most the model's block count: the tiny preset of a CPU smoke run has 2.)
            n = spec["ckpt"][1]  # None: every block
            model.set_activation_checkpointing(
                True, spec["ckpt"][0], None if n is None else min(n, len(model.blocks))
            )
        if "bias_mm" in spec:
            _set_bias_matmul(model, spec["bias_mm"])
        model.set_attention_backend(spec["attention"])
        model.set_cross_attention_splits(spec.get("xsplit", "auto"))
        fuse = dev.type == "cuda" and spec.get("fused", True)
        info["fused_sites"] = fuse_norm_modulate(model, verify=False).num_sites if fuse else 0
        if spec["weights"] == "bf16":
            model = model.to(torch.bfloat16)
            opt = MasterWeightAdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
        if spec["compile"] == "nested":
            from lightning_adaptiveload.models.acceleration import compile_whole

            _init_optimizer_state(model, opt)
            compiled = compile_whole(model, mode=spec.get("mode"))
            info["compiled"] = f"whole model, blocks as nested regions, mode={spec.get('mode')}"
            return model, opt, lambda x, t, ctx: compiled(x, t, ctx, None), info
        if spec["compile"] == "model":

            def whole(x, t, ctx):
                return model(x, t, ctx, None)

            _init_optimizer_state(model, opt)
            info["compiled"] = f"whole model, mode={spec.get('mode')}"
            return model, opt, torch.compile(whole, mode=spec.get("mode"), dynamic=False), info
        if spec["compile"]:
            import torch._inductor.config as inductor_config

            from lightning_adaptiveload.models.acceleration import compile_blocks

            # Set per variant (compilation happens at the first call, after this).
            inductor_config.coordinate_descent_tuning = bool(spec.get("coordinate_descent_tuning", False))

            # Symbolic sizes from the first call: one graph for B = 1 and one for B > 1 (see acceleration.py).
            info["compiled_blocks"] = compile_blocks(
                model, dynamic=spec.get("dynamic", True), mode=spec.get("mode"), options=spec.get("options")
            )

        def fwd(x, t, ctx):
            return model(x, t, ctx, None)

        _init_optimizer_state(model, opt)
        return model, opt, fwd, info
    from lightning_adaptiveload.fusion import fuse_norm_modulate
    from lightning_adaptiveload.models.acceleration import set_attention_backend

    torch.manual_seed(0)
    model = diffusers_wan(cfg, text_dim).to(dev, torch.bfloat16).train()
    model.enable_gradient_checkpointing()
    info["attention"] = set_attention_backend(model, spec["attention"], dev)
    if spec["fused"]:
        info["fused_sites"] = fuse_norm_modulate(model, verify=False).num_sites
    if spec["compile"]:
        # Runs 1 to 13 used diffusers' compile_repeated_blocks(fullgraph=True, dynamic=True); compile_blocks
        # compiles the same blocks the same way, with inductor's mix-order reductions off (run 22).
        from lightning_adaptiveload.models.acceleration import compile_blocks

        info["compile"] = f"compile_blocks: {compile_blocks(model)}"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=dev.type == "cuda")
    _init_optimizer_state(model, opt)

    def fwd(x, t, ctx):
        return model(hidden_states=x, timestep=t, encoder_hidden_states=ctx, return_dict=False)[0]

    return model, opt, fwd, info


def _fwd_bwd(fwd, x, t, ctx, dev):
    if dev.type == "cuda":  # a new step for CUDA-graph trees (reduce-overhead); a no-op otherwise
        torch.compiler.cudagraph_mark_step_begin()
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        out = fwd(x, t, ctx)
    F.mse_loss(out.float(), x.float()).backward()


def step_inputs(shape, cfg, text_len, text_dim, dev, bf16_inputs=False):
    """Random (latents, timesteps, text) for a (B, T, H, W) latent batch."""
    b, t_, h, w = shape
    dtype = torch.bfloat16 if dev.type == "cuda" or bf16_inputs else torch.float32
    x = torch.randn(b, cfg.in_channels, t_, h, w, device=dev, dtype=dtype)
    ts = torch.rand(b, device=dev) * 1000
    ctx = torch.randn(b, text_len, text_dim, device=dev, dtype=dtype)
    return x, ts, ctx


def _measure(fwd, model, opt, shape, cfg, text_len, text_dim, dev, reps, profile, bf16_inputs):
    b, t_, h, w = shape
    x, ts, ctx = step_inputs(shape, cfg, text_len, text_dim, dev, bf16_inputs)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    walls = []
    for _ in range(2):  # warm-up; includes compilation (and CUDA-graph recording, which needs two)
        t0 = time.perf_counter()
        _fwd_bwd(fwd, x, ts, ctx, dev)
        _sync(dev)
        walls.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    ms, host = [], []
    reps = reps if b * t_ * h * w <= 32760 * 4 else max(2, reps - 1)
    for _ in range(reps):
        if dev.type == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        _fwd_bwd(fwd, x, ts, ctx, dev)
        host.append(1e3 * (time.perf_counter() - t0))
        if dev.type == "cuda":
            e.record()
            e.synchronize()
            ms.append(s.elapsed_time(e))
        else:
            ms.append(host[-1])
        if len(ms) < reps:
            opt.zero_grad(set_to_none=True)
    # Optimizer step on the last step's gradients, timed apart.
    opt_ms = []
    for _ in range(2):
        _sync(dev)
        t0 = time.perf_counter()
        opt.step()
        _sync(dev)
        opt_ms.append(1e3 * (time.perf_counter() - t0))
    opt.zero_grad(set_to_none=True)
    row = {
        "fwd_bwd_ms": statistics.median(ms),
        "fwd_bwd_ms_all": ms,
        "host_ms": statistics.median(host),
        "opt_ms": min(opt_ms),
        "first_step_s": walls[0],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None,
    }
    if profile:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as _profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with _profile(activities=acts) as prof:
            _fwd_bwd(fwd, x, ts, ctx, dev)
            _sync(dev)
        opt.zero_grad(set_to_none=True)
        kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        row["kernel_ms"] = sum(e.self_device_time_total for e in kernels) / 1e3
        row["kernel_launches"] = sum(e.count for e in kernels)
        row["gpu_busy"] = row["kernel_ms"] / row["fwd_bwd_ms"] if kernels else None
        row["top_kernels"] = [
            {"kernel": e.key[:90], "ms": e.self_device_time_total / 1e3, "count": e.count}
            for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:60]
        ]
        cats: dict[str, list[float]] = {}
        for e in kernels:
            ms_count = cats.setdefault(kernel_category(e.key), [0.0, 0])
            ms_count[0] += e.self_device_time_total / 1e3
            ms_count[1] += e.count
        row["kernel_categories"] = {k: {"ms": v[0], "count": v[1]} for k, v in sorted(cats.items())}
    del x, ctx
    return row


# Kernel-name fragments per category, first match wins (cuDNN/flash attention, cuBLAS/CUTLASS matmuls,
# inductor's generated kernels, eager ATen elementwise and reductions, copies and casts).
_KERNEL_CATEGORIES = (
    ("attention", ("fmha", "flash", "attn", "cudnn", "sdpa")),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "sm90_", "sm80_")),
    ("inductor", ("triton",)),
    ("copy/cast", ("copy", "cast", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "norm", "multi_tensor")),
)


def kernel_category(name: str) -> str:
    """The category of a CUDA kernel by its name (``"other"`` when no fragment matches)."""
    low = name.lower()
    for cat, frags in _KERNEL_CATEGORIES:
        if any(f in low for f in frags):
            return cat
    return "other"


def _attention_micro(dev, reps=10):
    """One clip's self-attention (1 x 12 heads x 32760 x 128, bf16), forward + backward, per SDPA kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lightning_adaptiveload.models.attention import activate_flash_impl

    rows = {}
    q, k, v = (
        torch.randn(1, 12, 32760, 128, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    )
    flops = 4 * 32760 * 32760 * 128 * 12 * 3.5  # fwd 4*S^2*d*H, bwd 2.5x
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        try:
            with sdpa_kernel([backend]):
                for _ in range(2):
                    F.scaled_dot_product_attention(q, k, v).sum().backward()
                times = []
                for _ in range(reps):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    F.scaled_dot_product_attention(q, k, v).sum().backward()
                    e.record()
                    e.synchronize()
                    times.append(s.elapsed_time(e))
            m = statistics.median(times)
            rows[name] = {"fwd_bwd_ms": m, "tflops": flops / m / 1e9}
        except Exception as err:
            rows[name] = {"error": f"{type(err).__name__}: {str(err)[:200]}"}
    for impl in ("FA3", "FA4"):
        ok, why = activate_flash_impl(impl)
        rows[impl] = {"available": ok, "detail": why}
        if ok:
            torch.nn.attention.restore_flash_attention_impl()
    return rows


def add_common_args(ap: argparse.ArgumentParser, reps: int) -> None:
    """The options this script and ``bench_step_mix.py`` share."""
    ap.add_argument("--preset", default="wan-1.3b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--text-len", type=int, default=512)
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--time-budget-s", type=float, default=480.0)
    add_out_arg(ap)


def device_setup(args: argparse.Namespace):
    """(device, model config, device name, dense bf16 peak FLOP/s or None, file-name tag); makes ``--out``."""
    from lightning_adaptiveload.models.video_dit import VideoDiTConfig
    from lightning_adaptiveload.stats import PEAK_FLOPS

    logging_setup()
    dev = torch.device(args.device)
    cfg = VideoDiTConfig.preset(args.preset)
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu"
    peak = PEAK_FLOPS["h100-sxm"]["bf16"] if "H100" in name or "H200" in name else None
    tag = device_tag(name)
    os.makedirs(args.out, exist_ok=True)
    return dev, cfg, name, peak, tag


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(ap, reps=3)
    ap.add_argument(
        "--variants",
        default="baseline,bf16w,bf16w+compile,bf16w+compile+sac,bf16w+compile+noac,"
        "flash,diffusers,diffusers+fused,diffusers+fused+compile",
    )
    ap.add_argument("--shapes", default="clip,images,image,tok65k,tok131k")
    ap.add_argument("--skip", default="", help="variant:shape,... pairs not to run (e.g. known OOM)")
    ap.add_argument("--no-micro", action="store_true")
    ap.add_argument(
        "--profile",
        default=",".join(sorted(PROFILED)),
        help="shapes whose step is also profiled (kernel time by category, top kernels)",
    )
    args = ap.parse_args(argv)
    started = time.perf_counter()
    from lightning_adaptiveload.models.video_dit import forward_flops

    dev, cfg, name, peak, tag = device_setup(args)
    text_dim = cfg.text_dim
    path = os.path.join(args.out, f"bench_step_{tag}_{_dt.date.today().isoformat()}.json")
    result = {
        "benchmark": "benchmarks/model/bench_step.py",
        "device": name,
        "torch": torch.__version__,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "preset": args.preset,
        "text_len": args.text_len,
        "peak_flops": peak,
        "mfu_convention": "3 x forward FLOPs (matmuls, forward_flops), recompute not counted; step = fwd+bwd+opt",
        "shapes": {s: SHAPES[s] for s in args.shapes.split(",")},
        "variants": {},
        "attention_micro": None,
    }

    def save():
        with open(path, "w") as f:
            json.dump(jsonable(result), f, indent=1)

    if dev.type == "cuda" and not args.no_micro:
        result["attention_micro"] = _attention_micro(dev)
        print("attention micro:", json.dumps(result["attention_micro"]), flush=True)
        save()
    skip = set(filter(None, args.skip.split(",")))
    for vname in args.variants.split(","):
        if time.perf_counter() - started > args.time_budget_s:
            print(f"time budget reached, skipping {vname}", flush=True)
            continue
        spec = VARIANTS[vname]
        entry = {"spec": {k: v for k, v in spec.items()}, "rows": {}}
        result["variants"][vname] = entry
        try:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            model, opt, fwd, info = _build(spec, cfg, dev, text_dim)
            entry["info"] = info
        except Exception as err:
            entry["error"] = f"{type(err).__name__}: {err}"
            print(f"{vname}: build failed: {entry['error']}", flush=True)
            traceback.print_exc()
            continue
        for sname in args.shapes.split(","):
            if f"{vname}:{sname}" in skip or time.perf_counter() - started > args.time_budget_s:
                continue
            shape = SHAPES[sname]
            b, t_, h, w = shape
            s_tok = t_ * (h // cfg.patch_size[1]) * (w // cfg.patch_size[2])
            try:
                row = _measure(
                    fwd,
                    model,
                    opt,
                    shape,
                    cfg,
                    args.text_len,
                    text_dim,
                    dev,
                    args.reps,
                    sname in args.profile.split(","),
                    spec["model"] == "diffusers",
                )
            except torch.OutOfMemoryError:
                row = {"error": "OOM"}
            except Exception as err:
                row = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                traceback.print_exc()
            opt.zero_grad(set_to_none=True)
            gc.collect()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
            if "fwd_bwd_ms" in row:
                flops = 3 * b * forward_flops(cfg, s_tok, args.text_len)
                step_ms = row["fwd_bwd_ms"] + row["opt_ms"]
                row.update(
                    tokens=b * s_tok,
                    step_ms=step_ms,
                    tflops=flops / step_ms / 1e9,
                    tokens_per_s=b * s_tok / step_ms * 1e3,
                )
                row["mfu"] = flops / (step_ms / 1e3) / peak if peak else None
            entry["rows"][sname] = row
            graphs = int(torch._dynamo.utils.counters["stats"].get("unique_graphs", 0))
            entry["graphs_compiled"] = graphs
            print(f"{vname:26s} {sname:8s} " + _fmt(row), flush=True)
            if "kernel_categories" in row:
                print("    by category (ms, kernels):", json.dumps(row["kernel_categories"]), flush=True)
                for k in row["top_kernels"][:15]:
                    print(f"    {k['ms']:8.1f} ms {k['count']:5d}x {k['kernel']}", flush=True)
            save()
        del model, opt, fwd
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    save()
    _table(result)
    print(f"wrote {path}")
    return 0


def logging_setup():
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("lightning_adaptiveload.models.attention").setLevel(logging.INFO)


def _fmt(row):
    if "error" in row:
        return row["error"]
    mfu = f"{100 * row['mfu']:5.1f}%" if row.get("mfu") else "  -  "
    busy = f"{100 * row['gpu_busy']:4.0f}%" if row.get("gpu_busy") else "  - "
    peak = f"{row['peak_gib']:5.1f}" if row.get("peak_gib") is not None else "  -  "
    return (
        f"{row['fwd_bwd_ms']:9.1f} +{row['opt_ms']:6.1f} ms  host {row['host_ms']:8.1f}  MFU {mfu}  busy {busy}"
        f"  peak {peak} GiB  tok/s {row['tokens_per_s']:8.0f}  first {row['first_step_s']:6.1f} s"
    )


def _table(result):
    print(
        "\n== step = fwd+bwd + optimizer; MFU at 3x forward FLOPs, dense bf16 peak; busy = kernel time / fwd+bwd"
    )
    for vname, entry in result["variants"].items():
        if "error" in entry:
            print(f"{vname:26s} build failed: {entry['error'][:100]}")
            continue
        print(f"{vname} (graphs compiled: {entry.get('graphs_compiled', 0)})")
        for sname, row in entry["rows"].items():
            print(f"  {sname:8s} {_fmt(row)}")


if __name__ == "__main__":
    sys.exit(main())
