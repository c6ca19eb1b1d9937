"""``LoadBalanceMonitor(stall_stacks_s=...)``: a step slower than the threshold leaves every thread's stack in
``stall_stacks_rank<r>.txt``, naming the function it was in; steps that end in time leave nothing.

The first form (``faulthandler``'s watchdog) crashed a compiling 4-GPU run (SIGSEGV, 2 x 4 H200, run 53): the
stacks are now read under the GIL."""

import time

import lightning as L
import pytest
import torch
from _fixtures import quiet_cpu_trainer
from _paths import ROOT

from lightning_adaptiveload import LoadBalanceMonitor
from lightning_adaptiveload.monitor.timing import StallStacks

pytestmark = pytest.mark.timeout(120)

SLOW_STEP = 3  # the batch index that sleeps


def _sleep_inside_a_slow_step(seconds: float) -> None:
    time.sleep(seconds)


class _SleepyModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == SLOW_STEP:
            _sleep_inside_a_slow_step(1.0)
        return self.layer(batch["x"]).square().mean()

    def flops_per_batch(self, batch) -> float:
        return 1.0e6

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_a_slow_step_leaves_its_stack_and_fast_steps_leave_nothing(tmp_path, monkeypatch):
    batches = [{"x": torch.randn(2, 4), "num_tokens": 8, "batch_size": 2, "seq_len": 4} for _ in range(6)]
    monitor = LoadBalanceMonitor(dirpath=tmp_path, plots=False, print_summary=False, stall_stacks_s=0.3)
    trainer = quiet_cpu_trainer(tmp_path, max_steps=6, callbacks=[monitor])
    trainer.fit(_SleepyModule(), train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    text = (tmp_path / "stall_stacks_rank0.txt").read_text()
    sections = {}  # step -> what was dumped while it ran
    for chunk in text.split("== step ")[1:]:
        header, _, body = chunk.partition("\n")
        step = int(header.split(":")[0])
        sections[step] = sections.get(step, "") + body
    # A loaded machine may make another step slow too (the first, say); a step that ended in time leaves
    # nothing, and every dump has its stacks under it.
    assert SLOW_STEP + 1 in sections and all(body.strip() for body in sections.values())
    slow = sections[SLOW_STEP + 1]
    assert slow.count("_sleep_inside_a_slow_step") >= 2  # dumped, and again while the step went on
    assert f"== step {SLOW_STEP + 1}: running for 0." in text
    assert "training_step" in slow
    assert all(
        "_sleep_inside_a_slow_step" not in body for step, body in sections.items() if step != SLOW_STEP + 1
    )
    # The benchmarks' summary of such files names the step and its innermost frame.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "balance"))
    import stall_stacks_summary

    summary = stall_stacks_summary.summarize(str(tmp_path / "stall_stacks_rank0.txt"), frames=1, max_steps=8)
    assert f"step {SLOW_STEP + 1}: " in summary and "in _sleep_inside_a_slow_step" in summary


def test_stall_stacks_refuses_a_bad_threshold():
    for bad in (0, -1.0, float("nan"), "5"):
        with pytest.raises(ValueError, match="stall_stacks_s must be a number of seconds > 0"):
            StallStacks(bad)
    with pytest.raises(ValueError, match="stall_stacks_s"):
        LoadBalanceMonitor(stall_stacks_s=0)
