"""``benchmarks/balance/step_probe.py`` and ``step_probe_summary.py``: the per-step probe of forward, backward
and optimizer times with GC pauses (on CPU: host times only), the kernel summary of a profiled step, the
summary of slow against fast steps, and ``ddp_modes.py --callback``."""

from __future__ import annotations

import csv
import json

import pytest
from _paths import ROOT


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "balance"))
    import step_probe
    import step_probe_summary

    return step_probe, step_probe_summary


def test_kernel_summary_busy_idle_and_gaps(probe):
    sp, _ = probe
    ms = 1_000_000
    # (name, start, end) in ns: a, b overlapping (0-3 ms), gap 2 ms, a (5-6), gap 0.5 ms, c (6.5-10)
    events = [("a", 0, 2 * ms), ("b", 1 * ms, 3 * ms), ("a", 5 * ms, 6 * ms), ("c", int(6.5 * ms), 10 * ms)]
    s = sp.kernel_summary(list(reversed(events)), top=2)
    assert s["span_s"] == pytest.approx(0.010)
    assert s["busy_s"] == pytest.approx(0.0075)
    assert s["idle_s"] == pytest.approx(0.0025)
    assert s["gaps_s"] == pytest.approx([0.002, 0.0005])
    assert s["gaps_over_1ms"] == 1
    assert s["kernels"] == pytest.approx({"c": 0.0035, "a": 0.003})  # the two largest by summed time
    assert sp.kernel_summary([])["events"] == 0


def test_profile_steps_checked(probe):
    sp, _ = probe
    with pytest.raises(ValueError, match=r"profile_steps must be \[first, last\)"):
        sp.StepProbe(profile_steps=[5, 5])


def _rows(times_ms, shape=("32760", "1")):
    rows = []
    for step, t in enumerate(times_ms, start=1):
        row = {"rank": "0", "step": str(step), "batch_idx": str(step - 1), "num_tokens": shape[0],
               "batch_size": shape[1], "profiled": "0", "gc_count": "0", "gc_gen2": "0", "gc_s": "0"}  # fmt: skip
        fwd, opt = 0.3 * t / 1e3, 0.02
        for kind in ("gpu", "host"):
            row[f"{kind}_forward_s"] = str(fwd)
            row[f"{kind}_backward_s"] = str(t / 1e3 - fwd - opt)
            row[f"{kind}_optimizer_s"] = str(opt)
            row[f"{kind}_step_s"] = str(t / 1e3)
        rows.append(row)
    return rows


def test_summary_leaves_out_first_steps_and_compares_thirds(probe):
    _, sps = probe
    # Step 1 compiles (10 s); then 6 steps at 1,000 ms and 3 at 1,100 ms (a build each).
    times = [10_000, 1000, 1100, 1000, 1000, 1100, 1000, 1000, 1100, 1000]
    other = _rows([500, 500], shape=("1560", "20"))
    rows = _rows(times) + [{**r, "step": str(20 + i)} for i, r in enumerate(other)]
    s = sps.summarize_rows(rows, skip=0)
    assert s["shape"] == {"tokens": 32760, "samples": 1}
    assert s["steps"] == 9  # the shape's first step is left out
    third = s["phases"]["step"]
    assert third["gpu_median_s"] == pytest.approx(1.0)
    assert third["gpu_slow_minus_fast_s"] == pytest.approx(0.1)
    assert sorted(s["slow_steps"]) == [3, 6, 9]
    assert sps.summarize_rows(rows, skip=100) == {"steps": 0}


def test_summary_cli_reads_a_run_folder(probe, tmp_path, capsys):
    _, sps = probe
    run = tmp_path / "run" / "lockstep" / "logs" / "version_0"
    run.mkdir(parents=True)
    rows = _rows([9000] + [1000, 1200] * 5)
    with open(run / "step_probe_rank0.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    out = tmp_path / "s.json"
    assert sps.main([str(tmp_path / "run"), "--skip", "0", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step_probe_rank0.csv" in printed and "slow-fast third" in printed
    data = json.loads(out.read_text())
    (only,) = data.values()
    assert only["phases"]["step"]["gpu_slow_minus_fast_s"] == pytest.approx(0.2)
    assert sps.main([str(tmp_path / "nothing")]) == 2
    assert "no step_probe_rank*.csv" in capsys.readouterr().err


def test_probe_in_a_fit_writes_host_times_and_gc(probe, tmp_path):
    sp, sps = probe
    import gc

    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringModel

    class Garbage(BoringModel):
        def training_step(self, batch, batch_idx):
            if batch_idx == 3:
                gc.collect()  # one collection inside step 4
            return super().training_step(batch, batch_idx)

    cb = sp.StepProbe()
    trainer = pl.Trainer(
        default_root_dir=str(tmp_path), max_steps=6, accelerator="cpu", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[cb],
    )  # fmt: skip
    trainer.fit(Garbage())
    (path,) = list(tmp_path.rglob("step_probe_rank0.csv"))
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    for r in rows:
        assert float(r["host_step_s"]) >= float(r["host_forward_s"]) >= 0
        assert r["gpu_step_s"] == ""  # no CUDA: no GPU times, not zeros
    assert int(rows[3]["gc_count"]) >= 1 and float(rows[3]["gc_s"]) > 0
    assert gc.callbacks.count(cb._on_gc) == 0  # removed at teardown


def test_ddp_modes_passes_callbacks(monkeypatch, capsys, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "balance"))
    import ddp_modes

    extra = {"class_path": "benchmarks.balance.step_probe.StepProbe", "init_args": {"profile_steps": [4, 8]}}
    recipe = ROOT / "lightning_adaptiveload" / "recipes" / "wan13b_480p_lockstep.yaml"

    def callbacks_of(recipe, given, without=()):
        _, cmd = ddp_modes.build_command(
            "lockstep", recipe=str(recipe), out="/tmp/o", data="/tmp/d", steps=10, devices=1, max_tokens=32760,
            seed=0, settings="eager", callbacks=given, without=without,
        )  # fmt: skip
        return json.loads(cmd[cmd.index("--trainer.callbacks") + 1])

    # The recipe as shipped: its ClosedLoop and KernelWarmup kept, its checkpoints and its own monitor left out.
    callbacks = callbacks_of(recipe, [extra])
    assert [c["class_path"] for c in callbacks] == [
        "lightning_adaptiveload.callbacks.load_balance.LoadBalanceMonitor",
        "lightning_adaptiveload.ClosedLoop",
        "lightning_adaptiveload.KernelWarmup",
        extra["class_path"],
    ]
    assert callbacks[3] == extra
    # A callback given again replaces the recipe's.
    mine = {"class_path": "lightning_adaptiveload.KernelWarmup", "init_args": {}}
    assert callbacks_of(recipe, [mine])[2:] == [mine]
    assert len(callbacks_of(recipe, [], without=["KernelWarmup"])) == 2  # WARMUP=0 of gpu_ddp_modes_x4.sh
    bare = tmp_path / "bare.yaml"
    bare.write_text("trainer:\n  max_steps: 3\n")
    assert len(callbacks_of(bare, [])) == 1
    with pytest.raises(SystemExit):
        ddp_modes.main(["--dry-run", "--callback", '{"init_args": {}}'])
    assert 'want {"class_path"' in capsys.readouterr().err
