"""KernelWarmup: an epoch's batch shapes run once through the first block before the first step.

What it must do, on CPU: list exactly the batches the loader will yield; cover every dense batch and every
run of a mixed pack; run the same graphs as training (a compiled model compiles nothing more once training
starts); change nothing that trains (parameters, gradients, the random streams); refuse what it cannot do.
"""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
import torch._dynamo
from _fixtures import quiet_cpu_trainer

from lightning_adaptiveload import Batching, Loader, PlanSettings
from lightning_adaptiveload.callbacks.kernel_warmup import KernelWarmup
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.models.acceleration import compile_blocks, compiled_graphs
from lightning_adaptiveload.models.kernel_warmup import (
    plan_warmup,
    planned_batches,
    run_budgeted,
    warm_kernels,
    warm_packs,
)
from lightning_adaptiveload.models.module import VideoDiTModule
from lightning_adaptiveload.models.pack_attention import equal_runs
from lightning_adaptiveload.models.video_dit import VideoDiT, VideoDiTConfig

_CFG = dict(dim=32, num_layers=2, num_heads=2, ffn_dim=64, text_dim=16, freq_dim=32)
PATCH = (1, 2, 2)
GRIDS = [(1, 4, 4), (2, 4, 4), (1, 6, 6), (1, 4, 6), (3, 2, 2), (2, 2, 2)]


def _shape(grid):
    return (16, *grid)


def _tokens(shape):
    return shape[1] * (shape[2] // 2) * (shape[3] // 2)


def _random_batches(seed: int, count: int = 30):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        if rng.random() < 0.3:  # a bucketed batch
            out.append((_shape(rng.choice(GRIDS)),) * rng.randint(1, 4))
        else:
            out.append(tuple(_shape(rng.choice(GRIDS)) for _ in range(rng.randint(1, 6))))
    return out


def _runs(batch):
    return equal_runs([_tokens(s) for s in batch])


@pytest.mark.parametrize("seed", range(8))
def test_warm_packs_take_every_dense_batch_and_every_run_once(seed):
    batches = _random_batches(seed)
    seen: set = set()
    packs = warm_packs(batches, PATCH, seen)
    dense_in = {b for b in batches if len(set(map(_tokens, b))) == 1}
    runs_in = {r for b in batches if len(set(map(_tokens, b))) > 1 for r in _runs(b)}
    dense_out = [tuple(p) for p in packs if len(set(map(_tokens, p))) == 1]
    mixed_out = [p for p in packs if len(set(map(_tokens, p))) > 1]
    assert sorted(dense_out) == sorted(dense_in)  # each once
    runs_out = [r for p in mixed_out for r in _runs(p)]
    assert runs_in <= set(runs_out)  # every run, as a run of a mixed pack (never merged with a neighbour)
    counts_in = {len(b) for b in batches if len(set(map(_tokens, b))) > 1}
    assert counts_in <= {
        len(p) for p in mixed_out
    }  # every sample count of a mixed pack (torch 2.11 guards it)
    assert len(mixed_out) <= len(runs_in) + len(counts_in)
    cap = max(sum(map(_tokens, b)) for b in batches)
    shortest = min(_tokens(s) for b in batches if len(set(map(_tokens, b))) > 1 for s in b)
    for p in mixed_out:
        lengths = [length for length, _ in _runs(p)]
        assert len(lengths) == len(set(lengths))  # one run per length
        assert sum(map(_tokens, p)) <= cap + max(shortest, max(lengths))  # the cap, but for a partner
    # The same batches again: nothing new. A new run alone is taken, with a partner.
    assert warm_packs(batches, PATCH, seen) == []
    new = (_shape((1, 2, 2)),) * 7 + (_shape((1, 6, 6)),)  # a run of 7 one-token samples: new
    again = warm_packs([new], PATCH, seen)
    assert len(again) == 1 and (1, 7) in _runs(again[0]) and len(set(map(_tokens, again[0]))) == 2


def test_warm_packs_of_nothing():
    assert warm_packs([], PATCH) == []
    assert warm_packs([(_shape((1, 4, 4)),) * 2], PATCH) == [[_shape((1, 4, 4))] * 2]


@pytest.fixture(scope="module")
def shards(synthetic_shards) -> str:
    return synthetic_shards([9, 3, 7, 5], seed=5, name="warm")


def _datamodule(shards: str, schedule: str) -> AdaptiveLoadDataModule:
    return AdaptiveLoadDataModule(
        train_shards=shards,
        batching=Batching(max_tokens=768),
        plan=PlanSettings(schedule=schedule),
        loader=Loader(num_workers=0),
    )


@pytest.mark.parametrize("schedule", ["packed", "lockstep", "independent"])
def test_planned_batches_are_what_the_loader_yields(shards, schedule):
    dm = _datamodule(shards, schedule)
    dm.setup("fit")
    yielded = [
        tuple(tuple(x.shape) for x in (b["latents"] if b.get("packed") else b["latents"].unbind(0)))
        for b in dm.train_dataloader()
    ]
    ds = dm.train_dataset
    assert list(planned_batches(ds.plan, ds.rank, ds.index.latent_shape)) == yielded
    assert len(yielded) > 3


def _model(seed: int = 0, compiled: bool = False) -> VideoDiT:
    torch.manual_seed(seed)
    model = VideoDiT(VideoDiTConfig.preset("tiny", **_CFG)).train()
    torch.nn.init.normal_(model.head.head.weight, std=0.02)
    model.set_activation_checkpointing(True, "save_attention")
    if compiled:
        compile_blocks(model, backend="aot_eager")
    return model


def _train_step(model: VideoDiT, batch, g: torch.Generator) -> None:
    n = len(batch)
    latents = [torch.randn(s, generator=g) for s in batch]
    mask = torch.ones(n, 7, dtype=torch.bool)
    out = model(latents, torch.rand(n, generator=g) * 1000, torch.randn(n, 7, 16, generator=g), mask)
    sum(o.square().sum() for o in out).backward()


def test_warm_up_changes_nothing_that_trains():
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rng = torch.get_rng_state()
    packs = warm_packs(_random_batches(1, 12), PATCH)
    assert warm_kernels(model, packs, (7, torch.float32), torch.device("cpu")) == len(packs) > 2
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)  # its random inputs come from a generator of its own


def test_a_compiled_model_compiles_nothing_more_in_training_after_the_warm_up():
    batches = _random_batches(2, 10)
    per_batch = {}
    for warm in (False, True):
        torch._dynamo.reset()
        model = _model(compiled=True)
        if warm:
            warm_kernels(model, warm_packs(batches, PATCH), (7, torch.float32), torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        counts = []
        for batch in batches:
            start = compiled_graphs()
            _train_step(model, batch, g)
            counts.append(compiled_graphs() - start)
        per_batch[warm] = counts
    assert sum(per_batch[False]) > 0  # without it, training compiles (the test can fail)
    assert per_batch[True] == [0] * len(batches), per_batch


class _Record(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _fit(tmp_path, shards, callbacks, epochs: int = 2):
    torch.manual_seed(0)
    module = VideoDiTModule(preset="tiny")
    dm = _datamodule(shards, "packed")
    record = _Record()
    trainer = quiet_cpu_trainer(
        tmp_path, max_epochs=epochs, callbacks=[*callbacks, record], reload_dataloaders_every_n_epochs=1
    )
    trainer.fit(module, datamodule=dm)
    return module, record.losses


def test_in_a_fit_it_runs_each_epoch_and_training_is_unchanged(tmp_path, shards, caplog):
    caplog.set_level("INFO")
    warm = KernelWarmup()
    plain_module, plain = _fit(tmp_path / "plain", shards, [])
    warm_module, losses = _fit(tmp_path / "warm", shards, [warm])
    assert losses == plain and len(losses) > 4
    for (name, p), q in zip(plain_module.named_parameters(), warm_module.parameters()):
        assert torch.equal(p, q), name
    assert [h["epoch"] for h in warm.history] == [0, 1]
    assert warm.history[0]["packs"] > 0
    assert sum(h["batches"] for h in warm.history) == len(losses)  # every planned batch read, one per step
    assert "[adaptiveload] kernel warm-up, epoch 0:" in caplog.text
    first = warm.history[0]
    assert first["packs"] == first["planned_packs"] <= warm.max_shapes  # the default budget held
    assert first["warmed"] + first["skipped_shapes"] == first["shapes"]
    assert "new shapes" in caplog.text  # the estimate before it runs


def test_in_a_fit_a_budget_of_one_shape_warms_one_and_says_what_it_skipped(tmp_path, shards, caplog):
    caplog.set_level("INFO")
    warm = KernelWarmup(max_shapes=1, min_count=1)
    _, losses = _fit(tmp_path, shards, [warm], epochs=1)
    (entry,) = warm.history
    assert entry["packs"] == 1 and entry["shapes"] > 1
    assert entry["skipped_shapes"] == entry["shapes"] - entry["warmed"] > 0
    assert entry["skipped"]["over_max_shapes"] == entry["skipped_shapes"]
    assert 0 < entry["skipped_steps"] <= entry["batches"] == len(losses)
    assert f"skipped {entry['skipped_shapes']} shapes" in caplog.text
    assert f"met by {entry['skipped_steps']} of the {entry['batches']} steps" in caplog.text


class _OwnModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Linear(2, 2)

    def training_step(self, batch, batch_idx):
        return self.model.weight.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.ones(4, 2), batch_size=2)


def test_it_refuses_a_model_it_cannot_run_and_data_without_a_plan(tmp_path, shards):
    with pytest.raises(
        ValueError, match=r"KernelWarmup runs the blocks of a VideoDiT.*_OwnModel.model is Linear"
    ):
        quiet_cpu_trainer(tmp_path, max_steps=1, callbacks=[KernelWarmup()]).fit(_OwnModel())

    class _VideoWithOwnData(VideoDiTModule):
        def train_dataloader(self):
            return torch.utils.data.DataLoader([{"latents": torch.zeros(1, 16, 1, 4, 4)}], batch_size=None)

    with pytest.raises(ValueError, match="KernelWarmup reads the epoch's plan"):
        quiet_cpu_trainer(tmp_path, max_steps=1, callbacks=[KernelWarmup()]).fit(
            _VideoWithOwnData(preset="tiny")
        )


def test_under_fsdp2_it_steps_aside_with_a_warning(tmp_path, shards, monkeypatch):
    # The two-process FSDP2 tests cost minutes; the decision is the model's sharding, faked here.
    from lightning_adaptiveload.callbacks import kernel_warmup as warmup_callback

    monkeypatch.setattr(warmup_callback, "is_fsdp2_sharded", lambda module: True)
    warm = KernelWarmup()
    with pytest.warns(UserWarning, match="KernelWarmup does nothing under FSDP2"):
        _, losses = _fit(tmp_path, shards, [warm], epochs=1)
    assert warm.history == [] and len(losses) > 4


@pytest.mark.cuda
def test_on_a_gpu_a_compiled_model_under_autocast_compiles_nothing_more_after_the_warm_up():
    # Inductor's guards (strides, alignment, dynamic sizes) are stricter than aot_eager's: the warm-up must
    # meet the same graphs on the GPU path the recipes take (bf16 autocast, cuDNN attention on Hopper).
    device = torch.device("cuda")
    batches = _random_batches(3, 8)
    torch._dynamo.reset()
    model = _model().to(device)
    model.set_attention_backend("auto")
    compile_blocks(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        warm_kernels(model, warm_packs(batches, PATCH), (7, torch.float32), device)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    g = torch.Generator().manual_seed(0)
    counts = []
    for batch in batches:
        n = len(batch)
        latents = [torch.randn(s, generator=g).to(device) for s in batch]
        text = torch.randn(n, 7, 16, generator=g).to(device)
        start = compiled_graphs()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(latents, (torch.rand(n, generator=g) * 1000).to(device), text, None)
            loss = sum(o.float().square().sum() for o in out)
        loss.backward()
        assert torch.isfinite(loss)
        counts.append(compiled_graphs() - start)
    assert counts == [0] * len(batches), counts


# -- the budget (issue 63): shapes chosen by the plan's counts, a cap in shapes and in seconds ------------------


def _dense(grid, n=2):
    return (_shape(grid),) * n


def test_the_plan_counts_shapes_and_warms_those_that_recur_most_frequent_first():
    a, b, c = _dense((1, 4, 4)), _dense((2, 4, 4)), _dense((1, 6, 6))
    mixed = (_shape((1, 4, 4)), _shape((1, 6, 6)), _shape((1, 6, 6)))  # runs (4, 1), (9, 2); 3 samples
    batches = [a, b, a, mixed, a, b, c, mixed, a]
    plan = plan_warmup(batches, PATCH, min_count=2)
    assert plan.steps == 9
    assert plan.shapes == 6  # a, b, c, the runs (4, 1) and (9, 2), the mixed count 3
    assert plan.recurring == 5 and plan.chosen == 5  # c is met once
    assert plan.packs[0] == list(a) and plan.packs[1] == list(b)  # most frequent first (4, then 2 steps)
    assert list(c) not in plan.packs
    assert plan.skipped() == {"shapes": 1, "once": 1, "over_max_shapes": 0, "over_max_seconds": 0, "steps": 1}
    # Shapes met before are neither counted nor run again; shapes met once are still "seen" after the epoch
    # (its training built them).
    seen = plan.seen_after()
    assert ("dense", c) in seen
    again = plan_warmup(batches, PATCH, seen, min_count=2)
    assert again.shapes == 0 and again.packs == [] and again.skipped()["steps"] == 0


@pytest.mark.parametrize("seed", range(4))
def test_max_shapes_caps_the_passes_and_keeps_the_most_frequent(seed):
    batches = _random_batches(seed, 60)
    full = plan_warmup(batches, PATCH)
    counts = {}
    for b in batches:
        units = plan_warmup([b], PATCH)._units
        for u in units:
            counts[u] = counts.get(u, 0) + 1
    assert full.shapes == len(counts) and full.skipped()["shapes"] == 0
    for cap in (0, 1, 2, 5, full.shapes):
        plan = plan_warmup(batches, PATCH, max_shapes=cap)
        assert len(plan.packs) <= cap and plan.chosen == min(cap, full.shapes)
        built = set().union(*plan._covers) if plan._covers else set()
        top = sorted(counts.values(), reverse=True)[:cap]
        warmed_counts = sorted((counts[plan._units[i]] for i in built), reverse=True)[:cap]
        assert warmed_counts == top  # the most frequent shapes are among those warmed
        left = plan.skipped()
        assert left["shapes"] == full.shapes - len(built) == left["over_max_shapes"]
        assert left["steps"] == sum(
            1
            for b in batches
            if any(
                counts.get(u) and u not in {plan._units[i] for i in built}
                for u in plan_warmup([b], PATCH)._units
            )
        )


def _distinct_shapes(n):
    """n distinct latent shapes (C, T, H, W) of the tiny model's patch (1, 2, 2)."""
    out = []
    for t in range(1, 1000):
        for h in range(1, 200):
            out.append((16, t, 2 * h, 2))
            if len(out) == n:
                return out
    raise AssertionError


def test_20000_distinct_shapes_each_met_once_warm_nothing():
    """Issue 63: an index of 20,000 distinct shapes took 20,000 warm-up passes (independent) before step 1."""
    shapes = _distinct_shapes(20_000)
    plan = plan_warmup(((s,) for s in shapes), PATCH, max_shapes=64, min_count=2)
    assert plan.steps == plan.shapes == plan.met_once == 20_000 and plan.mostly_once
    assert plan.packs == [] and plan.chosen == 0
    assert plan.skipped() == {
        "shapes": 20_000,
        "once": 20_000,
        "over_max_shapes": 0,
        "over_max_seconds": 0,
        "steps": 20_000,
    }
    # Told to warm shapes met once too, the cap still bounds the passes.
    forced = plan_warmup(((s,) for s in shapes), PATCH, max_shapes=64, min_count=1)
    assert len(forced.packs) == 64 and forced.skipped()["over_max_shapes"] == 20_000 - 64


def test_20000_distinct_shapes_in_packs_are_bounded_by_shapes_and_seconds():
    """The packed case of issue 63 (1,803 passes): the cap bounds the passes, the clock bounds the time."""
    rng = random.Random(0)
    shapes = _distinct_shapes(20_000)
    rng.shuffle(shapes)
    packs = []
    i = 0
    while i < len(shapes):
        n = rng.randint(2, 8)
        packs.append(tuple(shapes[i : i + n]))
        i += n
    plan = plan_warmup(packs, PATCH, max_shapes=64, min_count=1)
    assert plan.shapes > 1000 and len(plan.packs) <= 64
    ran = []
    now = [0.0]

    def warm_one(pack):  # a cheap warm function on a fake clock: 3.4 s a pass (an H200, compiled blocks)
        ran.append(pack)
        now[0] += 3.4

    assert len(plan.packs) > 3
    done = run_budgeted(plan.packs, warm_one, max_seconds=12.0, clock=lambda: now[0])
    assert done == len(ran) == 3 and now[0] <= 12.0  # 3 x 3.4 = 10.2; a 4th would end at 13.6
    left = plan.skipped(done)
    assert left["over_max_seconds"] > 0 and left["shapes"] == plan.shapes - len(
        set().union(*plan._covers[:done])
    )


def test_run_budgeted_always_runs_the_first_pass_and_stops_at_the_mean_rate():
    now = [0.0]
    steps = iter([100.0, 1.0, 1.0])

    def slow_first(_):
        now[0] += next(steps)

    assert run_budgeted([[1], [2], [3]], slow_first, max_seconds=50.0, clock=lambda: now[0]) == 1
    assert run_budgeted([[1]] * 5, lambda _: None, max_seconds=None, clock=lambda: 0.0) == 5
    with pytest.raises(ValueError, match="max_seconds must be a number > 0"):
        run_budgeted([], lambda _: None, max_seconds=0)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"max_shapes": 0}, "max_shapes=0"),
        ({"max_shapes": 2.5}, "max_shapes=2.5"),
        ({"max_seconds": float("inf")}, "max_seconds=inf"),
        ({"max_seconds": -1}, "max_seconds=-1"),
        ({"min_count": 0}, "min_count=0"),
        ({"min_count": True}, "min_count=True"),
    ],
)
def test_a_budget_that_means_nothing_is_refused(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(".", r"\.")):
        KernelWarmup(**kwargs)


class _FakeBlockModel:
    """Just what warm_kernels calls, cheap: counts the passes and moves a fake clock by 3.4 s each."""

    def __init__(self, clock):
        self.config = SimpleNamespace(patch_size=PATCH, text_dim=16)
        self.passes = 0
        self.clock = clock
        self.blocks = [self._block]

    def pack_prologue(self, latents, timestep, context, mask):
        h = torch.zeros(2, requires_grad=True)
        return h, None, (), None, None, None

    def _block(self, h):
        self.passes += 1
        self.clock.now += 3.4
        return h * 2


def _fake_fit_objects(batches):
    """A trainer and a module as the callback sees them, over a plan of ``batches`` (dense or packs)."""
    refs = {}
    streams, buckets, kinds = [], {}, []
    for j, b in enumerate(batches):
        packed = len(set(b)) > 1
        kinds.append(packed)
        row = []
        for s in b:
            refs[len(refs)] = s
            row.append(len(refs) - 1)
        streams.append(row)
        buckets[j] = {"shape": b[0]}
    plan = SimpleNamespace(
        step_order={0: [(0, j) for j in range(len(batches))]},
        streams={(0, 0): streams},
        buckets=buckets,
        batch_buckets={(0, 0): list(range(len(batches)))},
        is_pack=lambda stream, j: kinds[j],
    )
    ds = SimpleNamespace(plan=plan, rank=0, index=SimpleNamespace(latent_shape=refs.__getitem__))
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(train_dataset=ds),
        precision_plugin=SimpleNamespace(train_step_context=contextlib.nullcontext),
        global_rank=0,
        current_epoch=0,
    )
    return trainer


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("packed", [False, True])
def test_the_callback_on_20000_distinct_shapes_is_bounded(packed, caplog):
    caplog.set_level("INFO")
    shapes = _distinct_shapes(20_000)
    if packed:
        batches = [tuple(shapes[i : i + 4]) for i in range(0, len(shapes), 4)]
    else:
        batches = [(s,) for s in shapes]
    for kwargs, most in (({}, 64), ({"max_shapes": 20_000, "min_count": 1, "max_seconds": 60.0}, 18)):
        clock = _Clock()
        model = _FakeBlockModel(clock)
        warm = KernelWarmup(**kwargs)
        warm._clock = clock
        module = SimpleNamespace(model=model, device=torch.device("cpu"))
        trainer = _fake_fit_objects(batches)
        warm.on_train_epoch_start(trainer, module)
        warm.on_train_batch_start(trainer, module, {}, 0)
        (entry,) = warm.history
        assert model.passes == entry["packs"] <= most  # never 20,000 passes
        assert entry["batches"] == len(batches) and entry["shapes"] >= (20_000 if not packed else 5000)
        assert entry["skipped_shapes"] > 0 and entry["skipped_steps"] > 0
        assert clock.now <= warm.max_seconds  # within its budget, on its clock
        if not packed and not kwargs:
            assert model.passes == 0 and "Nearly every shape is met once (20000 of 20000)" in caplog.text
            assert "nothing is warmed" in caplog.text
        if kwargs:
            assert entry["skipped"]["over_max_seconds"] > 0
            assert "stops it after about" in caplog.text  # the estimate after the first three passes
