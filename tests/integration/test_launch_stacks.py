"""The multi-process launcher of the tests (``_ddp_data_runner.launch``) says what went wrong.

- A launch that times out shows every process's stacks, also after a Lightning fit has run in the rank.
  Lightning's signal connector puts SIGUSR1 back to ``SIG_DFL`` when a fit ends, which silently removed the
  stack dump (the CI timeouts of sessions 19 and 24 came back without stacks). The script below runs a
  one-step fit, forks a child (as a loader worker would be), and then blocks in both processes.
- A rank that fails ends the launch soon after, with the stacks of the ranks still running (they wait for
  it), instead of at the timeout.
- A port taken by another process before rank 0 listened on it (EADDRINUSE) starts the launch again.
"""

from __future__ import annotations

import textwrap

import _ddp_data_runner
import pytest
from _ddp_data_runner import launch

HANGS_AFTER_A_FIT = textwrap.dedent(
    """
    import multiprocessing, time
    import lightning.pytorch as pl
    import torch

    class One(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch, batch_idx):
            return (self.w - 1).pow(2).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return [torch.zeros(1)]

    def child_blocks_here():
        time.sleep(600)

    def rank_blocks_here():
        time.sleep(600)

    if __name__ == "__main__":
        pl.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False).fit(One())
        multiprocessing.get_context("fork").Process(target=child_blocks_here, daemon=True).start()
        time.sleep(1.0)
        print("blocking", flush=True)
        rank_blocks_here()
    """
)


@pytest.mark.timeout(180)
def test_a_timeout_prints_the_stacks_of_the_rank_and_its_child_after_a_fit(tmp_path):
    script = tmp_path / "hangs_after_a_fit.py"
    script.write_text(HANGS_AFTER_A_FIT)
    with pytest.raises(TimeoutError) as info:
        launch({"world": 1}, str(tmp_path), timeout=30, script=str(script))
    log = str(info.value)
    assert "blocking" in log, log[-3000:]  # the fit ran before the hang
    assert "in rank_blocks_here" in log, log[-3000:]
    assert "in child_blocks_here" in log, log[-3000:]


ONE_RANK_FAILS = textwrap.dedent(
    """
    import os, sys, time

    def peer_waits_here():
        time.sleep(600)

    if __name__ == "__main__":
        if os.environ["RANK"] == "0":
            sys.exit("rank 0 failed")
        peer_waits_here()
    """
)

PORT_TAKEN_ONCE = textwrap.dedent(
    """
    import os, sys

    if __name__ == "__main__":
        marker = os.path.join(os.path.dirname(sys.argv[1]), "tried-" + os.environ["RANK"])
        if not os.path.exists(marker):
            open(marker, "w").close()
            sys.exit("DistNetworkError: ... code: -98, name: EADDRINUSE, message: address already in use")
        print("started on port", os.environ["MASTER_PORT"])
    """
)


@pytest.mark.timeout(120)
def test_a_failed_rank_ends_the_launch_with_the_peers_stacks(tmp_path, monkeypatch):
    monkeypatch.setattr(_ddp_data_runner, "PEER_GRACE_S", 2.0)
    script = tmp_path / "one_rank_fails.py"
    script.write_text(ONE_RANK_FAILS)
    with pytest.raises(RuntimeError, match=r"DDP run failed \(exit codes \[1, -9\]\)") as info:
        launch({"world": 2}, str(tmp_path), timeout=600, script=str(script))
    assert "rank 0 failed" in str(info.value)
    assert "in peer_waits_here" in str(info.value)  # the peer's stack, taken before it was killed


@pytest.mark.timeout(120)
def test_a_taken_port_starts_the_launch_again(tmp_path, capsys):
    script = tmp_path / "port_taken_once.py"
    script.write_text(PORT_TAKEN_ONCE)
    logs = launch({"world": 2}, str(tmp_path), timeout=60, script=str(script))
    assert all("started on port" in log for log in logs)
    assert "the port was taken before rank 0 listened on it (attempt 1); again" in capsys.readouterr().out
