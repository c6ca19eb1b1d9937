"""The MMDiT example (examples/mmdit): an SD3-style joint-attention model of the user's own, trained through
its recipe with the DataModule, the LoadBalanceMonitor and fusion. A short fit on CPU in one process
through the CLI, and in process: the fused training step equals the unfused one, and a pack runs as its
samples."""

from __future__ import annotations

import csv
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _paths import ROOT

pytest.importorskip("diffusers")

EXAMPLE = ROOT / "examples" / "mmdit"


def _run(cmd: str, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lightning_adaptiveload", cmd, "--config", "mmdit_flow.yaml", *extra],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


@pytest.mark.timeout(600)
def test_mmdit_example_fits_and_validates_on_cpu(tmp_path):
    work = tmp_path / "mine"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("runs", "data", "__pycache__"))
    small = [
        "--trainer.devices=1",
        "--trainer.strategy=auto",
        "--trainer.limit_train_batches=4",
        "--trainer.log_every_n_steps=1",
        "--data.init_args.synthetic.num_samples=12",
        "--data.init_args.synthetic.samples_per_shard=6",
        "--data.init_args.synthetic.val_num_samples=4",
    ]
    fit = _run("fit", work, *small)
    assert fit.returncode == 0, fit.stderr[-4000:]
    out = fit.stdout + fit.stderr
    # The mixin's report: the SD3 blocks' FFN sites, SD3.5's dual-attention norm, the adaLN-Zero norms and
    # the head, each checked by the probe on a perturbed copy.
    for cls in (
        "JointTransformerBlock",
        "SD35AdaLayerNormZeroX",
        "AdaLayerNormZero",
        "AdaLayerNormContinuous",
    ):
        assert f"  {cls}: " in out, out[-4000:]
    assert "9 norm+modulate site(s) in 7 module(s) now run through the fused ops" in out
    assert "matches the original forward and gradients on a perturbed copy" in out
    assert "FLOPs by flops_per_batch" in out  # the monitor took the module's FLOPs
    assert "layer_norm_modulate (rank 0): PyTorch fallback" in out  # the fused sites ran (CPU: the reference)
    metrics = next((work / "runs" / "mmdit_flow" / "logs").rglob("metrics.csv"))
    rows = list(csv.DictReader(open(metrics)))
    losses = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    assert len(val) == 1 and 0 < val[0] < 10


def _module(fused: bool = True):
    sys.path.insert(0, str(EXAMPLE))
    try:
        from mmdit_flow import MMDiTFlowModule
    finally:
        sys.path.remove(str(EXAMPLE))
    torch.manual_seed(0)
    module = MMDiTFlowModule(num_layers=2, dual_attention_layers=(0,))
    module.fuse_enabled = fused
    module.configure_model()
    return module


def _batch():
    g = torch.Generator().manual_seed(0)
    return {
        "latents": torch.randn(2, 16, 3, 4, 6, generator=g),
        "text": torch.randn(2, 5, 16, generator=g),
        "text_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
    }


def test_mmdit_example_fused_step_equals_unfused():
    fused, plain = _module(), _module(fused=False)
    with torch.no_grad():  # every weight random: adaLN-Zero-like small projections must not hide a swap
        for (_, p), (_, q) in zip(fused.named_parameters(), plain.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.2)
            q.copy_(p)
    assert fused.fusion_report.num_sites == 9 and plain.fusion_report is None
    results = []
    for module in (fused, plain):
        noise = torch.Generator().manual_seed(1)
        module._noise = noise
        err = module._velocity_error(_batch()).sum()
        err.backward()
        results.append((err.detach(), {n: p.grad for n, p in module.named_parameters()}))
    (err_f, grads_f), (err_p, grads_p) = results
    torch.testing.assert_close(err_f, err_p, rtol=1e-5, atol=1e-5)
    for name, g in grads_p.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-5, atol=1e-5, msg=name)


def test_mmdit_example_runs_a_pack_as_its_samples():
    from lightning_adaptiveload.loading.packed_collate import collate_packed

    module = _module()
    g = torch.Generator().manual_seed(0)
    samples = [
        {"__key__": f"k{i}", "latent": torch.randn(16, *thw, generator=g), "text": torch.randn(n, 16, generator=g),
         "meta": {}}
        for i, (thw, n) in enumerate([((1, 4, 6), 3), ((3, 4, 4), 5), ((2, 2, 6), 1)])
    ]  # fmt: skip
    pack = collate_packed(samples, text_pad_to=12)
    module._noise = torch.Generator().manual_seed(1)
    with torch.no_grad():
        err = module._pack_error(pack)
        module._noise = torch.Generator().manual_seed(1)
        alone = [
            module._velocity_error({"latents": x.unsqueeze(0), "text": pack["text"][i : i + 1],
                                    "text_mask": pack["text_mask"][i : i + 1]})
            for i, x in enumerate(pack["latents"])
        ]  # fmt: skip
    assert err.shape == (3,) and torch.allclose(err, torch.cat(alone))
    assert module.flops_per_batch(pack) == sum(
        module.flops_per_batch({"latents": x.unsqueeze(0), "text": pack["text"]}) for x in pack["latents"]
    )
