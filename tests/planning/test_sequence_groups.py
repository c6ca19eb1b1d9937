"""Planning for sequence-parallel groups (planning/groups.py): placement, budgets, the all-to-all's price,
and that a plan of 4 GPUs in groups of 2 is a plan of 2 ranks; the DataModule gives a group's GPUs the same
batches."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel, SequenceComm
from lightning_adaptiveload.planning.groups import data_placement, group_batching, sequence_rank
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import Batching, PlanSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _plan_cases import FIELDS, digest_plan, make_index  # noqa: E402


def test_ranks_form_groups_data_outer_sequence_inner():
    assert [data_placement(r, 4, 2) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert [sequence_rank(r, 2) for r in range(4)] == [0, 1, 0, 1]
    assert [data_placement(r, 8, 4)[0] for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [data_placement(r, 3, 1) for r in range(3)] == [(0, 3), (1, 3), (2, 3)]


def test_a_world_that_is_no_multiple_of_the_degree_is_refused():
    with pytest.raises(ValueError, match=r"sequence_parallel=4 needs a world size that is a multiple.*got 6"):
        data_placement(0, 6, 4)
    for bad in (0, -2, 1.5, "2", True):
        with pytest.raises(ValueError, match="sequence_parallel"):
            PlanSettings(sequence_parallel=bad)
    with pytest.raises(ValueError, match="unknown keys"):
        PlanSettings(sequence_parallel=2, sequence_comm={"width": 1})
    assert PlanSettings(sequence_parallel=2).sequence_parallel == 2


def test_the_cost_of_a_split_sample_is_its_share_plus_the_all_to_all():
    base = CostModel(kind="quadratic", alpha=3e-5, beta=2e-9, gamma=1e-3, c0=0.05)
    comm = SequenceComm(hidden=1024, layers=10, dtype_bytes=2, link_gb_per_s=100.0, passes=3)
    assert base.sequence_parallel(1, comm) is base
    for g in (2, 4, 8):
        kappa = 4 * 10 * 3 * 1024 * 2 * (g - 1) / g**2 / 100e9
        assert math.isclose(comm.seconds_per_token(g), kappa, rel_tol=1e-12)
        sp = base.sequence_parallel(g, comm)
        for s in (100, 3600, 75600):
            assert math.isclose(sp.cost(s), base.cost(s) / g + kappa * s, rel_tol=1e-12)
        assert sp.c0 == base.c0  # every GPU of the group runs the step
    assert comm.seconds_per_token(1) == 0.0
    with pytest.raises(ValueError, match="quadratic"):
        CostModel(kind="power", p=1.5).sequence_parallel(2)
    with pytest.raises(ValueError, match="link_gb_per_s"):
        SequenceComm(link_gb_per_s=0)


def test_a_groups_batching_takes_g_times_the_tokens_at_one_gpus_cost():
    b = Batching(
        max_tokens=450, max_compute=2.0, cost_model={"kind": "quadratic", "alpha": 1e-3, "beta": 1e-6}
    )
    assert group_batching(b, 1) is b
    g2 = group_batching(b, 2, {"hidden": 64, "layers": 2})
    assert g2.max_tokens == 900 and g2.max_compute == 2.0  # a cap per GPU stays one
    sp = CostModel.from_dict(b.cost_model).sequence_parallel(2, SequenceComm(hidden=64, layers=2))
    assert g2.cost_model == sp.to_dict()
    # No cost model given: the default one, split.
    assert (
        group_batching(Batching(max_tokens=450), 2).cost_model
        == CostModel.default().sequence_parallel(2).to_dict()
    )


@pytest.mark.parametrize("schedule", ["independent", "lockstep", "packed"])
def test_four_gpus_in_groups_of_two_plan_as_two_ranks(schedule):
    index = make_index("tiny", 600, 3)
    per_gpu = Batching(max_tokens=450, max_compute="auto")
    settings = PlanSettings(schedule=schedule, sequence_parallel=2)
    grouped = group_batching(per_gpu, settings.sequence_parallel, settings.sequence_comm)
    _, groups = data_placement(3, 4, settings.sequence_parallel)
    plan = plan_epoch(index, groups, 1, DualConstraintBatcher.from_settings(grouped), 0, 1, settings)
    # The plain 2-rank plan with the group's budget and cost: the same plan, field by field.
    plain_batching = Batching(max_tokens=900, max_compute="auto", cost_model=grouped.cost_model)
    plain = plan_epoch(
        index,
        2,
        1,
        DualConstraintBatcher.from_settings(plain_batching),
        0,
        1,
        PlanSettings(schedule=schedule),
    )
    assert plan.world_size == 2 and digest_plan(plan) == digest_plan(plain), FIELDS
    # Exactly once across the groups, and equal steps.
    refs = [ref for (r, w), batches in plan.streams.items() for batch in batches for ref in batch]
    assert sorted(refs) == sorted((s, i) for s, shard in enumerate(index) for i in range(len(shard)))
    assert len({len(order) for order in plan.step_order}) == 1


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from lightning_adaptiveload.shards.synthetic import SyntheticShards, write_synthetic_shards

    d = str(tmp_path_factory.mktemp("sp-groups"))
    write_synthetic_shards(
        d, SyntheticShards(mix="tiny", num_samples=40, samples_per_shard=10, seed=5), progress=False
    )
    return d


def _batches(shards: str, rank: int, world: int, schedule: str, workers: int = 0) -> list[dict]:
    from lightning_adaptiveload import AdaptiveLoadDataModule
    from lightning_adaptiveload.loading.settings import Loader

    dm = AdaptiveLoadDataModule(
        shards,
        batching=Batching(max_tokens=300),
        plan=PlanSettings(schedule=schedule, sequence_parallel=2, chunk_samples=None),
        loader=Loader(num_workers=workers),
    )
    dm.trainer = SimpleNamespace(current_epoch=0, lightning_module=None, global_rank=rank, world_size=world)
    dm.setup("fit")
    assert (dm.train_dataset.rank, dm.train_dataset.world_size) == (rank // 2, world // 2)
    return list(dm.train_dataloader())


@pytest.mark.parametrize(("schedule", "workers"), [("independent", 0), ("lockstep", 0), ("lockstep", 1)])
def test_the_gpus_of_a_group_get_the_same_batches(shards, schedule, workers):
    import torch

    per_rank = [_batches(shards, r, 4, schedule, workers) for r in range(4)]
    for a, b in ((0, 1), (2, 3)):
        assert len(per_rank[a]) == len(per_rank[b]) > 0
        for x, y in zip(per_rank[a], per_rank[b]):
            assert x["keys"] == y["keys"] and x["global_tokens"] == y["global_tokens"]
            assert torch.equal(x["latents"], y["latents"])
    # Across the groups: every sample once, and batches beyond one GPU's 300 tokens.
    keys = [k for r in (0, 2) for batch in per_rank[r] for k in batch["keys"]]
    assert len(keys) == len(set(keys)) == 40
    assert max(int(batch["num_tokens"]) for batch in per_rank[0]) > 300


def test_the_datamodule_refuses_a_world_that_is_no_multiple_of_the_degree(shards):
    with pytest.raises(ValueError, match="multiple of it"):
        _batches(shards, 0, 3, "independent")


def test_the_datamodule_refuses_a_strategy_of_another_degree(shards):
    from lightning_adaptiveload import AdaptiveLoadDataModule

    dm = AdaptiveLoadDataModule(shards, plan=PlanSettings(sequence_parallel=2))
    dm.trainer = SimpleNamespace(
        current_epoch=0,
        lightning_module=None,
        global_rank=0,
        world_size=4,
        strategy=SimpleNamespace(sequence_parallel=4),
    )
    with pytest.raises(ValueError, match="splits sequences over 4 GPUs"):
        dm.setup("fit")


def test_the_simulator_compares_degrees_and_names_the_fastest(tmp_path):
    from lightning_adaptiveload.cli.simulate import main
    from lightning_adaptiveload.tools.simulate_sequence import model_comm, model_cost, simulate_degrees

    res = simulate_degrees(
        "tiny",
        gpu_counts=[4, 8],
        degrees=[1, 2, 4],
        max_tokens=240,
        variants=["lockstep"],
        min_steps_per_rank=6,
    )
    assert {(r["gpus"], r["degree"], r["groups"]) for r in res.rows} == {
        (4, 1, 4),
        (4, 2, 2),
        (8, 1, 8),
        (8, 2, 4),
        (8, 4, 2),
    }
    assert [(s["gpus"], s["degree"]) for s in res.skipped] == [(4, 4)]  # a single group balances nothing
    assert all(r["simulated"] and r["comm_share"] == 0.0 for r in res.rows if r["degree"] == 1)
    assert all(r["comm_share"] > 0 for r in res.rows if r["degree"] > 1)
    best8 = res.best(8)
    assert best8["tokens_per_s"] == max(r["tokens_per_s"] for r in res.rows if r["gpus"] == 8)
    assert any("8 GPUs: degree" in v and "(simulated)" in v for v in res.verdicts())
    # A bucket over one GPU's budget: degree 1 cannot run it, and says so.
    res = simulate_degrees(
        "tiny", gpu_counts=[4], degrees=[1, 2], max_tokens=120, variants=["lockstep"], min_steps_per_rank=6
    )
    assert [r["degree"] for r in res.rows] == [2] and "max_tokens=120" in res.skipped[0]["why"]
    # The presets: 14B costs more per token and moves wider activations than 1.3B.
    assert model_cost("wan-1.3b") == CostModel.default()
    assert model_cost("wan-14b").alpha > 5 * model_cost("wan-1.3b").alpha
    assert model_comm("wan-14b").seconds_per_token(2) > model_comm("wan-1.3b").seconds_per_token(2)
    out = tmp_path / "sim"
    code = main(
        [
            "--mix",
            "tiny",
            "--sequence_parallel",
            "1,2",
            "--world-sizes",
            "4",
            "--max-tokens",
            "240",
            "--min-steps-per-rank",
            "6",
            "--schedules",
            "lockstep",
            "--modes",
            "dual",
            "--out",
            str(out),
        ]
    )
    assert code == 0 and (out / "simulate_sequence.json").exists()


def test_packs_under_sequence_parallelism_are_refused_or_become_a_bucketed_tail(shards, caplog):
    """An explicit schedule 'packed' is refused at setup (and by the CLI's check_module), naming the setting;
    lockstep's default packed tail becomes bucketed, said in one line; without SP the tail stays packed."""
    import logging

    from lightning_adaptiveload import AdaptiveLoadDataModule
    from lightning_adaptiveload.models.module import VideoDiTModule

    module = VideoDiTModule(preset="tiny")
    assert module.runs_packed_batches  # it runs packs without SP: the refusal is the degree's
    packed = AdaptiveLoadDataModule(shards, plan=PlanSettings(schedule="packed", sequence_parallel=2))
    for who in (module, None):
        with pytest.raises(ValueError, match=r"plan.sequence_parallel=2 .*data.init_args.plan.schedule"):
            packed.check_module(who)
    packed.trainer = SimpleNamespace(current_epoch=0, lightning_module=module, global_rank=0, world_size=4)
    with pytest.raises(ValueError, match="a pack cannot be split"):
        packed.setup("fit")
    # Degree 1: the module runs packs, nothing refused.
    AdaptiveLoadDataModule(shards, plan=PlanSettings(schedule="packed")).check_module(module)

    def tail(degree: int) -> str:
        dm = AdaptiveLoadDataModule(shards, plan=PlanSettings(schedule="lockstep", sequence_parallel=degree))
        dm.trainer = SimpleNamespace(current_epoch=0, lightning_module=module, global_rank=0, world_size=2)
        return dm._train_lockstep_tail()

    with caplog.at_level(logging.INFO):
        assert tail(2) == "bucketed"
    said = [r.getMessage() for r in caplog.records if "lockstep_tail='packed'" in r.getMessage()]
    assert len(said) == 1 and "plan.sequence_parallel=2" in said[0] and "'bucketed'" in said[0]
    assert tail(1) == "packed"


def test_the_14b_sp_recipe_prices_the_all_to_all_at_14b_sizes():
    """recipes/wan14b_720p_sp.yaml (and the package's copy): plan.sequence_comm is wan-14b's width and depth,
    the plan parses, and the batching the DataModule plans with carries that all-to-all."""
    import yaml

    from lightning_adaptiveload import AdaptiveLoadDataModule
    from lightning_adaptiveload.tools.simulate_sequence import model_comm

    root = Path(__file__).resolve().parents[2]
    wan14b = model_comm("wan-14b")
    for folder in (root / "recipes", root / "lightning_adaptiveload" / "recipes"):
        path = folder / "wan14b_720p_sp.yaml"
        data = yaml.safe_load(path.read_text())["data"]["init_args"]
        plan = PlanSettings(**data["plan"])
        comm = SequenceComm.of(plan.sequence_comm)
        assert (comm.hidden, comm.layers) == (5120, 40) == (wan14b.hidden, wan14b.layers)
        assert plan.lockstep_tail == "bucketed" and plan.sequence_parallel == 4
        per_gpu = Batching(**data["batching"])
        dm = AdaptiveLoadDataModule(data["train_shards"], batching=per_gpu, plan=plan)  # reads nothing yet
        assert dm.batcher.max_tokens == 4 * per_gpu.max_tokens
        assert dm.batcher.cost_model == CostModel.default().sequence_parallel(4, comm)
        # The check can fail: the 1.3B defaults price a smaller exchange.
        assert dm.batcher.cost_model != CostModel.default().sequence_parallel(4)
