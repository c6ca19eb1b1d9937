"""VideoDiTModule: timestep sampling, optimizer, hooks, fusion mixin, and the tiny model learning."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_adaptiveload.models import NormModulate
from lightning_adaptiveload.models.module import (
    MemorySettings,
    OptimizerSettings,
    SamplingSettings,
    VideoDiTModule,
    sample_timesteps,
    shift_timesteps,
)

# ---------------------------------------------------------------------------------------------- timesteps


def test_shift_is_monotone_and_keeps_the_ends():
    t = torch.linspace(0, 1, 101)
    torch.testing.assert_close(shift_timesteps(t, 1.0), t)
    for shift in (0.5, 3.0, 5.0):
        s = shift_timesteps(t, shift)
        assert s[0] == 0 and s[-1] == 1
        assert torch.all(s[1:] > s[:-1])
    # shift > 1 moves mass toward the noisy end (t near 1).
    assert torch.all(shift_timesteps(t[1:-1], 5.0) > t[1:-1])


def test_sample_timesteps_distributions():
    g = torch.Generator().manual_seed(0)
    uniform = sample_timesteps(20000, "uniform", generator=g)
    sigmoid = sample_timesteps(20000, "sigmoid", generator=g)
    shifted = sample_timesteps(20000, "uniform", shift=5.0, generator=g)
    for t in (uniform, sigmoid, shifted):
        assert t.min() >= 0 and t.max() <= 1 and t.dtype == torch.float32
    middle = lambda t: ((t > 0.25) & (t < 0.75)).float().mean().item()  # noqa: E731
    assert abs(middle(uniform) - 0.5) < 0.02
    assert middle(sigmoid) > 0.6  # logit-normal concentrates in the middle
    assert shifted.mean() > 0.7  # E[5u / (1 + 4u)] ~ 0.74
    with pytest.raises(ValueError, match="uniform"):
        sample_timesteps(4, "cosine")


def test_constructor_rejects_bad_arguments():
    with pytest.raises(ValueError, match="timestep_sampling"):
        VideoDiTModule(sampling=SamplingSettings(timestep_sampling="lognormal"))
    with pytest.raises(ValueError, match="shift"):
        VideoDiTModule(sampling=SamplingSettings(shift=0))
    with pytest.raises(ValueError, match="val_timesteps"):
        VideoDiTModule(sampling=SamplingSettings(val_timesteps=(0.5, 1.5)))
    with pytest.raises(ValueError, match="preset"):
        VideoDiTModule(preset="wan-2b")


# ------------------------------------------------------------------------------------------------ hooks


def test_configure_model_builds_once_and_applies_options():
    module = VideoDiTModule(
        model_overrides={"num_layers": 3}, memory=MemorySettings(activation_checkpointing=True)
    )
    assert module.model is None
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model and len(model.blocks) == 3 and model.gradient_checkpointing


def test_compile_option_compiles_every_block_lazily():
    module = VideoDiTModule(compile=True)
    module.configure_model()
    # Module.compile() installs a compiled call; nothing is traced before the first forward.
    assert all(block._compiled_call_impl is not None for block in module.model.blocks)


def test_fused_mixin_composes_with_configure_model():
    fusion = pytest.importorskip("lightning_adaptiveload.fusion.mixin")

    class Fused(fusion.FusedNormModulateMixin, VideoDiTModule):
        pass

    torch.manual_seed(0)
    plain = VideoDiTModule()
    plain.configure_model()
    fused = Fused()
    fused.configure_model()
    fused.load_state_dict(plain.state_dict())
    sites = [m for m in fused.modules() if isinstance(m, NormModulate)]
    assert sites and all(m.fused for m in sites)
    assert not any(m.fused for m in plain.modules() if isinstance(m, NormModulate))
    batch = _batches(1, seed=5)[0]
    noise, t = torch.randn_like(batch["latents"]), torch.rand(batch["batch_size"])
    torch.testing.assert_close(
        fused.compute_loss(batch, noise=noise, t=t)[0], plain.compute_loss(batch, noise=noise, t=t)[0]
    )


def test_optimizer_groups_and_warmup():
    module = VideoDiTModule(optimizer=OptimizerSettings(weight_decay=0.1, warmup_steps=4, lr=1e-3))
    module.configure_model()
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    for name, p in module.model.named_parameters():
        if name.endswith(("modulation", "bias")) or p.dim() == 1:
            assert id(p) not in decayed, name
        else:
            assert id(p) in decayed, name
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_flops_per_batch_is_three_forwards():
    module = VideoDiTModule()
    module.configure_model()
    batch = _batches(1, seed=0)[0]
    _, _, t, h, w = batch["latents"].shape
    expected = 3 * module.model.flops(batch["batch_size"], t * (h // 2) * (w // 2), batch["text"].shape[1])
    assert module.flops_per_batch(batch) == expected


def test_validation_loss_is_deterministic():
    module = VideoDiTModule()
    module.configure_model()
    batch = _batches(1, seed=0)[0]
    module.log = lambda *a, **k: None  # not attached to a Trainer
    assert module.validation_step(batch, 3) == module.validation_step(batch, 3)


# -------------------------------------------------------------------------------------- training works

# Shapes from the "tiny" mix: (T, H, W) of 16-channel latents and the batch size a token budget of ~450
# gives each.
_SHAPES = [((1, 8, 12), 16), ((3, 8, 12), 6), ((5, 10, 10), 3), ((9, 12, 8), 2)]


def _batches(n: int, seed: int) -> list[dict]:
    """A fixed synthetic set in the data path's batch format. The latents have structure to learn: a
    per-sample smooth field (low-frequency in T, H, W) whose amplitude the text states encode."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        (t, h, w), b = _SHAPES[i % len(_SHAPES)]
        amp = torch.rand(b, 16, 1, 1, 1, generator=g) * 2 - 1
        ft, fh, fw = (torch.rand(3, b, 1, 1, 1, 1, generator=g) * 0.6 + 0.2).unbind(0)
        tt = torch.arange(t).view(1, 1, t, 1, 1)
        hh = torch.arange(h).view(1, 1, 1, h, 1)
        ww = torch.arange(w).view(1, 1, 1, 1, w)
        latents = amp * torch.cos(ft * tt + fh * hh) * torch.sin(fw * ww + 1.0)
        text = torch.cat([amp.view(b, 1, 16), torch.zeros(b, 1, 16)], dim=2).expand(b, 3, 32).contiguous()
        seq_len = t * (h // 2) * (w // 2)
        out.append(
            {
                "latents": latents,
                "text": text,
                "text_mask": torch.ones(b, 3, dtype=torch.bool),
                "keys": [f"s{i}_{j}" for j in range(b)],
                "meta": [None] * b,
                "seq_len": seq_len,
                "batch_size": b,
                "num_tokens": b * seq_len,
                "cost": float(b * seq_len),
                "global_tokens": -1,
            }
        )
    return out


class _LossRecorder(L.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))


@pytest.fixture
def one_thread():
    # The tiny model's matmuls are too small to gain from a second thread, and on a busy 2-core machine
    # OpenMP threads spinning against other processes slow them down many times over.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.timeout(120)
def test_tiny_model_loss_falls_on_a_fixed_synthetic_set(one_thread):
    L.seed_everything(1234, verbose=False)
    data = _batches(8, seed=0)
    loader = DataLoader(data, batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(0))
    module = VideoDiTModule(
        preset="tiny",
        optimizer=OptimizerSettings(lr=2e-3, warmup_steps=10),
        sampling=SamplingSettings(shift=1.0),
    )
    recorder = _LossRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=120,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[recorder],
        deterministic=True,
    )
    trainer.fit(module, loader)
    losses = recorder.losses
    assert len(losses) == 120 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < 0.7 * first, (first, last)


def test_empty_batch_adds_nothing_but_touches_every_parameter():
    # The data path yields a 0-sample batch when every planned sample failed at read time (on_error="skip").
    module = VideoDiTModule()
    module.configure_model()
    batch = {"latents": torch.zeros(0, 16, 3, 8, 12), "text": None, "text_mask": None, "num_tokens": 0,
             "global_tokens": 500}  # fmt: skip
    loss, mse = module.compute_loss(batch)
    loss.backward()
    assert loss.item() == 0 and mse.item() == 0
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in module.model.parameters())


# ------------------------------------------------------------------------------ validation across ranks


class _RankBatches(torch.utils.data.IterableDataset):
    """Each rank's own validation batches (uneven in count and size), picked by the rank at iteration."""

    def __init__(self, per_rank: list[list[dict]]):
        self.per_rank = per_rank

    def __iter__(self):
        return iter(self.per_rank[torch.distributed.get_rank()])


def _empty_batch() -> dict:
    return {"latents": torch.zeros(0, 16, 1, 8, 12), "text": torch.zeros(0, 3, 32),
            "text_mask": torch.zeros(0, 3, dtype=torch.bool), "keys": [], "meta": [], "seq_len": 0,
            "batch_size": 0, "num_tokens": 0, "cost": 0.0, "global_tokens": -1}  # fmt: skip


def test_empty_validation_batch_has_weight_zero():
    module = VideoDiTModule()
    module.configure_model()
    module.log = lambda *a, **k: None  # not attached to a Trainer
    batch = _batches(1, seed=0)[0]
    mse = module.validation_step(batch, 0)
    assert module.validation_step(_empty_batch(), 1).item() == 0
    assert module.val_loss.compute().item() == pytest.approx(mse.item(), rel=1e-6)


def _count_forwards(module: VideoDiTModule) -> list[int]:
    calls: list[int] = []
    module.model.register_forward_pre_hook(lambda m, args: calls.append(int(args[0].shape[0])))
    return calls


def test_every_batch_size_runs_as_many_forwards():
    # Under FSDP each forward all-gathers with every rank, so a rank's count of forwards per evaluation
    # step must not depend on its batch: an empty validation step ran none, predict one per sample.
    module = VideoDiTModule()
    module.configure_model()
    module.log = lambda *a, **k: None
    calls = _count_forwards(module)
    times = len(module.sampling_settings.val_timesteps)
    for batch in (_batches(1, seed=0)[0], _empty_batch()):
        calls.clear()
        module.validation_step(batch, 0)
        module.predict_step(batch, 0)
        assert calls == [batch["batch_size"]] * (2 * times)


def test_predict_scores_each_sample_as_in_a_batch_of_its_own():
    module = VideoDiTModule()
    module.configure_model()
    with torch.no_grad():
        module.model.head.head.weight.normal_(std=0.02)  # the zero head would predict 0 for any input
    batch = _batches(1, seed=0)[0]
    batch["text_mask"][1, 2:] = False  # samples with texts of different lengths
    module.eval()
    with torch.no_grad():
        loss = module.predict_step(batch, 4)["loss"]
        alone = []
        for i in range(batch["batch_size"]):
            one = {**batch, "num_tokens": None, "global_tokens": -1}
            for k in ("latents", "text", "text_mask"):
                one[k] = batch[k][i : i + 1]
            alone.append(module._fixed_time_mse(one, 4)[0])
    torch.testing.assert_close(loss, torch.stack(alone), rtol=1e-5, atol=1e-7)
    assert len(set(loss.tolist())) == len(loss)


@pytest.mark.timeout(180)
def test_validation_loss_is_token_weighted_across_ranks(one_thread):
    """Two ranks with uneven batches (rank 0: one large batch; rank 1: three small ones and an empty one):
    the logged val/loss is the token-weighted mean over all batches of both ranks."""
    L.seed_everything(7, verbose=False)
    data = _batches(4, seed=5)
    # Rank 0's latents scaled up: a larger loss on the rank with fewer tokens, so the two means differ.
    data[0] = {**data[0], "latents": 4 * data[0]["latents"]}
    per_rank = [[data[0]], [data[1], data[2], _empty_batch(), data[3]]]
    module = VideoDiTModule(preset="tiny")
    module.configure_model()  # built here so that both ranks hold the same weights
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    (logged,) = trainer.validate(module, DataLoader(_RankBatches(per_rank), batch_size=None), verbose=False)

    module.log = lambda *a, **k: None
    sums, tokens, rank_means = 0.0, 0, []
    for batches in per_rank:
        r_sum, r_tok = 0.0, 0
        for i, batch in enumerate(batches):
            mse = module.validation_step(batch, i).item()
            r_sum, r_tok = r_sum + mse * batch["num_tokens"], r_tok + batch["num_tokens"]
        sums, tokens = sums + r_sum, tokens + r_tok
        rank_means.append(r_sum / r_tok)
    expected = sums / tokens
    assert logged["val/loss"] == pytest.approx(expected, rel=1e-5)
    # What averaging the ranks' means (self.log with sync_dist=True) gave, clearly apart from it.
    old = sum(rank_means) / len(rank_means)
    assert abs(old - expected) > 100 * 1e-5 * expected, (old, expected)


def test_checkpoint_keeps_the_noise_generator_state():
    # A resumed run must draw the noise the uninterrupted run would have (issue 19: resume, same losses).
    module = VideoDiTModule()
    gen = module._noise_gen(torch.device("cpu"))
    torch.randn(5, generator=gen)
    checkpoint: dict = {}
    module.on_save_checkpoint(checkpoint)
    expected = torch.randn(5, generator=gen)
    resumed = VideoDiTModule()
    resumed.on_load_checkpoint(checkpoint)
    torch.testing.assert_close(torch.randn(5, generator=resumed._noise_gen(torch.device("cpu"))), expected)


@pytest.mark.timeout(180)
def test_validate_then_fit_on_the_same_module(one_thread):
    # trainer.validate runs under inference mode and leaves the val_loss metric's states as inference
    # tensors; the fit that follows validates without inference mode and used to fail in the metric's
    # in-place update ("Inplace update to inference tensor outside InferenceMode").
    data = _batches(2, seed=0)
    module = VideoDiTModule(preset="tiny")
    common = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    first = L.Trainer(**common).validate(module, DataLoader(data, batch_size=None), verbose=False)[0]
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=2, **common)
    trainer.fit(module, DataLoader(data, batch_size=None), DataLoader(data, batch_size=None))
    after = float(trainer.callback_metrics["val/loss"])
    assert math.isfinite(first["val/loss"]) and math.isfinite(after)
