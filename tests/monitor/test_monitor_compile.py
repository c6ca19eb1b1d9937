"""The monitor flags the steps in which torch.compile compiled, whatever path compiled them.

Regression: the monitor read only dynamo's frame counter, which does not move when ``compile_blocks``'
per-block compiles run (seen on CPU with torch 2.13, and on 2 x H200 with torch 2.11, where no step of a
compiled run was flagged and compile stalls of 10-40 s were counted as step times)."""

import json

import lightning as L
import pytest
import torch
from _fixtures import quiet_cpu_trainer

from lightning_adaptiveload.models.acceleration import compile_blocks
from lightning_adaptiveload.models.config import VideoDiTConfig
from lightning_adaptiveload.models.video_dit import VideoDiT
from lightning_adaptiveload.monitor.timing import COMPILE_WATCH, CompileWatch, compile_count

pytestmark = pytest.mark.timeout(300)


def _tiny_compiled_dit() -> VideoDiT:
    torch.manual_seed(0)
    model = VideoDiT(VideoDiTConfig.preset("tiny"))
    compile_blocks(model, backend="aot_eager")
    return model


def _step(model: VideoDiT, batch: int, frames: int = 1) -> None:
    x = torch.randn(batch, 16, frames, 8, 8)
    model(x, torch.rand(batch), torch.randn(batch, 7, 32)).float().square().mean().backward()


def test_compile_count_moves_when_compiled_blocks_compile_and_only_then():
    compile_count()  # installs the callbacks; reset() below clears them, and they must come back
    torch._dynamo.reset()
    model = _tiny_compiled_dit()
    start = compile_count()
    _step(model, 2)
    first = compile_count()
    assert first > start  # the blocks' first compile is seen
    assert COMPILE_WATCH.installed and COMPILE_WATCH.seconds > 0
    _step(model, 2)
    assert compile_count() == first  # the same shape again: nothing compiled, nothing counted


def test_compile_watch_counts_each_compilation_and_its_time():
    watch = CompileWatch()
    watch._start()
    watch._end()
    watch._end()  # an end without a start (a callback registered mid-compile) counts, adds no time
    assert watch.events == 2 and watch.seconds >= 0.0


class _CompiledDiTModule(L.LightningModule):
    """A user's module that compiles VideoDiT's blocks with compile_blocks (no flops_per_batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _tiny_compiled_dit()

    def training_step(self, batch, batch_idx):
        x = batch["latents"]
        loss = self.model(x, torch.rand(x.shape[0]), torch.randn(x.shape[0], 7, 32)).float().square().mean()
        return loss

    def flops_per_batch(self, batch) -> float:  # given: so no FLOP counting marks step 1 instead
        return 1.0e6

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def test_monitor_flags_the_compiling_step_of_compiled_blocks(tmp_path):
    from lightning_adaptiveload import LoadBalanceMonitor

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    batches = [
        {
            "latents": torch.randn(2, 16, 1, 8, 8, generator=g),
            "cost": 1.0,
            "num_tokens": 32,
            "batch_size": 2,
            "seq_len": 16,
        }
        for _ in range(3)
    ]
    monitor = LoadBalanceMonitor(dirpath=tmp_path, plots=False, print_summary=False)
    trainer = quiet_cpu_trainer(tmp_path, max_steps=3, callbacks=[monitor])
    trainer.fit(_CompiledDiTModule(), train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    steps = json.load(open(tmp_path / "load_balance.json"))["steps"]
    counted = [s["counted"] for s in steps]
    # Step 1 compiled; step 3 repeats step 2's shape: steady.
    assert counted[0] == 1 and counted[2] == 0
    assert monitor.summary["meta"]["flops_source"] == "flops_per_batch"  # not FLOP counting
    meta = monitor.summary["meta"]
    assert meta["steps_compiling"] >= 1
    compiled_at = [step for step, seconds in meta["compiles_rank0"]]
    assert compiled_at and compiled_at[0] == 1 and 3 not in compiled_at  # the step numbers of the step table
    assert all(seconds > 0 for _, seconds in meta["compiles_rank0"])


def test_as_float_reads_a_batch_scalar():
    import math

    from lightning_adaptiveload.monitor.steps import as_float

    assert as_float(3) == 3.0 and as_float(torch.tensor(2.5)) == 2.5
    assert all(math.isnan(as_float(v)) for v in (None, "x", torch.ones(2)))
