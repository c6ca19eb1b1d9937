"""Kill and resume in the middle of an epoch read from a real server: every sample exactly once.

The DataModule reads its index and shards from nginx (``train_shards`` is the index's URL); each rank
(one after another in this process, placed by patching ``_dist.rank_and_world``) takes part of the epoch,
then every rank is dropped without a word, as a kill leaves it, and the server is restarted. New DataModules
load the data position the ranks saved (what a checkpoint holds) and read the rest of the epoch from the
server, on the same or another world size. At the server, the epoch's bytes stay within the dataset's and
what the killed readers had fetched ahead.
"""

from __future__ import annotations

import collections
import copy

import pytest
from servers import dataset_bytes, span_bytes, total

from lightning_adaptiveload import _dist
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.resume import digest_text
from lightning_adaptiveload.loading.settings import Loader, Source
from lightning_adaptiveload.planning.settings import Batching, PlanSettings
from lightning_adaptiveload.shards.index import ShardIndex
from lightning_adaptiveload.shards.objstore import RemoteSettings

pytestmark = pytest.mark.timeout(300)

REMOTE = RemoteSettings(backoff_s=0.02, backoff_max_s=0.2, retry_wait_s=20.0, read_ahead_batches=2)


def _dm(url: str, mp, rank: int, world: int, workers: int, schedule: str) -> AdaptiveLoadDataModule:
    mp.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, world))
    dm = AdaptiveLoadDataModule(
        train_shards=f"{url}/data/index.json",
        batching=Batching(max_tokens=512),
        plan=PlanSettings(schedule=schedule),
        loader=Loader(num_workers=workers, seed=5),
        source=Source(remote=REMOTE),
    )
    dm.setup("fit")
    return dm


def _take(dm, n: int | None, mp, rank: int, world: int) -> list[list[str]]:
    mp.setattr(_dist, "rank_and_world", lambda trainer=None: (rank, world))
    out: list[list[str]] = []
    if n == 0:
        return out
    for batch in dm.train_dataloader():
        out.append(batch["keys"])
        if n is not None and len(out) == n:
            break
    return out


def _gathered(dms, mp) -> dict:
    """The state the ranks' ``state_dict`` would give after its collective: each rank's count and part."""
    states = []
    for r, dm in enumerate(dms):
        mp.setattr(_dist, "rank_and_world", lambda trainer=None, r=r: (r, len(dms)))
        states.append(dm.state_dict())
    state = copy.deepcopy(states[0])
    seg = state["segments"][-1]
    seg["consumed"] = [s["segments"][-1]["consumed"][r] for r, s in enumerate(states)]
    seg["digests"] = [s["segments"][-1]["digests"][r] for r, s in enumerate(states)]
    seg["digest"] = None if None in seg["digests"] else digest_text(sum(int(d, 16) for d in seg["digests"]))
    return state


@pytest.mark.parametrize(
    "schedule, world, workers, then_world, then_workers",
    [
        ("lockstep", 2, 0, 2, 0),  # the same ranks: each continues its own plan at its position
        ("independent", 2, 1, 3, 0),  # another world size: the rest re-planned without what was consumed
        ("packed", 3, 0, 2, 1),
    ],
)
def test_kill_and_resume_mid_epoch_reads_every_sample_once(
    own_nginx, remote_data, monkeypatch, schedule, world, workers, then_world, then_workers
):
    url = own_nginx.url
    index = ShardIndex.load(f"{url}/data/index.json")
    keys = [k for s in index.shards for k in s.keys]
    mark = own_nginx.log.mark()
    dms = [_dm(url, monkeypatch, r, world, workers, schedule) for r in range(world)]
    steps = None
    taken: list[list[str]] = []
    for r, dm in enumerate(dms):
        monkeypatch.setattr(_dist, "rank_and_world", lambda trainer=None, r=r: (r, world))
        len(dm.train_dataloader())  # plans this rank's epoch, as Lightning's len() does
        steps = dm.train_dataset.plan.steps
    assert steps is not None and steps >= 4
    for r, dm in enumerate(dms):
        taken += _take(dm, steps // 2, monkeypatch, r, world)
    state = _gathered(dms, monkeypatch)
    del dms  # killed: nothing else of theirs is seen again
    own_nginx.stop()
    own_nginx.start()
    rests = []
    for r in range(then_world):
        dm = _dm(url, monkeypatch, r, then_world, then_workers, schedule)
        dm.load_state_dict(copy.deepcopy(state))
        rests.append(_take(dm, None, monkeypatch, r, then_world))
    assert len({len(x) for x in rests}) == 1, "resumed ranks must have equal step counts"
    seen = collections.Counter(k for b in taken + [b for x in rests for b in x] for k in b)
    assert sorted(seen) == sorted(keys) and max(seen.values()) == 1, (
        f"missing {sorted(set(keys) - set(seen))[:5]}, repeated {[k for k, n in seen.items() if n > 1][:5]}"
    )
    served = total(own_nginx.log.since(mark), path_suffix=".tar")
    assert served["bytes"] >= span_bytes(index)
    # what the killed readers fetched ahead (read_ahead_batches per stream) is all that is fetched twice
    assert served["bytes"] <= 2 * dataset_bytes(remote_data), served
