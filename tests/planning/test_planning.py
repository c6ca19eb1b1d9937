import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.inputs import index_fingerprint
from lightning_adaptiveload.planning.plan import PlanError
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.resume import consumed_refs, continue_plan
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.planning.sizing import tokens_per_sample

SHAPES = [(4, t, h, w) for t in (1, 3, 5, 9) for h, w in ((4, 6), (6, 4), (4, 4))]


def random_index(rng: random.Random, n_shards: int, max_size: int) -> list[list[tuple]]:
    weights = [8, 8, 4, 2, 2, 1, 2, 2, 1, 6, 6, 3]
    return [rng.choices(SHAPES, weights, k=rng.randint(1, max_size)) for _ in range(n_shards)]


def all_refs(index):
    return sorted((s, i) for s, shard in enumerate(index) for i in range(len(shard)))


def check_plan(plan, index, batcher, exclude=()):
    """The invariants every plan must satisfy."""
    refs = sorted(ref for batches in plan.streams.values() for batch in batches for ref in batch)
    assert refs == sorted(set(all_refs(index)) - set(exclude)), "every sample exactly once across all streams"
    assert all(len(order) == plan.steps for order in plan.step_order), "equal step counts"
    empty = 0
    for st_, batches in plan.streams.items():
        read = sorted((s, i) for s, ids in plan.reads[st_] for i in ids)
        assert read == sorted(ref for b in batches for ref in b), "a stream reads exactly its samples"
        for j, batch in enumerate(batches):
            if not batch:  # a zero-weight step (counted)
                empty += 1
                continue
            if plan.is_pack(st_, j):  # lockstep's packed tail: samples of any shapes within max_tokens
                toks = [tokens_per_sample(index[s][i], batcher.patch_size) for s, i in batch]
                assert sum(toks) <= batcher.max_tokens, "a pack holds at most max_tokens"
                assert plan.buckets[plan.batch_buckets[st_][j]]["seq_len"] == max(toks)
                continue
            shapes = {index[s][i] for s, i in batch}
            assert len(shapes) == 1, "one latent shape per batch"
            assert plan.buckets[plan.batch_buckets[st_][j]]["shape"] == shapes.pop()
            assert batcher.satisfies(len(batch), plan.buckets[plan.batch_buckets[st_][j]]["seq_len"])
    unequal = pack_steps = 0
    for k in range(plan.steps):
        sig = set()
        total = 0
        packs = {
            plan.is_pack((r, plan.step_order[r][k][0]), plan.step_order[r][k][1])
            for r in range(plan.world_size)
        }
        assert len(packs) == 1, "at every step either every rank takes a pack or none does"
        for r in range(plan.world_size):
            b, batch = plan.step_batch(r, k)
            if packs == {True}:
                total += sum(tokens_per_sample(index[s][i], batcher.patch_size) for s, i in batch)
                continue
            sig.add((plan.buckets[b]["lockstep_class"], len(batch)))
            total += len(batch) * plan.buckets[b]["seq_len"]
        assert plan.global_tokens[k] == total
        unequal += len(sig) > 1
        pack_steps += packs == {True}
    if plan.schedule == "lockstep":
        assert pack_steps == plan.report["packed_tail_steps"]
        if plan.report["lockstep_tail"] == "packed":
            assert unequal == 0, "the packed tail leaves no unequal step"
    assert unequal == plan.report["unequal_steps"]
    if plan.schedule == "lockstep":
        assert plan.report["lockstep_tail_steps"] == unequal
    assert plan.report["samples"] == len(refs) and plan.report["padding_tokens"] == 0
    assert empty == plan.report["empty_batches"]
    if len(refs) >= plan.world_size:
        assert min(plan.report["samples_per_rank"]) >= 1, "every rank gets a sample when it can"


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10_000),
    n_shards=st.integers(1, 16),
    world=st.integers(1, 16),
    workers=st.integers(0, 4),
    schedule=st.sampled_from(["independent", "lockstep"]),
    sizing=st.sampled_from(["dual", "equal_tokens"]),
    resumed=st.booleans(),
    tail=st.sampled_from(["packed", "bucketed"]),
)
def test_property_exactly_once_equal_steps_constraints(
    seed, n_shards, world, workers, schedule, sizing, resumed, tail
):
    """Every epoch in which every rank can get a sample is planned (issue 13: no PlanError), any schedule,
    any worker count, fresh or after a resume (``exclude``)."""
    rng = random.Random(seed)
    index = random_index(rng, n_shards, 40)
    batcher = DualConstraintBatcher(
        rng.choice([96, 200, 400]),
        sizing=sizing,
        cost_model=CostModel(kind="power", p=rng.choice([1.0, 1.5, 2.0])),
    )
    refs = all_refs(index)
    exclude = set(rng.sample(refs, rng.randint(0, len(refs) - 1))) if resumed else set()
    if len(refs) - len(exclude) < world:
        exclude = set(list(exclude)[: len(refs) - world])
    if len(refs) < world:
        return
    epoch = rng.randint(0, 3)
    plan = plan_epoch(
        index,
        world,
        workers,
        batcher,
        seed=seed,
        epoch=epoch,
        exclude=exclude,
        settings=PlanSettings(schedule=schedule, lockstep_tail=tail),
    )
    check_plan(plan, index, batcher, exclude)
    # resume with another worker count: the rest of the epoch, batch for batch, equal steps
    done = rng.randint(0, plan.steps)
    rest = continue_plan(plan, done, rng.randint(0, 4))
    left = sorted(ref for batches in rest.streams.values() for batch in batches for ref in batch)
    assert left == sorted(set(all_refs(index)) - exclude - consumed_refs(plan, done))
    assert all(len(order) == rest.steps == plan.steps - done for order in rest.step_order)
    for r in range(world):  # the same batches at the same steps, packs still packs
        for k in range(rest.steps):
            (w, j), (w0, j0) = rest.step_order[r][k], plan.step_order[r][done + k]
            assert rest.step_batch(r, k) == plan.step_batch(r, done + k)
            assert rest.is_pack((r, w), j) == plan.is_pack((r, w0), j0)
    for st_, batches in rest.streams.items():
        read = sorted((s, i) for s, ids in rest.reads[st_] for i in ids)
        assert read == sorted(ref for b in batches for ref in b), "a resumed stream reads exactly its samples"
    if schedule == "independent":  # empty batches only where no common count of non-empty batches exists
        left = [index[s][i] for s, i in refs if (s, i) not in exclude]
        fewest = sum(-(-left.count(sh) // batcher.sizer.size(sh).batch_size) for sh in set(left))
        if -(-fewest // world) <= len(left) // world:
            assert plan.report["empty_batches"] == 0


def test_lockstep_with_balanced_data_has_no_tail_steps():
    rng = random.Random(1)
    composition = rng.choices(SHAPES, k=60)
    index = [rng.sample(composition, len(composition)) for _ in range(12)]  # same multiset per shard
    batcher = DualConstraintBatcher(400)
    for world, workers in ((2, 0), (3, 2), (4, 3)):
        plan = plan_epoch(
            index, world, workers, batcher, seed=0, epoch=0, settings=PlanSettings(schedule="lockstep")
        )
        check_plan(plan, index, batcher)
        assert plan.report["lockstep_tail_steps"] == 0
        assert plan.report["est_compute_cv"] < 0.05


def test_lockstep_balances_unbalanced_shards_by_moving_samples():
    # rank-worth of images vs rank-worth of long clips: independent mode is unequal at almost every step
    index = [[SHAPES[0]] * 40, [SHAPES[9]] * 40, [SHAPES[9]] * 40]  # one rank gets the images
    batcher = DualConstraintBatcher(400)
    lock = plan_epoch(index, 2, 0, batcher, seed=0, epoch=0, settings=PlanSettings(schedule="lockstep"))
    check_plan(lock, index, batcher)
    assert lock.report["moved_samples"] > 0
    assert lock.report["lockstep_tail_steps"] <= 2
    indep = plan_epoch(index, 2, 0, batcher, seed=3, epoch=0, settings=PlanSettings(schedule="independent"))
    check_plan(indep, index, batcher)
    assert indep.report["est_wait_share"] >= lock.report["est_wait_share"]


def test_plan_is_deterministic_and_epochs_differ():
    rng = random.Random(2)
    index = random_index(rng, 12, 30)
    batcher = DualConstraintBatcher(300)
    a = plan_epoch(index, 3, 2, batcher, seed=5, epoch=1, settings=PlanSettings(schedule="lockstep"))
    b = plan_epoch(index, 3, 2, batcher, seed=5, epoch=1, settings=PlanSettings(schedule="lockstep"))
    assert a.streams == b.streams and a.global_tokens == b.global_tokens
    c = plan_epoch(index, 3, 2, batcher, seed=5, epoch=2, settings=PlanSettings(schedule="lockstep"))
    assert c.streams != a.streams
    assert index_fingerprint(index) == index_fingerprint([list(s) for s in index])
    assert index_fingerprint(index) != index_fingerprint(index[:-1])


class _Replay(IterableDataset):
    """Yields (worker, j) for the planned batch lengths of one rank: checks torch's worker order."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __iter__(self):
        w = get_worker_info().id
        for j in range(self.lengths[w]):
            yield torch.tensor([w, j])


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_step_order_is_torch_dataloader_round_robin():
    lengths = [5, 1, 3]  # uneven workers: the short one is skipped once exhausted
    loader = DataLoader(_Replay(lengths), batch_size=None, num_workers=3)
    seen = [tuple(x.tolist()) for x in loader]
    index = [[SHAPES[0]] * 3, [SHAPES[9]] * 4, [SHAPES[3]] * 5]
    plan = plan_epoch(index, 1, 3, DualConstraintBatcher(400), seed=0, epoch=0)
    expected_shape = [(w, j) for j in range(max(lengths)) for w in range(3) if j < lengths[w]]
    assert seen == expected_shape
    from lightning_adaptiveload.planning.bucketed import _round_robin

    assert _round_robin(lengths) == seen
    assert plan.step_order[0] == _round_robin([len(plan.streams[(0, w)]) for w in range(3)])


def test_consumed_refs_and_exclude_plan_the_rest():
    rng = random.Random(3)
    index = random_index(rng, 10, 30)
    batcher = DualConstraintBatcher(300)
    plan = plan_epoch(index, 2, 2, batcher, seed=1, epoch=0)
    gone = consumed_refs(plan, 4)
    assert len(gone) == sum(len(b) for r in range(2) for b in plan.rank_batches(r)[:4])
    rest = plan_epoch(index, 3, 1, batcher, seed=1, epoch=0, exclude=gone)
    assert rest.report["excluded"] == len(gone)
    left = sorted(ref for bs in rest.streams.values() for b in bs for ref in b)
    assert sorted(left + sorted(gone)) == all_refs(index)
    with pytest.raises(ValueError, match="world size"):
        consumed_refs(plan, [1, 2, 3])
    with pytest.raises(ValueError, match="consumed"):
        consumed_refs(plan, plan.steps + 1)


def test_continue_plan_keeps_the_uninterrupted_order():
    rng = random.Random(4)
    index = random_index(rng, 10, 30)
    batcher = DualConstraintBatcher(300)
    for schedule in ("independent", "lockstep"):
        plan = plan_epoch(index, 2, 2, batcher, seed=1, epoch=0, settings=PlanSettings(schedule=schedule))
        for workers in (0, 1, 3):
            cont = continue_plan(plan, 5, workers)
            assert cont.steps == plan.steps - 5 and cont.global_tokens == plan.global_tokens[5:]
            for r in range(2):
                assert cont.rank_batches(r) == plan.rank_batches(r)[5:]
                for st_ in [(r, w) for w in range(max(1, workers))]:
                    read = sorted((s, i) for s, ids in cont.reads[st_] for i in ids)
                    assert read == sorted(ref for b in cont.streams[st_] for ref in b)
    with pytest.raises(ValueError):
        continue_plan(plan, plan.steps + 1, 1)


def test_oversize_and_channel_errors_name_the_shard_and_key():
    class Shard:
        def __init__(self, path, keys, shapes):
            self.path, self.keys, self.latent_shapes = path, keys, shapes

    class Index:
        shards = [Shard("/data/a.tar", ["x", "big"], [(4, 1, 4, 4), (4, 99, 40, 40)])]

    with pytest.raises(ValueError, match=r"/data/a\.tar, key 'big'.*max_tokens"):
        plan_epoch(Index(), 1, 0, DualConstraintBatcher(300), seed=0, epoch=0)
    plan = plan_epoch(Index(), 1, 0, DualConstraintBatcher(300, oversize="skip"), seed=0, epoch=0)
    assert plan.report["skipped"] == {"oversize": 1} and plan.report["samples"] == 1

    Index.shards = [Shard("/data/b.tar", ["p", "q"], [(4, 1, 4, 4), (8, 1, 4, 4)])]
    with pytest.raises(ValueError, match=r"/data/b\.tar, key 'q'.*one VAE"):
        plan_epoch(Index(), 1, 0, DualConstraintBatcher(300), seed=0, epoch=0)


def test_infeasible_world_size_raises_clear_error():
    index = [[SHAPES[9]] * 2]
    with pytest.raises(PlanError, match=r"world size 4: .*2 samples in 1 shards"):
        plan_epoch(index, 4, 0, DualConstraintBatcher(300), seed=0, epoch=0)


def test_settings_validation():
    index = [[SHAPES[0]] * 10]
    with pytest.raises(ValueError, match="max_buffered_samples=2"):
        plan_epoch(
            index,
            1,
            0,
            DualConstraintBatcher(300),
            seed=0,
            epoch=0,
            settings=PlanSettings(max_buffered_samples=2),
        )
    with pytest.raises(ValueError, match="partial='emit'"):
        plan_epoch(index, 1, 0, DualConstraintBatcher(300, partial="carry"), seed=0, epoch=0)
    with pytest.raises(ValueError, match="schedule"):
        plan_epoch(
            index, 1, 0, DualConstraintBatcher(300), seed=0, epoch=0, settings=PlanSettings(schedule="fast")
        )
    with pytest.raises(TypeError, match="ShardIndex"):
        plan_epoch(5, 1, 0, DualConstraintBatcher(300), seed=0, epoch=0)


def test_buffer_bound_forces_early_partial_batches_in_independent_mode():
    index = [[SHAPES[i % 3] for i in range(150)]]  # three image buckets, B = 50, 50, 75 at 300 tokens
    batcher = DualConstraintBatcher(300, sizing="equal_tokens")
    plan = plan_epoch(index, 1, 0, batcher, seed=0, epoch=0, settings=PlanSettings(max_buffered_samples=75))
    check_plan(plan, index, batcher)
    assert plan.report["bound_partial_batches"] >= 1
    assert max(len(b) for b in plan.streams[(0, 0)]) <= 75


def test_wan21_mix_1024_samples_on_64_ranks_is_planned():
    """Issue 13: "common count is 15 but rank 13 has only 14 samples" on an easy epoch."""
    from lightning_adaptiveload.shards.mixes import load_mix
    from lightning_adaptiveload.tools.replay import mix_population as _mix_population

    index = _mix_population(load_mix("wan21_480p"), 1024, 64, seed=0)
    shapes = [s.latent_shapes for s in index.shards]
    for schedule in ("independent", "lockstep"):
        batcher = DualConstraintBatcher(32760, sizing="equal_tokens")
        plan = plan_epoch(index, 64, 0, batcher, seed=0, epoch=0, settings=PlanSettings(schedule=schedule))
        check_plan(plan, shapes, batcher)
        assert plan.report["empty_batches"] == 0


def test_equal_counts_packs_partial_batches_instead_of_splitting_to_the_largest_count():
    from lightning_adaptiveload.planning.equalise import _equal_counts
    from lightning_adaptiveload.planning.plan import Batch

    sizes = [16]  # one bucket, B = 16
    refs = [(0, i) for i in range(20)]
    sim = {
        (0, 0): [Batch(0, refs[3 * j : 3 * j + 3]) for j in range(6)],  # six partial batches of 3
        (1, 0): [Batch(0, refs[18:20])],  # one batch of 2
    }
    counts = dict.fromkeys(("split_batches", "merged_batches", "empty_batches", "moved_batches"), 0)
    moves = []
    assert _equal_counts(sim, [[(0, 0)], [(1, 0)]], sizes, counts, moves, pad_bucket=None) is None
    # The largest count (6) would cut rank 1's 2 samples into 6 batches: impossible without moving 4
    # samples. A count between the fewest and most reachable (here 2) packs rank 0's batches instead.
    assert [len(sim[(r, 0)]) for r in (0, 1)] == [2, 2]
    assert counts["merged_batches"] == 4 and counts["empty_batches"] == 0
    assert all(len(bt.refs) <= 16 for st in sim for bt in sim[st])
    assert sorted(ref for st in sim for bt in sim[st] for ref in bt.refs) == refs
    # Batches emitted early at the buffer bound are never packed with later ones (that would hold their
    # samples past the bound): the same streams then reach a common count without packing them.
    sim = {
        (0, 0): [Batch(0, refs[3 * j : 3 * j + 3], bound=True) for j in range(6)],
        (1, 0): [Batch(0, refs[18:20])],
    }
    counts = dict.fromkeys(counts, 0)
    assert _equal_counts(sim, [[(0, 0)], [(1, 0)]], sizes, counts, [], pad_bucket=None) is None
    assert counts["merged_batches"] == 0 and len(sim[(0, 0)]) == len(sim[(1, 0)])
    assert all(bt.bound for bt in sim[(0, 0)][:5]), "bound batches stay as they were"


def test_fewer_samples_than_ranks_pads_with_empty_batches_or_raises():
    index = [[SHAPES[9]] * 2]
    batcher = DualConstraintBatcher(300)
    with pytest.raises(
        PlanError, match=r"world size 4: 2 samples in 1 shards leave 2 rank\(s\).*underfull='pad'"
    ):
        plan_epoch(index, 4, 0, batcher, seed=0, epoch=0)
    for schedule in ("independent", "lockstep"):
        plan = plan_epoch(
            index, 4, 2, batcher, seed=0, epoch=0, settings=PlanSettings(schedule=schedule, underfull="pad")
        )
        check_plan(plan, index, batcher)
        assert plan.steps == 1 and plan.report["empty_batches"] == 2
        assert sorted(plan.report["samples_per_rank"]) == [0, 0, 1, 1]
        assert plan.global_tokens == [2 * 9 * 2 * 3]  # two samples of 9 x 2 x 3 tokens
    with pytest.raises(ValueError, match="underfull"):
        plan_epoch(index, 4, 0, batcher, seed=0, epoch=0, settings=PlanSettings(underfull="skip"))
