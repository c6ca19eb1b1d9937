"""``benchmarks/model/bench_step_mix.py --schedule packed``: the packed epoch it times (planning only, no timing)."""

import collections

import pytest
from _paths import ROOT

BENCH = str(ROOT / "benchmarks" / "model")


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)
    import bench_step_mix

    return bench_step_mix


def test_the_packed_epoch_holds_rank_0s_samples_in_packs_under_the_token_cap(bench):
    max_tokens = 900
    packs = bench.epoch_packs("tiny", max_tokens, world=2, samples=300)
    assert packs, "rank 0 has steps"
    tokens = [[s[1] * (s[2] // 2) * (s[3] // 2) for s in p] for p in packs]
    assert all(sum(t) <= max_tokens for t in tokens)
    assert any(len(set(t)) > 1 for t in tokens), "a packed epoch of the tiny mix has mixed packs"
    # Two ranks share 300 samples: rank 0 holds about half of them, each once.
    assert 100 <= sum(len(p) for p in packs) <= 200


def test_pick_packs_takes_the_most_frequent_first(bench):
    a, b, c = ((16, 1, 8, 8),), ((16, 1, 8, 8), (16, 3, 8, 8)), ((16, 5, 8, 8),)
    packs = [b, a, c, a, c, a]
    assert bench.pick_packs(packs, 2) == [a, c]
    assert bench.pick_packs(packs, 9) == [a, c, b]
    assert collections.Counter(packs)[a] == 3


def test_a_whole_model_compile_is_refused_for_packs(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--schedule", "packed", "--variants", "whole", "--device", "cpu", "--preset", "tiny"])
    assert "cannot run packs" in capsys.readouterr().err
