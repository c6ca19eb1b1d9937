"""FSDP2 on GPUs: the fused op under ``fully_shard`` against the unfused model, and a few training steps of the
largest VideoDiT that fits, with tokens/s and peak memory. Run on one H200 on 2026-11-23 (docs/multi_node.md); not yet on several GPUs.

Run by ``benchmarks/fsdp/gpu_fsdp_h200.sh`` (one GPU) and ``benchmarks/fsdp/gpu_fsdp_multi.sh`` (torchrun, several)::

    torchrun --nproc_per_node=N benchmarks/fsdp/fsdp_gpu.py parity --out DIR
    torchrun --nproc_per_node=N benchmarks/fsdp/fsdp_gpu.py train --preset wan-14b --tokens 75600 --steps 4 --out DIR

``train --auto``: picks, with the memory planner (``models/memory.py``), wan-14b with CPU offload when the
host holds its sharded state, else the wan-14b-wide model with the most blocks that fits (``--layers``
overrides). Writes ``fsdp_<what>_<device>_<world>.json`` under ``--out``; asserts no time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lightning_adaptiveload.fusion import fuse_norm_modulate  # noqa: E402
from lightning_adaptiveload.models.memory import activation_bytes_per_token, estimate_memory  # noqa: E402
from lightning_adaptiveload.models.sharding import default_mp_policy, load_full_state_dict, shard_model  # noqa: E402
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig  # noqa: E402
from lightning_adaptiveload.monitor.report import jsonable  # noqa: E402
from lightning_adaptiveload.ops import fused_op_status  # noqa: E402


def _setup() -> tuple[int, int, torch.device]:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group("nccl")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return dist.get_rank(), dist.get_world_size(), torch.device("cuda", local)


def _mesh(world: int):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cuda", (world,))


def _batch(cfg: VideoDiTConfig, tokens: int, device: torch.device, seed: int):
    # 720p-like latent grid: (T, H/2, W/2) patches of 1x2x2; T*45*80 = tokens at 720p.
    g = torch.Generator(device=device).manual_seed(seed)
    t = max(1, tokens // (45 * 80))
    x = torch.randn(1, cfg.in_channels, t, 90, 160, generator=g, device=device)
    text = torch.randn(1, 64, cfg.text_dim, generator=g, device=device)
    timestep = torch.full((1,), 500.0, device=device)
    return x, timestep, text


def parity(args) -> dict:
    """Loss and gradients of fused vs unfused, both under fully_shard (bf16 policy), and unsharded fp32."""
    rank, world, device = _setup()
    cfg = VideoDiTConfig.preset("wan-1.3b", num_layers=args.layers)
    torch.manual_seed(0)
    reference = VideoDiT(cfg)
    # Wan-style init zeroes the output head (and the gates), so the output and most gradients would be zero
    # and any two models would "match": perturb every parameter so that every path carries signal.
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    state = {k: v.clone() for k, v in reference.state_dict().items()}
    x, t, text = _batch(cfg, args.tokens, device, seed=rank)
    target = torch.randn_like(x)  # a flow-matching-like regression target
    results = {}
    for fused in (False, True):
        with torch.device("meta"):
            model = VideoDiT(cfg)
        model.set_activation_checkpointing(True)
        report = fuse_norm_modulate(model, verify=False) if fused else None
        shard_model(model, _mesh(world), default_mp_policy("cuda"))
        load_full_state_dict(model, state if rank == 0 else None, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, t, text)
        loss = (out.float() - target).square().mean()
        loss.backward()
        grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters() if p.grad is not None}
        results[fused] = (float(loss), grads, str(report) if report else None)
        del model
        torch.cuda.empty_cache()
    (l0, g0, _), (l1, g1, report) = results[False], results[True]
    rel = {n: float((g1[n] - g0[n]).norm() / g0[n].norm().clamp_min(1e-12)) for n in g0}
    worst = max(rel, key=rel.get)
    return {
        "what": "parity",
        "config": {"preset": "wan-1.3b", "num_layers": args.layers, "tokens": args.tokens},
        "loss_unfused": l0,
        "loss_fused": l1,
        "loss_rel_diff": abs(l1 - l0) / max(abs(l0), 1e-12),
        "grad_rel_diff_max": rel[worst],
        "grad_rel_diff_worst_param": worst,
        "fusion_report": report,
        "fused_op_status": str(fused_op_status()),
        "grad_params_nonzero": sum(1 for g in g0.values() if float(g.abs().max()) > 0),
        "grad_params": len(g0),
        "match": abs(l1 - l0) / max(abs(l0), 1e-12) < 2e-2 and rel[worst] < 5e-2,
    }


def _host_memory_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / 1e9
    return 0.0


def _choose(args, world: int, gpu_gb: float) -> tuple[VideoDiTConfig, bool, dict]:
    base = VideoDiTConfig.preset(args.preset)
    with torch.device("meta"):
        one_block = sum(
            p.numel()
            for p in VideoDiT(VideoDiTConfig.preset(args.preset, num_layers=1)).blocks[0].parameters()
        )
        rest = (
            sum(p.numel() for p in VideoDiT(VideoDiTConfig.preset(args.preset, num_layers=1)).parameters())
            - one_block
        )
    host_gb = _host_memory_gb()

    def plan(layers: int, offload: bool):
        params = rest + layers * one_block
        bpt = activation_bytes_per_token(base.dim, base.ffn_dim, layers, checkpointing=True)
        return estimate_memory(params, gpu_gb, world, args.tokens, bpt, "fsdp2", one_block, offload), params

    if args.layers:
        est, params = plan(args.layers, args.offload)
        return (
            VideoDiTConfig.preset(args.preset, num_layers=args.layers),
            args.offload,
            {"estimate": vars(est), "params": params},
        )
    full = base.num_layers
    # The most blocks that fit; at equal depth, without offload first (the optimizer step stays on the GPU).
    # Offloaded state is pinned host memory: leave a quarter of the host for the rest.
    host_share = 0.75 * host_gb / max(1, torch.cuda.device_count())
    for layers in range(full, 0, -1):
        for offload in (False, True):
            est, params = plan(layers, offload)
            if est.fits and est.host_gb <= host_share:
                cfg = base if layers == full else VideoDiTConfig.preset(args.preset, num_layers=layers)
                return (
                    cfg,
                    offload,
                    {"estimate": vars(est), "params": params, "host_gb": host_gb, "full_layers": full},
                )
    raise SystemExit(f"no {args.preset}-wide model fits {gpu_gb:.0f} GB at {args.tokens} tokens")


def train(args) -> dict:
    """A few AdamW steps at ``--tokens`` per rank, FSDP2 + bf16 policy + activation checkpointing."""
    rank, world, device = _setup()
    gpu_gb = torch.cuda.get_device_properties(device).total_memory / 1e9
    cfg, offload, chosen = _choose(args, world, gpu_gb)
    with torch.device("meta"):
        model = VideoDiT(cfg)
    model.set_activation_checkpointing(True)
    if args.fused:
        fuse_norm_modulate(model, verify=False)
    shard_model(model, _mesh(world), default_mp_policy("cuda"), cpu_offload=offload)
    model.to_empty(device="cpu" if offload else device)
    with torch.no_grad():
        model.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=not offload)
    torch.cuda.reset_peak_memory_stats(device)
    times = []
    x, t, text = _batch(cfg, args.tokens, device, seed=rank)
    target = torch.randn_like(x)
    tokens = x.shape[2] * (x.shape[3] // 2) * (x.shape[4] // 2)
    for step in range(args.steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, t, text)
        loss = (out.float() - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"step {step}: {times[-1]:.2f} s, loss {float(loss):.4f}", flush=True)
    timed = times[1:] or times  # the first step includes lazy init and allocator warm-up
    stats = torch.cuda.memory_stats(device)
    return {
        "what": "train",
        "config": {k: v for k, v in vars(cfg).items()},
        "num_layers": cfg.num_layers,
        "cpu_offload": offload,
        "fused": args.fused,
        "chosen": chosen,
        "tokens_per_rank_step": tokens,
        "step_times_s": times,
        "tokens_per_s_per_gpu": tokens / (sum(timed) / len(timed)),
        "tokens_per_s_total": world * tokens / (sum(timed) / len(timed)),
        "peak_allocated_gb": stats.get("allocated_bytes.all.peak", 0) / 1e9,
        "peak_reserved_gb": stats.get("reserved_bytes.all.peak", 0) / 1e9,
        "alloc_retries": stats.get("num_alloc_retries", 0),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["parity", "train"])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--preset", default="wan-14b")
    p.add_argument("--tokens", type=int, default=75600)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--layers", type=int, default=0, help="blocks (0: the preset's, or --auto's choice)")
    p.add_argument("--offload", action="store_true", help="with --layers: FSDP2 CPU offload")
    p.add_argument("--fused", action="store_true", help="train with the fused norm + modulate op")
    args = p.parse_args()
    if args.what == "parity" and not args.layers:
        args.layers = 4
    result = parity(args) if args.what == "parity" else train(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        result.update(
            device=torch.cuda.get_device_name(),
            world_size=world,
            torch=torch.__version__,
            time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        )
        os.makedirs(args.out, exist_ok=True)
        name = torch.cuda.get_device_name().replace(" ", "_")
        path = os.path.join(args.out, f"fsdp_{args.what}_{name}_x{world}.json")
        with open(path, "w") as f:
            json.dump(jsonable(result), f, indent=1)
        print(json.dumps(jsonable({k: v for k, v in result.items() if k != "config"}), indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
