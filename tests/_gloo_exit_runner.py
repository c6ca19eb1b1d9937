"""A 2-process CPU DDP fit (Lightning ``ddp_spawn``, gloo) with the LoadBalanceMonitor whose ranks exit right
after a gloo collective over many small tensors: gloo's worker thread then frees their Python objects one GIL
acquisition at a time, still at it when the process exits. Run by ``tests/integration/test_dist_exit.py``.

Usage: ``python tests/_gloo_exit_runner.py OUTDIR [NUM_TENSORS]``; prints ``fit done`` and exits 0 when every
rank exited cleanly (Lightning raises ``ProcessExitedException`` for a rank killed by SIGABRT).
"""

from __future__ import annotations

import sys
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from lightning_adaptiveload.callbacks.load_balance import LoadBalanceMonitor

NUM_TENSORS = int(sys.argv[2]) if len(sys.argv) > 2 else 20_000


class Batches(IterableDataset):
    def __iter__(self):
        for b, s in [(1, 16), (2, 8), (3, 8), (2, 4)]:
            yield {"latents": torch.randn(b, 8), "seq_len": s, "batch_size": b, "num_tokens": b * s,
                   "cost": float(b * s), "global_tokens": -1}  # fmt: skip


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 16)

    def training_step(self, batch, batch_idx):
        return self.lin(batch["latents"]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(Batches(), batch_size=None)


class ManyTensorsLast(L.Callback):
    """The last thing a rank does: a collective over many small tensors, which Python drops at once."""

    def teardown(self, trainer, pl_module, stage):
        import torch.distributed as dist

        tensors = [torch.zeros(1) for _ in range(NUM_TENSORS)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dist.all_reduce_coalesced(tensors)


if __name__ == "__main__":
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=sys.argv[1],
        callbacks=[LoadBalanceMonitor(print_summary=False, write_files=False, plots=False), ManyTensorsLast()],
    )  # fmt: skip
    trainer.fit(Tiny())
    print("fit done", flush=True)
