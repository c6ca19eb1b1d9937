"""Token-weighted loss: with uneven per-rank batches, DDP's gradient equals the single-process gradient
over the union of the batches (every token of the global batch counts the same)."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_adaptiveload.models.module import VideoDiTModule

_TEXT_DIM = 32


def _batch(
    b: int, shape: tuple[int, int, int], seed: int, text_len: int = 4, global_tokens: int = -1
) -> dict:
    g = torch.Generator().manual_seed(seed)
    t, h, w = shape
    latents = torch.randn(b, 16, t, h, w, generator=g)
    text = torch.randn(b, text_len, _TEXT_DIM, generator=g)
    mask = torch.ones(b, text_len, dtype=torch.bool)
    mask[0, text_len // 2 :] = False
    seq_len = t * (h // 2) * (w // 2)
    return {
        "latents": latents,
        "text": text,
        "text_mask": mask,
        "seq_len": seq_len,
        "batch_size": b,
        "num_tokens": b * seq_len,
        "global_tokens": global_tokens,
        # Fixed noise and times, so that both runs see exactly the same problem.
        "_noise": torch.randn(latents.shape, generator=g),
        "_t": torch.rand(b, generator=g),
    }


def _concat(a: dict, b: dict) -> dict:
    out = {k: torch.cat([a[k], b[k]]) for k in ("latents", "text", "text_mask", "_noise", "_t")}
    out.update(num_tokens=a["num_tokens"] + b["num_tokens"], global_tokens=-1)
    return out


def _module() -> VideoDiTModule:
    torch.manual_seed(0)
    module = VideoDiTModule(preset="tiny")
    module.configure_model()
    # A non-zero head, so that every parameter gets a gradient.
    torch.nn.init.normal_(module.model.head.head.weight, std=0.05)
    return module


def _grads(module: VideoDiTModule) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in module.model.parameters()]


def _loss(module, batch):
    return module.compute_loss(batch, noise=batch["_noise"], t=batch["_t"])[0]


# Rank r's batch in each case: (batch size, latent (T, H, W)). Case "same_shape" differs in B only, so the
# union is one batch; "mixed" differs in shape too (as the adaptive data path produces).
_CASES = {
    "same_shape": [(3, (3, 8, 12)), (1, (3, 8, 12))],
    "mixed": [(4, (1, 8, 12)), (1, (9, 8, 12))],
    # Rank 1's batch has no text at all (text None): its cross-attention is skipped, and DDP must still see
    # a gradient for every parameter.
    "one_rank_without_text": [(2, (3, 8, 12)), (3, (1, 8, 12))],
}
_NO_TEXT = {("one_rank_without_text", 1)}


def _rank_batches(case: str, global_known: bool) -> list[dict]:
    specs = _CASES[case]
    tokens = sum(b * t * (h // 2) * (w // 2) for b, (t, h, w) in specs)
    batches = []
    for r, (b, shape) in enumerate(specs):
        batch = _batch(b, shape, seed=100 + r, global_tokens=tokens if global_known else -1)
        if (case, r) in _NO_TEXT:
            batch.update(text=None, text_mask=None)
        batches.append(batch)
    return batches


def _single_process_grads(case: str) -> list[torch.Tensor]:
    """Gradient of the per-token mean over all tokens of both ranks, in one process."""
    module = _module()
    a, b = _rank_batches(case, global_known=False)
    if case == "same_shape":
        _loss(module, _concat(a, b)).backward()
    else:
        total = a["num_tokens"] + b["num_tokens"]
        for part in (a, b):
            _loss(module, {**part, "global_tokens": total}).backward()
    return _grads(module)


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    # A collective that waits longer than this fails instead of hanging.
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=90)
    )
    try:
        results = {}
        for case in _CASES:
            for global_known in (False, True):
                module = _module()
                # Real DDP: it averages gradients over the ranks with equal weight.
                module.model = torch.nn.parallel.DistributedDataParallel(module.model)
                _loss(module, _rank_batches(case, global_known)[rank]).backward()
                results[(case, global_known)] = [p.grad.clone() for p in module.model.module.parameters()]
            # Negative control: a plain per-rank mean, averaged by DDP.
            module = _module()
            module.model = torch.nn.parallel.DistributedDataParallel(module.model)
            batch = _rank_batches(case, False)[rank]
            _, mse = module.compute_loss(batch, noise=batch["_noise"], t=batch["_t"])
            x0 = batch["latents"]
            tb = batch["_t"].view(-1, 1, 1, 1, 1)
            pred = module.model(
                (1 - tb) * x0 + tb * batch["_noise"], batch["_t"] * 1000, batch["text"], batch["text_mask"]
            )
            (pred - (batch["_noise"] - x0)).square().mean().backward()
            results[(case, "plain_mean")] = [p.grad.clone() for p in module.model.module.parameters()]
        # Free every DDP reducer while the process group still exists: a reducer torn down after
        # destroy_process_group can block in gloo (seen as a rare hang at interpreter exit).
        del module
        gc.collect()
        dist.barrier()
        if rank == 0:
            torch.save(results, os.path.join(out_dir, "grads.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp_grads(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    context = mp.spawn(_worker, args=(2, str(tmp / "init"), str(tmp)), nprocs=2, join=False)
    deadline = time.monotonic() + 150
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("the 2-process gloo run did not finish within 150 s")
    return torch.load(tmp / "grads.pt")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("global_known", [False, True], ids=["all_gather", "from_batch"])
def test_ddp_gradient_equals_union_gradient(ddp_grads, case, global_known):
    expected = _single_process_grads(case)
    got = ddp_grads[(case, global_known)]
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-7)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(_CASES))
def test_plain_mean_would_be_wrong(ddp_grads, case):
    # Control: averaging per-rank means over-weights the smaller batch; the test above can fail.
    expected = _single_process_grads(case)
    got = ddp_grads[(case, "plain_mean")]
    rel = max(((g - e).norm() / e.norm().clamp_min(1e-12)).item() for g, e in zip(got, expected))
    assert rel > 1e-2


def test_single_process_loss_is_the_per_token_mean():
    module = _module()
    batch = _batch(2, (3, 8, 12), seed=3)
    loss, mse = module.compute_loss(batch, noise=batch["_noise"], t=batch["_t"])
    torch.testing.assert_close(loss.detach(), mse)
    # The per-token squared error summed over channels and patch pixels, averaged over tokens, equals
    # the element mean.
    x0, tb = batch["latents"], batch["_t"].view(-1, 1, 1, 1, 1)
    with torch.no_grad():
        pred = module(
            (1 - tb) * x0 + tb * batch["_noise"], batch["_t"] * 1000, batch["text"], batch["text_mask"]
        )
    torch.testing.assert_close(mse, (pred - (batch["_noise"] - x0)).square().mean())


def test_global_tokens_from_the_batch_scale_the_loss():
    module = _module()
    batch = _batch(2, (3, 8, 12), seed=3)
    alone, _ = module.compute_loss(batch, noise=batch["_noise"], t=batch["_t"])
    shared, _ = module.compute_loss(
        {**batch, "global_tokens": 4 * batch["num_tokens"]}, noise=batch["_noise"], t=batch["_t"]
    )
    torch.testing.assert_close(shared, alone / 4)


def test_bad_token_counts_raise():
    module = _module()
    batch = _batch(2, (3, 8, 12), seed=3)
    with pytest.raises(ValueError, match="global_tokens"):
        module.compute_loss({**batch, "global_tokens": batch["num_tokens"] - 1})
    with pytest.raises(ValueError, match="patch_size"):
        module.compute_loss({**batch, "num_tokens": batch["num_tokens"] * 4})
