"""A mixed pack's gradients on a GPU, route by route, against the same samples run one by one.

Written after run 37 (2 x H200, ``ddp_modes.py`` packed mode, eager): the loss turned NaN at the step after
the first mixed pack (a 20,280-token clip and four images, 26,481 tokens). This script rebuilds such a pack
at Wan 1.3B's width (2 blocks, bf16 autocast, activation checkpointing as the recipes) and runs its forward
and backward through each attention route of ``models/packing.py``:

- ``default``: what eager training runs (per-sample SDPA for self-attention, varlen for cross-attention);
- ``varlen``: the variable-length kernel for self-attention too (what ``torch.compile`` runs);
- ``no_varlen``: per-sample SDPA for both (no variable-length kernel at all);
- ``flash``, ``efficient``: ``default`` with that SDPA kernel first instead of the device's choice.

For each: whether the loss and every gradient are finite, and the relative L2 error of outputs and gradients
against the samples run one by one (the bucketed path). Writes a JSON result to --out. Never asserted in a
test (``tests/models/test_packing_model.py`` checks the routes on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os

import torch

from lightning_adaptiveload.models import packing as _packing
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

# The failing pack of run 37: one 13-frame 480p clip and four images (three 60 x 104, one 78 x 78 latent).
PACK_SHAPES = [(16, 13, 60, 104), (16, 1, 60, 104), (16, 1, 60, 104), (16, 1, 60, 104), (16, 1, 78, 78)]
TEXT_LENGTHS = [75, 361, 69, 284, 390]


@contextlib.contextmanager
def _route(name: str, model: VideoDiT):
    saved = (_packing._segment_attention_route, _packing.varlen_applies_to, model.attention_backend)
    try:
        if name == "varlen":
            _packing._segment_attention_route = lambda: "varlen"
        elif name == "no_varlen":
            _packing.varlen_applies_to = lambda device, dtype: False
        elif name in ("flash", "efficient", "cudnn"):
            model.set_attention_backend(name)
        yield
    finally:
        _packing._segment_attention_route, _packing.varlen_applies_to = saved[0], saved[1]
        model.set_attention_backend(saved[2])


def _inputs(device: str, order: list[int], text_dim: int, shapes):
    g = torch.Generator(device="cpu").manual_seed(0)
    lat = [torch.randn(shapes[i], generator=g).to(device) for i in order]
    t = (torch.rand(len(order), generator=g) * 1000).to(device)
    length = 512
    text = torch.randn(len(order), length, text_dim, generator=g).to(device)
    mask = torch.zeros(len(order), length, dtype=torch.bool)
    for row, i in enumerate(order):
        mask[row, : TEXT_LENGTHS[i]] = True
    targets = [torch.randn(x.shape, generator=g).to(device) for x in lat]
    return lat, t, text, mask.to(device), targets


def _loss(outs, targets) -> torch.Tensor:
    return sum(((o.float() - y) ** 2).mean() for o, y in zip(outs, targets))


def check(layers: int, order: list[int], routes: list[str], device: str, preset: str, shapes) -> dict:
    torch.manual_seed(0)
    cfg = VideoDiTConfig.preset(preset, num_layers=layers)
    model = VideoDiT(cfg).to(device)
    torch.nn.init.normal_(model.head.head.weight, std=0.02)  # zero at init: give the blocks a gradient
    model.set_activation_checkpointing(True)
    lat, t, text, mask, targets = _inputs(device, order, cfg.text_dim, shapes)

    def step(pack: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            if pack:
                outs = model.forward_packed(lat, t, text, mask)
            else:
                outs = [
                    model(x[None], t[i : i + 1], text[i : i + 1], mask[i : i + 1])[0]
                    for i, x in enumerate(lat)
                ]
        loss = _loss(outs, targets)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return [o.detach() for o in outs], float(loss), grads

    ref_out, ref_loss, ref_grads = step(pack=False)
    rows = [{"route": "one by one", "loss": ref_loss, "nonfinite_grads": _nonfinite(ref_grads)}]
    for name in routes:
        with _route(name, model):
            try:
                out, loss, grads = step(pack=True)
            except Exception as err:  # noqa: BLE001  (a route that cannot run here is a row, not a crash)
                rows.append({"route": name, "error": f"{type(err).__name__}: {err}"[:300]})
                continue
        rows.append(
            {
                "route": name,
                "loss": loss,
                "nonfinite_outputs": sum(int(not torch.isfinite(o).all()) for o in out),
                "nonfinite_grads": _nonfinite(grads),
                "output_rel_l2_max": max(_rel(a, b) for a, b in zip(out, ref_out)),
                "grad_rel_l2_max": max(
                    (_rel(grads[n], g) for n, g in ref_grads.items() if n in grads and g.float().norm() > 0),
                    default=float("nan"),
                ),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    lens = [shapes[i][1] * shapes[i][2] * shapes[i][3] // 4 for i in order]
    return {"layers": layers, "order": order, "seq_lens": lens, "rows": rows}


def _nonfinite(grads: dict) -> list[str]:
    return [n for n, g in grads.items() if not torch.isfinite(g).all()][:12]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--routes", default="default,varlen,no_varlen,flash,efficient")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tag", default="")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--smoke", action="store_true", help="the tiny preset and latents 1/4 the size (a CPU run)"
    )
    args = ap.parse_args()
    preset = "tiny" if args.smoke else "wan-1.3b"
    shapes = (
        [(c, f, h // 4 // 2 * 2, w // 4 // 2 * 2) for c, f, h, w in PACK_SHAPES]
        if args.smoke
        else PACK_SHAPES
    )
    routes = [r for r in args.routes.split(",") if r]
    result = {
        "benchmark": "packed_grad_check",
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "settings": {"preset": preset, "layers": args.layers, "autocast": "bf16", "checkpointing": True},
        "checks": [
            check(args.layers, order, routes, args.device, preset, shapes)
            for order in ([0, 1, 2, 3, 4], [1, 4, 0, 2, 3])
        ],
    }
    os.makedirs(args.out, exist_ok=True)
    name = result["device"].lower().replace(" ", "-")
    path = os.path.join(args.out, f"packed_grad_check_{name}_{result['date']}{args.tag}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
