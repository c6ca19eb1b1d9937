"""The batch sizing rule (planning/sizing.py): torch-free, shared by the batcher and the planner."""

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.sizing import BatchSizer, BucketSize, tokens_per_sample

SHAPES = [(4, t, h, w) for t in (1, 3, 5, 9) for h, w in ((4, 6), (6, 4), (4, 4), (8, 12))]


@settings(max_examples=200, deadline=None)
@given(
    shape=st.sampled_from(SHAPES),
    max_tokens=st.integers(1, 2000),
    p=st.floats(0.5, 2.5),
    cap=st.floats(1.0, 1e5),
    sizing=st.sampled_from(["dual", "equal_tokens"]),
)
def test_batch_size_is_the_largest_that_meets_both_caps(shape, max_tokens, p, cap, sizing):
    model = CostModel(kind="power", p=p)
    sizer = BatchSizer(max_tokens, sizing=sizing, max_compute=cap, cost_model=model)
    s, b = sizer.size(shape)
    assert s == tokens_per_sample(shape)
    if s > max_tokens:
        assert b == 0 and not sizer.satisfies(1, s)
        return
    assert b >= 1 and b * s <= max_tokens
    if sizing == "dual" and b > 1:
        assert b * model.cost(s) <= cap * (1 + 1e-9)
    assert sizer.satisfies(b, s)
    assert not sizer.satisfies(b + 1, s), "one more sample must break a cap"


def test_auto_cap_is_the_cheapest_full_bucket_and_the_batcher_uses_the_same_rule():
    model = CostModel(kind="power", p=1.0)  # cost(S) = S
    shapes = [(4, 1, 8, 12), (4, 2, 10, 10), (4, 9, 40, 40)]  # S = 24, 50, 3600 (over the cap: ignored)
    sizer = BatchSizer(100, max_compute=None, cost_model=model)
    assert sizer.auto_max_compute(shapes) == 96.0  # min(4 * 24, 2 * 50)
    batcher = DualConstraintBatcher(100, cost_model=model.to_dict())
    assert batcher.resolve_max_compute(shapes) == 96.0
    assert batcher.sizer.max_compute == 96.0
    assert batcher.sizer.size((4, 2, 10, 10)) == BucketSize(seq_len=50, batch_size=1)  # 2 * 50 > 96
    with pytest.raises(ValueError, match="no sample within max_tokens=100"):
        sizer.auto_max_compute([(4, 9, 40, 40)])


def test_unresolved_cap_and_oversize():
    sizer = BatchSizer(100)  # dual, cap not fixed yet
    assert sizer.size((4, 9, 40, 40)) == BucketSize(3600, 0)  # oversize needs no cap
    with pytest.raises(ValueError, match="not resolved yet"):
        sizer.size((4, 1, 8, 12))
    message = sizer.oversize_message((4, 9, 40, 40), 3600, where="shard a.tar: ")
    assert message.startswith("shard a.tar: latent shape [4, 9, 40, 40] has 3600 tokens")
    assert "max_tokens=100" in message and "at least 3600" in message
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        BatchSizer(0)
    with pytest.raises(ValueError, match="max_compute must be a positive number"):
        BatchSizer(100, max_compute=-1.0)
    assert BatchSizer(100, sizing="equal_tokens", max_compute=5.0).max_compute is None


def test_sizing_and_planner_import_without_torch():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'lightning'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from lightning_adaptiveload.planning import planner, resume, sizing\n"
        "print(sizing.BatchSizer(4096, sizing='equal_tokens').size((16, 1, 8, 12)).batch_size)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "170"
