"""A mixed pack's loss and gradients on a GPU, route by route, against the same samples run one by one.

Runs ``benchmarks/checks/packed_grad_check.py`` (two wan-1.3b-wide blocks, bf16 autocast, activation
checkpointing; a 20,280-token clip and four images in one pack, in two orders) and asserts its verdict:
every attention route that runs gives a finite loss, finite outputs and finite gradients, and gradients as
close to the one-by-one samples' as the route without any variable-length kernel (``no_varlen``, the bf16
noise floor of the same run). Before the fix of the varlen cross-attention's backward (the text padding keys'
gradient left unwritten), the ``default`` route had non-finite gradients in one order and a gradient error
about 1e9 times the floor in both. Skipped without CUDA.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import _paths
import pytest
import torch

ROOT = str(_paths.ROOT)
SCRIPT = os.path.join(ROOT, "benchmarks", "checks", "packed_grad_check.py")
# flash / efficient may be missing on a GPU: a row, not a failure
MUST_RUN = ("default", "varlen", "no_varlen")


def _verdict(result: dict) -> list[str]:
    """What is wrong in one ``packed_grad_check`` result: one line per failed route and order."""
    wrong = []
    for check in result["checks"]:
        rows = {row["route"]: row for row in check["rows"]}
        order = check["order"]
        if rows["one by one"]["nonfinite_grads"]:
            wrong.append(f"order {order}: the one-by-one reference has non-finite gradients")
        for route in MUST_RUN:
            if "error" in rows.get(route, {"error": "missing"}):
                wrong.append(
                    f"order {order}, route {route}: did not run ({rows.get(route, {}).get('error')})"
                )
        floor = rows.get("no_varlen", {}).get("grad_rel_l2_max", float("nan"))
        for route, row in rows.items():
            if route == "one by one" or "error" in row:
                continue
            if (
                not torch.isfinite(torch.tensor(row["loss"]))
                or row["nonfinite_outputs"]
                or row["nonfinite_grads"]
            ):
                wrong.append(f"order {order}, route {route}: non-finite {row}")
            elif not row["grad_rel_l2_max"] <= 3 * floor:
                wrong.append(
                    f"order {order}, route {route}: gradient error {row['grad_rel_l2_max']:.3g} against the "
                    f"no_varlen floor {floor:.3g}"
                )
    return wrong


def test_the_verdict_names_a_nonfinite_route_and_a_gradient_far_above_the_floor():
    # The verdict on the GPU result before the fix (its numbers, shortened): it must fail, and say where.
    def row(route, grads=0, err=0.03):
        return {"route": route, "loss": 7.85, "nonfinite_outputs": 0, "nonfinite_grads": grads,
                "output_rel_l2_max": 0.0036, "grad_rel_l2_max": err}  # fmt: skip

    before = {"checks": [{"order": [0, 1, 2, 3, 4], "rows": [
        {"route": "one by one", "loss": 7.85, "nonfinite_grads": 0},
        row("default", grads=8, err=2.2e7), row("varlen", err=2.2e7), row("no_varlen", err=0.0266)]}]}  # fmt: skip
    wrong = _verdict(before)
    assert any("route default: non-finite" in w for w in wrong), wrong
    assert any("route varlen: gradient error 2.2e+07" in w for w in wrong), wrong
    after = {"checks": [{"order": [0, 1, 2, 3, 4], "rows": [
        {"route": "one by one", "loss": 7.85, "nonfinite_grads": 0},
        row("default", err=0.031), row("varlen", err=0.031), row("no_varlen", err=0.0266)]}]}  # fmt: skip
    assert _verdict(after) == []


@pytest.mark.cuda
@pytest.mark.timeout(900)
def test_on_the_gpu_every_route_of_a_mixed_pack_gives_finite_right_gradients(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=850
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "packed_grad_check_*.json"))
    wrong = _verdict(json.load(open(path)))
    assert not wrong, "\n".join(wrong)
