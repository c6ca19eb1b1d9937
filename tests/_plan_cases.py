"""A matrix of planning cases and a field-by-field digest of their EpochPlans, to prove that a planner
change leaves every plan unchanged (schedules x world sizes x workers x mixes x seeds/epochs x resume x
lockstep tails).

``tests/planning/test_plan_identity.py`` plans the quick matrix and compares it with ``tests/assets/plan_digests.json``
(digests of the plans of the planner before it was vectorised). The whole matrix (640 plans), against
another checkout of the package (say ``git archive main`` unpacked in /tmp/old)::

    PYTHONPATH=/tmp/old python tests/_plan_cases.py digest old.json
    PYTHONPATH=$PWD python tests/_plan_cases.py digest new.json
    python tests/_plan_cases.py compare old.json new.json

``--large`` instead digests 64 plans of 20,000 samples each.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import sys
from typing import Any

import numpy as np

from lightning_adaptiveload.planning.batching import DualConstraintBatcher
from lightning_adaptiveload.planning.cost_model import CostModel
from lightning_adaptiveload.planning.planner import plan_epoch
from lightning_adaptiveload.planning.settings import PlanSettings
from lightning_adaptiveload.shards.mixes import load_mix

# (max_tokens, max_compute) per mix: the tiny mix's samples are 24 to 225 tokens.
_MIX_TOKENS = {"wan21_480p": 65520, "native_480p": 65520, "tiny": 900}
# Many length classes in three aspects: a mix whose lockstep epochs end in a long tail.
_MANY = [(4, t, h, w) for t in range(1, 17) for h, w in ((4, 6), (6, 4), (4, 4))]

FIELDS = (
    "buckets",
    "streams",
    "batch_buckets",
    "batch_steps",
    "reads",
    "step_order",
    "steps",
    "global_tokens",
    "pack_batches",
    "report",
)


def make_index(mix: str, n: int, seed: int) -> list[list[tuple]]:
    """Shards of 20 to 120 samples drawn from a packaged mix (or ``many``: dozens of length classes)."""
    rng = random.Random(seed)
    if mix == "many":
        flat = [rng.choice(_MANY) for _ in range(n)]
    else:
        m = load_mix(mix)
        shapes = [tuple(bk.latent_shape) for bk in m.buckets]
        flat = [shapes[i] for i in m.sample_buckets(np.random.default_rng(seed), n)]
    index, pos = [], 0
    while pos < len(flat):
        k = rng.randint(20, 120)
        index.append(flat[pos : pos + k])
        pos += k
    return index


def make_batcher(mix: str, schedule: str, variant: int) -> DualConstraintBatcher:
    if mix == "many":
        return DualConstraintBatcher(400, sizing="equal_tokens", cost_model=CostModel(kind="power", p=1.5))
    max_compute = None if schedule == "packed" or variant % 2 else "auto"
    return DualConstraintBatcher(_MIX_TOKENS[mix], max_compute=max_compute, partial="emit")


def cases(quick: bool = False) -> list[dict[str, Any]]:
    """The matrix: schedule x world x workers x mix x seed/epoch x resume (x tail for lockstep)."""
    schedules = [
        ("independent", "packed"),
        ("lockstep", "packed"),
        ("lockstep", "bucketed"),
        ("packed", "packed"),
    ]
    worlds = [1, 2, 3, 8, 64]
    workers = [0, 1, 2, 3]
    mixes = ["wan21_480p", "native_480p", "tiny", "many"]
    out = []
    for k, ((schedule, tail), world, nw, mix) in enumerate(itertools.product(schedules, worlds, workers, mixes)):
        for resume in (False, True):
            if quick and (k % 7 or resume != (k % 2 == 0)):
                continue
            n = 300 + 40 * world + (k * 37) % 500
            out.append(
                dict(
                    schedule=schedule,
                    tail=tail,
                    world=world,
                    workers=nw,
                    mix=mix,
                    n=n,
                    seed=k % 5,
                    epoch=k % 3,
                    resume=resume,
                    bound=None if k % 4 else 1 + k % 3,
                    variant=k,
                )
            )
    return out


def large_cases() -> list[dict[str, Any]]:
    """Fewer, larger cases (20,000 samples): every schedule at 8 and 64 ranks, 1 and 2 workers."""
    schedules = [
        ("independent", "packed"),
        ("lockstep", "packed"),
        ("lockstep", "bucketed"),
        ("packed", "packed"),
    ]
    out = []
    for k, ((schedule, tail), world, nw, mix, resume) in enumerate(
        itertools.product(schedules, [8, 64], [1, 2], ["wan21_480p", "native_480p"], [False, True])
    ):
        out.append(
            dict(
                schedule=schedule,
                tail=tail,
                world=world,
                workers=nw,
                mix=mix,
                n=20000,
                seed=k % 3,
                epoch=k % 2,
                resume=resume,
                bound=None,
                variant=1000 + k,
            )
        )
    return out


def _canon(x: Any) -> Any:
    if isinstance(x, dict):
        return sorted(((repr(k), _canon(v)) for k, v in x.items()), key=lambda kv: kv[0])
    if isinstance(x, (list, tuple)):
        return [_canon(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    return x


def timeless_report(report: dict) -> dict:
    """A plan report without its wall-clock field (``plan_seconds``): what two equal plans share."""
    return {k: x for k, x in report.items() if k != "plan_seconds"}


# The report keys renamed since the digests were pinned (now -> then): the digest hashes the report under
# the names it had then, so that a rename alone leaves every digest as it was (0.2.0: ``mode`` is ``schedule``).
_PINNED_REPORT_KEYS = {"schedule": "mode"}


def digest_plan(plan: Any) -> dict[str, str]:
    """Per field, the SHA-256 of a canonical text of it (the report without plan_seconds, its renamed keys
    under their pinned names)."""
    out = {}
    for f in FIELDS:
        v = getattr(plan, f)
        if f == "report":
            v = {_PINNED_REPORT_KEYS.get(k, k): x for k, x in timeless_report(v).items()}
        out[f] = hashlib.sha256(repr(_canon(v)).encode()).hexdigest()[:16]
    return out


def plan_case(c: dict[str, Any]) -> Any:
    index = make_index(c["mix"], c["n"], c["seed"] * 1000 + c["variant"])
    exclude = None
    if c["resume"]:
        rng = random.Random(c["variant"])
        exclude = [(s, i) for s, sh in enumerate(index) for i in range(len(sh)) if rng.random() < 0.3]
    b = make_batcher(c["mix"], c["schedule"], c["variant"])
    bound = c["bound"]
    if bound is not None:  # a multiple of the largest batch size: small bounds emit bound-partial batches
        b.resolve_max_compute(s for shard in index for s in shard)
        bound *= max(b.batch_size(s) for shard in index for s in shard)
    return plan_epoch(
        index,
        c["world"],
        c["workers"],
        b,
        c["seed"],
        c["epoch"],
        PlanSettings(schedule=c["schedule"], max_buffered_samples=bound, underfull="pad", lockstep_tail=c["tail"]),
        exclude=exclude,
    )


def case_key(c: dict[str, Any]) -> str:
    return "{schedule}/{tail}/R{world}/W{workers}/{mix}/n{n}/s{seed}e{epoch}/resume{resume}/b{bound}/v{variant}".format(
        **c
    )


def digest_all(quick: bool = False, large: bool = False) -> dict[str, dict[str, str]]:
    return {case_key(c): digest_plan(plan_case(c)) for c in (large_cases() if large else cases(quick))}


def main(argv: list[str]) -> int:
    if argv[0] == "digest":
        out = digest_all(quick="--quick" in argv, large="--large" in argv)
        with open(argv[1], "w") as f:
            json.dump(out, f, indent=0, sort_keys=True)
        print(f"{len(out)} plans digested -> {argv[1]}")
        return 0
    old, new = (json.load(open(p)) for p in argv[1:3])
    bad = [(k, [f for f in FIELDS if old[k][f] != new.get(k, {}).get(f)]) for k in old]
    bad = [(k, fs) for k, fs in bad if fs]
    for k, fs in bad:
        print("DIFFERS", k, fs)
    print(f"{len(old) - len(bad)} of {len(old)} plans identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
