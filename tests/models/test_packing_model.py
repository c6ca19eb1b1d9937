"""A pack through the tiny VideoDiT equals the per-sample computation, forward and backward (CPU, fp32)."""

import pytest
import torch

from lightning_adaptiveload.models.packing import cu_seqlens, flow_loss_packed, segment_ids
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

SHAPES = [(16, 1, 8, 12), (16, 3, 10, 10), (16, 5, 12, 8), (16, 1, 10, 10)]
TEXT_LENS = [5, 9, 0, 3]  # 0: a sample without text (all-False mask row)


def _model(seed: int = 0) -> VideoDiT:
    torch.manual_seed(seed)
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    # The zero-initialised head would hide every difference upstream of it.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.double().float()


def _inputs(model: VideoDiT, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(s, generator=g) for s in SHAPES]
    t = torch.rand(len(SHAPES), generator=g)
    d = model.config.text_dim
    text = torch.zeros(len(SHAPES), max(TEXT_LENS), d)
    mask = torch.zeros(len(SHAPES), max(TEXT_LENS), dtype=torch.bool)
    for i, n in enumerate(TEXT_LENS):
        text[i, :n] = torch.randn(n, d, generator=g)
        mask[i, :n] = True
    noise = [torch.randn(s, generator=g) for s in SHAPES]
    return latents, t, text, mask, noise


def _per_sample(model, latents, t, text, mask, noise):
    cfg = model.config
    elems = cfg.in_channels * cfg.patch_volume
    preds, err = [], 0.0
    for i, x0 in enumerate(latents):
        n = TEXT_LENS[i]
        ctx = text[i : i + 1, : max(n, 1)]
        m = mask[i : i + 1, : max(n, 1)]
        x_t = (1 - t[i]) * x0 + t[i] * noise[i]
        pred = model(x_t[None], (t[i] * 1000)[None], ctx, m)[0]
        preds.append(pred)
        err = err + (pred - (noise[i] - x0)).square().sum() / elems
    return preds, err


def test_offsets_and_segments():
    assert cu_seqlens([3, 2]).tolist() == [0, 3, 5]
    assert segment_ids([3, 2]).tolist() == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_forward_and_backward_equal_per_sample(checkpointing):
    model = _model()
    model.train()
    model.set_activation_checkpointing(checkpointing)
    latents, t, text, mask, noise = _inputs(model)
    ref_preds, ref_err = _per_sample(model, latents, t, text, mask, noise)
    ref_grads = torch.autograd.grad(ref_err, list(model.parameters()), allow_unused=True)

    x_t = [(1 - ti) * a + ti * z for a, z, ti in zip(latents, noise, t)]
    preds = model.forward_packed(x_t, t * 1000, text, mask)
    for p, r in zip(preds, ref_preds):
        assert p.shape == r.shape
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    err, tokens = flow_loss_packed(model, latents, t, noise, 1000, text, mask)
    assert tokens == sum(s[1] * (s[2] // 2) * (s[3] // 2) for s in SHAPES)
    torch.testing.assert_close(err, ref_err, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(err, list(model.parameters()), allow_unused=True)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        if r is None:
            assert g is None or torch.count_nonzero(g) == 0, name
            continue
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_samples_do_not_mix():
    # Changing one sample's latent or text changes only that sample's prediction.
    model = _model().eval()
    latents, t, text, mask, _ = _inputs(model)
    with torch.no_grad():
        before = model.forward_packed(latents, t * 1000, text, mask)
        latents[1] = latents[1] + 1.0
        text[0, :2] += 1.0
        after = model.forward_packed(latents, t * 1000, text, mask)
    assert not torch.allclose(before[0], after[0]) and not torch.allclose(before[1], after[1])
    torch.testing.assert_close(before[2], after[2], rtol=0, atol=0)
    torch.testing.assert_close(before[3], after[3], rtol=0, atol=0)


@pytest.mark.parametrize("how", ["splits", "matmul", "index_add", "index"])
def test_every_segment_sum_gives_the_per_sample_gradients(how, monkeypatch):
    # Every pack through the segments route (a pack of equal lengths included), each way of summing the
    # per-token modulation gradients back to the samples.
    from lightning_adaptiveload.models import packing

    monkeypatch.setattr(packing, "_segment_sum_route", lambda: how)
    model = _model().train()
    latents, t, text, mask, noise = _inputs(model)
    ref_preds, ref_err = _per_sample(model, latents, t, text, mask, noise)
    ref_grads = torch.autograd.grad(ref_err, list(model.parameters()), allow_unused=True)
    err, _ = flow_loss_packed(model, latents, t, noise, 1000, text, mask)
    grads = torch.autograd.grad(err, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(err, ref_err, rtol=1e-5, atol=1e-6)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        if r is not None:
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def _count_calls(model):
    """Forward hooks on the model and on every module a pack must reach as a module call."""
    calls: dict[str, int] = {}
    names = ["", "patch_embedding", "time_embedding", "time_projection", "text_embedding", "head"]
    names += [f"blocks.{i}" for i in range(len(model.blocks))]
    modules = dict(model.named_modules())
    handles = []
    for name in names:
        calls[name] = 0

        def hook(module, args, output, name=name):
            calls[name] += 1

        handles.append(modules[name].register_forward_hook(hook))
    return calls, handles


@pytest.mark.parametrize("shapes", [SHAPES, [SHAPES[1]]], ids=["mixed", "one-clip"])
@pytest.mark.parametrize("entry", ["forward_packed", "call", "flow_loss_packed", "module"])
def test_a_pack_goes_through_the_model_and_every_block_call(entry, shapes):
    # FSDP2's pre-forward hooks, compiled blocks and user hooks live on __call__: a pack must pass through
    # VideoDiT.__call__ and each DiTBlock.__call__, and reach the embeddings and the head as module calls.
    from lightning_adaptiveload.models.module import VideoDiTModule

    model = _model().train()
    g = torch.Generator().manual_seed(3)
    latents = [torch.randn(s, generator=g) for s in shapes]
    n = len(shapes)
    t = torch.rand(n, generator=g)
    text = torch.randn(n, 4, model.config.text_dim, generator=g)
    mask = torch.ones(n, 4, dtype=torch.bool)
    calls, handles = _count_calls(model)
    try:
        if entry == "forward_packed":
            out = model.forward_packed(latents, t * 1000, text, mask)
        elif entry == "call":
            out = model(tuple(latents), t * 1000, text, mask)
        elif entry == "flow_loss_packed":
            out, _ = flow_loss_packed(
                model, latents, t, [torch.randn_like(x) for x in latents], 1000, text, mask
            )
        else:
            module = VideoDiTModule(preset="tiny")
            module.model = model
            batch = {"packed": True, "latents": latents, "text": text, "text_mask": mask}
            out, _ = module.compute_loss(batch)
    finally:
        for h in handles:
            h.remove()
    assert out is not None
    assert calls[""] == 1, calls
    assert all(calls[f"blocks.{i}"] == 1 for i in range(len(model.blocks))), calls
    assert (
        calls["time_embedding"] == calls["time_projection"] == calls["text_embedding"] == calls["head"] == 1
    )
    assert calls["patch_embedding"] == (1 if n == 1 else n), calls  # per latent (a batch: once)


def test_a_pack_of_one_runs_the_bucketed_batch_exactly():
    # Issue 36: a pack of one clip must run what the bucketed batch of that clip runs, so the same blocks
    # see the same arguments (no segments) and the results agree bit for bit.
    model = _model().train()
    model.set_activation_checkpointing(True)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(SHAPES[1], generator=g)
    t = torch.rand(1, generator=g) * 1000
    text = torch.randn(1, 5, model.config.text_dim, generator=g)
    seen = []
    handle = model.blocks[0].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(([tuple(a.shape) for a in args if a is not None], dict(kwargs))),
        with_kwargs=True,
    )
    try:
        out_batch = model(x[None], t, text)
        grads_batch = torch.autograd.grad(out_batch.square().sum(), list(model.parameters()))
        (out_pack,) = model([x], t, text)
        grads_pack = torch.autograd.grad(out_pack.square().sum(), list(model.parameters()))
    finally:
        handle.remove()
    assert seen[0] == seen[1] and seen[1][1] == {}
    assert torch.equal(out_pack, out_batch[0])
    for a, b in zip(grads_pack, grads_batch):
        assert torch.equal(a, b)


def test_a_pack_refuses_items_that_are_not_latents():
    model = _model()
    with pytest.raises(ValueError, match="list of latents"):
        model([torch.randn(1, 16, 1, 4, 4)], torch.rand(1))
    with pytest.raises(ValueError, match="timestep of shape"):
        model([torch.randn(16, 1, 4, 4)], torch.rand(2))


class _VarlenLikeTheKernel(torch.autograd.Function):
    """A stand-in for ``varlen_attn`` on CPU with the CUDA kernel's contract: keys outside every segment of
    ``cu_k`` are never read, and their gradient is left unwritten (NaN here; uninitialised memory on the GPU,
    which gave the 2 x H200 packed run of 2026-11-27 a NaN loss from the step after its first mixed pack)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k):
        ctx.save_for_backward(q, k, v, cu_q, cu_k)
        return _VarlenLikeTheKernel._attend(q, k, v, cu_q, cu_k)

    @staticmethod
    def _attend(q, k, v, cu_q, cu_k):
        outs = []
        for i in range(cu_q.numel() - 1):
            qs = q[int(cu_q[i]) : int(cu_q[i + 1])].transpose(0, 1)
            ks, vs = (x[int(cu_k[i]) : int(cu_k[i + 1])].transpose(0, 1) for x in (k, v))
            if ks.shape[1] == 0:
                outs.append(torch.zeros_like(qs).transpose(0, 1))
                continue
            outs.append(torch.nn.functional.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, cu_q, cu_k = ctx.saved_tensors
        with torch.enable_grad():
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            out = _VarlenLikeTheKernel._attend(qq, kk, vv, cu_q, cu_k)
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), grad, allow_unused=True)
        read = torch.zeros(k.shape[0], dtype=torch.bool)
        read[: int(cu_k[-1])] = True
        dk, dv = (torch.where(read[:, None, None], g, float("nan")) for g in (dk, dv))
        return dq, dk, dv, None, None


def test_a_mixed_pack_through_the_varlen_route_has_the_per_sample_gradients(monkeypatch):
    # The varlen kernel only runs on CUDA; here a CPU stand-in with its contract runs in its place, so that the
    # model's use of it (key order, padding keys, samples without text) is checked on CPU.
    from lightning_adaptiveload.models import packing

    monkeypatch.setattr(packing, "_varlen_applies", lambda q: True)
    monkeypatch.setattr(packing, "varlen_applies_to", lambda device, dtype: True)
    monkeypatch.setattr(packing, "_segment_attention_route", lambda: "varlen")
    monkeypatch.setattr(
        packing,
        "_varlen",
        lambda q, k, v, cu_q, cu_k, max_q, max_k: _VarlenLikeTheKernel.apply(q, k, v, cu_q, cu_k),
    )
    model = _model()
    latents, t, text, mask, noise = _inputs(model)
    _, ref_err = _per_sample(model, latents, t, text, mask, noise)
    ref_grads = torch.autograd.grad(ref_err, list(model.parameters()), allow_unused=True)
    err, _ = flow_loss_packed(model, latents, t, noise, 1000, text, mask)
    torch.testing.assert_close(err, ref_err, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad(err, list(model.parameters()), allow_unused=True)
    for (name, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        if r is None:
            assert g is None or torch.count_nonzero(g) == 0, name
            continue
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
