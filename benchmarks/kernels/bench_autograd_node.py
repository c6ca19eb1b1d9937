"""Host cost per call of torch::autograd::Function against a plain autograd Node (the norm-modulate fast path).

Builds ``autograd_node_overhead.cpp`` with ``torch.utils.cpp_extension.load`` and times, from Python, three
entries that do the same allocations as the norm-modulate forward (no kernel): through a C++
``torch::autograd::Function``, through a ``Node`` subclass with ``SavedVariable`` members, and the allocations
alone; beside them ``F.layer_norm`` (with grad) and ``torch.add`` on the same tensors. Rounds of ``--calls``
calls, interleaved (order reversed every other round), median round. Runs on the CPU by default
(``--device cuda`` on a GPU machine). Also checks that gradients flow through both entries.

    python benchmarks/kernels/bench_autograd_node.py [--device cpu] [--rounds 15] [--calls 2000]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _common
from _common import add_out_arg, cpu_name, device_tag, write_json  # noqa: E402

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "autograd_node_overhead.cpp")
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "csrc")


def _build():
    from torch.utils.cpp_extension import load

    build_dir = os.path.join(tempfile.gettempdir(), f"la_autograd_node_{torch.__version__}")
    os.makedirs(build_dir, exist_ok=True)
    return load(
        "la_autograd_node", [_SRC], extra_include_paths=[_CSRC], build_directory=build_dir, verbose=False
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    add_out_arg(ap)
    args = ap.parse_args(argv)
    ext = _build()
    dev = torch.device(args.device)
    D = 1536
    x = torch.randn(1, 8, D, device=dev, requires_grad=True)
    shift = torch.randn(1, 1, D, device=dev, requires_grad=True)
    scale = torch.randn(1, 1, D, device=dev, requires_grad=True)
    w = torch.ones(D, device=dev, requires_grad=True)
    b = torch.zeros(D, device=dev, requires_grad=True)
    for entry in (ext.via_function, ext.via_node):  # gradients reach every input of both
        grads = torch.autograd.grad(entry(x, shift, scale, 1).sum(), (x, shift, scale))
        assert all(g is not None and g.shape == t.shape for g, t in zip(grads, (x, shift, scale)))
    variants = {
        "function_us": lambda: ext.via_function(x, shift, scale, 1),
        "node_us": lambda: ext.via_node(x, shift, scale, 1),
        "allocs_us": lambda: ext.allocs(x, shift, scale, 1),
        "F.layer_norm_grad_us": lambda: torch.nn.functional.layer_norm(x, (D,), w, b),
        "torch.add_us": lambda: torch.add(x, x),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for r in range(args.rounds):
        order = list(variants.items())
        for name, fn in order if r % 2 == 0 else reversed(order):
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    result = {
        "meta": {
            "device": torch.cuda.get_device_name() if dev.type == "cuda" else cpu_name(),
            "device_type": dev.type,
            "torch": torch.__version__,
            "date": _dt.date.today().isoformat(),
            "shape": [1, 8, D],
            "calls_per_round": args.calls,
            "rounds": args.rounds,
            "statistic": "median round (min, max)",
        },
        "us_per_call": {k: statistics.median(v) for k, v in times.items()},
        "spread": {k: [min(v), max(v)] for k, v in times.items()},
    }
    for k, v in result["us_per_call"].items():
        lo, hi = result["spread"][k]
        print(f"{k:22s} {v:7.2f} us  ({lo:.2f}-{hi:.2f})")
    name = device_tag(result["meta"]["device"])
    write_json(args.out, f"autograd_node_overhead_{name}_{result['meta']['date']}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
