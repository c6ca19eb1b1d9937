"""FLOPs without touching the training module: Wan's analytic count, the meta-copy count; loss helpers."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from _tiny_models import tiny_wan
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from lightning_adaptiveload import token_weighted_loss
from lightning_adaptiveload.models.loss import global_token_count, rank_noise_generator
from lightning_adaptiveload.models.wan_flops import find_wan_config, wan_flops_per_batch
from lightning_adaptiveload.monitor.flops import BatchFlops, meta_copy, meta_training_flops


def _tiny_wan():
    return tiny_wan(seed=0)


@pytest.mark.parametrize("text_len", [5, 12])
def test_wan_flops_match_the_flop_counter(text_len):
    wan = _tiny_wan()
    batch = {"latents": torch.randn(2, 4, 3, 4, 6), "text": torch.randn(2, text_len, 16)}
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        wan(batch["latents"], torch.tensor([10, 500]), batch["text"])
    counted = 3 * counter.get_total_flops()
    # The formula leaves out what the counter does not see either (norms, RoPE, activations); the time
    # embedding's per-sample sinusoid matmul is the only small difference.
    assert wan_flops_per_batch(wan.config, batch) == pytest.approx(counted, rel=0.01)
    holder = torch.nn.ModuleDict({"transformer": wan})
    assert find_wan_config(holder) is wan.config and find_wan_config(torch.nn.Linear(2, 2)) is None


class _Step(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))

    def training_step(self, batch, batch_idx):
        noise = torch.randn_like(batch["x"])
        loss = self.net(batch["x"] + noise).square().mean()
        self.log("loss", loss)  # a no-op on the copy (it holds no trainer)
        return token_weighted_loss(loss, batch["n"], -1)  # world size 1 on the copy: no collective


def test_meta_count_leaves_the_module_and_random_state_alone():
    module = _Step()
    module.net = torch.compile(module.net)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    batch = {"x": torch.randn(4, 8), "n": 4}
    rng = torch.get_rng_state()
    flops = meta_training_flops(module, batch)
    assert flops == 3 * 2 * 4 * (8 * 16 + 16 * 8)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) and v.device.type == "cpu" for k, v in module.state_dict().items())
    clone = meta_copy(module)
    assert all(p.is_meta for p in clone.parameters())
    assert not any(type(m).__name__ == "OptimizedModule" for m in clone.modules())


def test_token_weighted_loss_and_its_fallbacks():
    err = torch.tensor(12.0)
    # 2 ranks, 30 tokens in all: this rank's share of the global mean, times the world size DDP divides by
    assert token_weighted_loss(err, 10, 30, world_size=2).item() == pytest.approx(12.0 * 2 / 30)
    assert token_weighted_loss(err, 10, -1, world_size=1).item() == pytest.approx(12.0 / 10)  # no collective
    # a step where every rank's batch is empty: 0, not nan
    assert token_weighted_loss(torch.tensor(0.0), 0, 0, world_size=2).item() == 0.0
    assert global_token_count(10, torch.tensor(30)) == 30
    with pytest.raises(ValueError, match="smaller than this rank's 10 tokens"):
        global_token_count(10, 5)


def test_rank_noise_generators_differ_by_rank_and_repeat_by_seed():
    draw = [torch.randn(4, generator=rank_noise_generator("cpu", rank=r, seed=7)) for r in (0, 1, 0)]
    assert not torch.equal(draw[0], draw[1]) and torch.equal(draw[0], draw[2])


class _FusedWanStep(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from lightning_adaptiveload import fuse_norm_modulate

        self.wan = _tiny_wan()
        fuse_norm_modulate(self.wan)

    def training_step(self, batch, batch_idx):
        t = torch.rand(batch["latents"].shape[0], device=self.device) * 1000  # self.device: meta on the copy
        return self.wan(batch["latents"], t, batch["text"], return_dict=False)[0].square().mean()


def test_meta_count_of_a_fused_wan_equals_the_wan_formula():
    module = _FusedWanStep()
    batch = {"latents": torch.randn(2, 4, 3, 4, 6), "text": torch.randn(2, 5, 16)}
    assert meta_training_flops(module, batch) == wan_flops_per_batch(module.wan.config, batch)
    assert module.device.type == "cpu"


def test_the_monitor_counts_a_wan_without_flops_per_batch_on_the_meta_copy():
    # The monitor knows no model: a module holding a diffusers Wan and no flops_per_batch is counted on the
    # meta copy (the same figure as the Wan formula, above); with flops_per_batch it is the module's.
    warnings = []
    assert BatchFlops(_FusedWanStep(), None, True, lambda *a: warnings.append(a)).source == "flop_counter"
    assert BatchFlops(_FusedWanStep(), None, False, lambda *a: warnings.append(a)).source is None
    assert len(warnings) == 1 and "wan_flops_per_batch" in warnings[0][1]


class _ReadsTrainer(_Step):
    def training_step(self, batch, batch_idx):
        loss = self.net(batch["x"]).square().sum()
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        self.log("lr", lr)
        self.print("never shown")
        return token_weighted_loss(loss, batch["n"], -1, self.trainer.world_size)  # -1 and 2 ranks: no hang


class _Gathers(_Step):
    def training_step(self, batch, batch_idx):
        return self.all_gather(self.net(batch["x"]).sum()).sum()


def test_meta_copy_reads_the_trainer_but_cannot_act_on_it():
    from types import SimpleNamespace

    module = _ReadsTrainer()
    opt = torch.optim.SGD(module.parameters(), lr=0.5)
    module._trainer = SimpleNamespace(world_size=2, global_rank=1, optimizers=[opt], strategy="real")
    batch = {"x": torch.randn(4, 8), "n": 4}
    assert meta_training_flops(module, batch) == 3 * 2 * 4 * (8 * 16 + 16 * 8)
    gathering = _Gathers()
    gathering._trainer = module._trainer
    with pytest.raises(AttributeError, match="trainer.strategy is not available"):
        meta_training_flops(gathering, batch)  # the monitor warns and goes without FLOPs
    gathering._trainer = None


def test_wan_flops_of_a_pack_are_those_of_its_samples():
    # A pack's latents are a list of (C, T, H, W) of different shapes (the packed schedule, lockstep's
    # packed tail); the formula read `.shape` of a tensor and failed on it.
    wan = _tiny_wan()
    shapes = [(4, 3, 4, 6), (4, 1, 8, 8), (4, 3, 4, 6)]
    text = torch.randn(3, 7, 16)
    pack = {"packed": True, "latents": [torch.randn(s) for s in shapes], "text": text}
    alone = [
        wan_flops_per_batch(wan.config, {"latents": torch.randn(1, *s), "text": text[i : i + 1]})
        for i, s in enumerate(shapes)
    ]
    assert wan_flops_per_batch(wan.config, pack) == pytest.approx(sum(alone))
    assert wan_flops_per_batch(wan.config, {**pack, "text": None}) < sum(alone)


class _FollowsTheDocs(L.LightningModule):
    """A module as docs/your_own_model.md tells it (noise from ``rank_noise_generator`` kept on the module, a
    token-weighted loss) with no FLOP formula of its own: the monitor counts it on a meta copy."""

    def __init__(self, direct_generator: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
        self.direct_generator = direct_generator
        self._noise: torch.Generator | None = None

    def training_step(self, batch, batch_idx):
        x0 = batch["latents"].float()
        if self._noise is None or self._noise.device != x0.device:
            self._noise = (
                torch.Generator(device=x0.device).manual_seed(0)  # the same trap, without our helper
                if self.direct_generator
                else rank_noise_generator(x0.device, self.global_rank)
            )
        t = torch.rand(x0.shape[0], 1, generator=self._noise, device=x0.device)
        noise = torch.randn(x0.shape, generator=self._noise, device=x0.device)
        err = (self.net((1 - t) * x0 + t * noise) - (noise - x0)).square().sum()
        return token_weighted_loss(err, batch["num_tokens"], batch["global_tokens"], self.trainer.world_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_rank_noise_generator_on_the_meta_device_draws_meta_tensors():
    # torch.Generator("meta") raises "META device type not an accelerator"; meta factories take a CPU one.
    g = rank_noise_generator("meta", rank=1, seed=7)
    assert (
        g.device.type == "cpu"
        and g.initial_seed() == rank_noise_generator("cpu", rank=1, seed=7).initial_seed()
    )
    assert torch.randn(3, 4, generator=g, device="meta").shape == (3, 4)


@pytest.mark.parametrize("direct_generator", [False, True])
def test_meta_count_of_a_module_that_follows_the_docs(direct_generator):
    from types import SimpleNamespace

    module = _FollowsTheDocs(direct_generator)
    module._trainer = SimpleNamespace(world_size=1, global_rank=0)
    batch = {"latents": torch.randn(4, 8), "num_tokens": 4, "global_tokens": -1}
    assert meta_training_flops(module, batch) == 3 * 2 * 4 * (8 * 16 + 16 * 8)
    assert torch.Generator is not None and type(torch.Generator()) is torch._C.Generator  # restored after


@pytest.mark.timeout(120)
def test_monitor_counts_the_flops_of_a_module_that_follows_the_docs(tmp_path):
    import json

    from lightning_adaptiveload import LoadBalanceMonitor

    batches = [
        {"latents": torch.randn(b, 8), "cost": 1.0, "num_tokens": b, "batch_size": b, "seq_len": 1,
         "global_tokens": -1}
        for b in (4, 2, 4)
    ]  # fmt: skip
    monitor = LoadBalanceMonitor(dirpath=tmp_path, plots=False, print_summary=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[monitor], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(_FollowsTheDocs(), train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    assert monitor.summary["meta"]["flops_source"] == "flop_counter"  # None before: the count failed
    steps = json.load(open(tmp_path / "load_balance.json"))["steps"]
    assert [s["flops"] for s in steps] == [3 * 2 * b * (8 * 16 + 16 * 8) for b in (4, 2, 4)]
