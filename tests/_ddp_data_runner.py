"""One rank of a CPU DDP run of AdaptiveLoadDataModule (launched by tests/integration/test_ddp_data.py and friends).

Launched like torchrun would (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, NODE_RANK, LOCAL_RANK set by the test), so
that one launch can run several fits in the same process group. Usage::

    python tests/_ddp_data_runner.py CONFIG.json

CONFIG: {"data": shard dir, "out": dir, "world": N, "runs": [{"name", "schedule", "num_workers",
"max_epochs", "max_tokens", "seed", "ckpt_every": k | null, "kill_at": global step | null,
"resume": checkpoint path | null, "lockstep_tail", "runs_packs": whether the module takes packs, "aligned_gc": add
AlignedGC(every_n_steps=2, full_every_n_steps=5) and write its collections to ``<out>/<name>.gc.rank<r>.json``}]}. Every training step appends
one JSON line to ``<out>/<name>.rank<r>.jsonl``: epoch, global step, plan step, keys, bucket shape, batch
size, global_tokens. A run ending in the simulated crash writes ``<out>/<name>.crashed``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy

from lightning_adaptiveload.callbacks.aligned_gc import AlignedGC
from lightning_adaptiveload.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.loading.settings import Loader
from lightning_adaptiveload.planning.settings import Batching, PlanSettings

torch.set_num_threads(1)


class SimulatedCrash(RuntimeError):
    pass


class KeyRecorder(pl.LightningModule):
    """Records the keys of every training batch; a one-parameter model so that DDP has a gradient."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.path = path

    def training_step(self, batch, batch_idx):
        packed = bool(batch.get("packed"))  # a pack of lockstep's packed tail: a list of latents
        row = {
            "epoch": int(self.current_epoch),
            "global_step": int(self.global_step),
            "step": int(batch["step"]),
            "keys": list(batch["keys"]),
            "packed": packed,
            "shape": None if packed else list(batch["latents"].shape[1:]),
            "batch_size": int(batch["batch_size"]),
            "seq_len": int(batch["seq_len"]),
            "num_tokens": int(batch["num_tokens"]),
            "global_tokens": int(batch["global_tokens"]),
        }
        with open(self.path.replace("{}", str(self.global_rank)), "a") as f:
            f.write(json.dumps(row) + "\n")
        x = (
            torch.stack([t.float().mean() for t in batch["latents"]]).mean()
            if packed
            else batch["latents"].float().mean()
        )
        return (self.w * x - 1.0).pow(2).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class CrashAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            raise SimulatedCrash(f"simulated crash at global step {self.step}")


def main() -> None:
    cfg = json.load(open(sys.argv[1]))
    rank = int(os.environ["LOCAL_RANK"])
    world = int(cfg["world"])
    for run in cfg["runs"]:
        path = os.path.join(cfg["out"], f"{run['name']}.rank{rank}.jsonl")
        dm = AdaptiveLoadDataModule(
            train_shards=cfg["data"],
            batching=Batching(max_tokens=run.get("max_tokens", 512), sizing=run.get("sizing", "dual")),
            plan=PlanSettings(
                schedule=run["schedule"],
                lockstep_tail=run.get("lockstep_tail", "packed"),
                chunk_samples=run.get("chunk_samples", 1_000_000),
            ),
            loader=Loader(num_workers=run["num_workers"], seed=run.get("seed", 0)),
        )
        callbacks: list[Callback] = []
        if run.get("ckpt_every"):
            callbacks.append(
                ModelCheckpoint(
                    dirpath=os.path.join(cfg["out"], run["name"] + "-ckpt"),
                    every_n_train_steps=run["ckpt_every"],
                    save_top_k=-1,
                    filename="at-{step}",
                    auto_insert_metric_name=False,
                )
            )
        if run.get("kill_at") is not None:
            callbacks.append(CrashAt(run["kill_at"]))
        aligned_gc = AlignedGC(every_n_steps=2, full_every_n_steps=5) if run.get("aligned_gc") else None
        if aligned_gc is not None:
            callbacks.append(aligned_gc)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=DDPStrategy(process_group_backend="gloo"),
            max_epochs=run["max_epochs"],
            reload_dataloaders_every_n_epochs=1,
            logger=False,
            enable_checkpointing=bool(run.get("ckpt_every")),
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=callbacks,
        )
        try:
            module = KeyRecorder(path)
            module.runs_packed_batches = bool(run.get("runs_packs", False))  # records packs as they come
            trainer.fit(module, datamodule=dm, ckpt_path=run.get("resume"))
        except SimulatedCrash:
            if rank == 0:
                open(os.path.join(cfg["out"], run["name"] + ".crashed"), "w").close()
            torch.distributed.barrier()
        if aligned_gc is not None:  # the (global step, generation) of every collection on this rank
            with open(os.path.join(cfg["out"], f"{run['name']}.gc.rank{rank}.json"), "w") as f:
                json.dump([[step, gen] for step, gen, _ in aligned_gc.pauses], f)
        if rank == 0:
            context = dm.train_dataloader().multiprocessing_context if run["num_workers"] else None
            with open(os.path.join(cfg["out"], run["name"] + ".report.json"), "w") as f:
                json.dump({**dm.epoch_report, "start_method": context and context.get_start_method()}, f)


# Starts a runner script with a stack dump of every thread on SIGUSR1 (see its docstring).
_WITH_STACK_DUMP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_with_stack_dump.py")


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _group_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (Linux: from /proc; elsewhere the leader alone)."""
    members = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:  # state, ppid, pgrp
                members.append(int(entry))
    return sorted(members) or [pgid]


# After one rank failed, how long the others get to end on their own before their stacks are taken and they
# are killed (they usually wait in a collective for the failed one).
PEER_GRACE_S = 30.0
# The port is free when chosen, but another process may take it before rank 0 listens on it (EADDRINUSE):
# the launch then starts again on a new port, this many times at most.
PORT_ATTEMPTS = 3


def launch(cfg: dict, tmp_dir: str, timeout: float, script: str = __file__) -> list[str]:
    """Run the config on ``cfg["world"]`` local processes of ``script`` (this runner by default); returns their
    logs. Raises on failure or timeout, with every process's stacks where a process had to be killed."""
    cfg_path = os.path.join(tmp_dir, f"cfg-{time.monotonic_ns()}.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    for attempt in range(1, PORT_ATTEMPTS + 1):
        procs, logs = _start(cfg, cfg_path, tmp_dir, script)
        _wait(procs, logs, timeout)
        texts = [open(x).read() for x in logs]
        if not any(p.returncode for p in procs):
            return texts
        if attempt < PORT_ATTEMPTS and any("EADDRINUSE" in t for t in texts):
            print(f"launch: the port was taken before rank 0 listened on it (attempt {attempt}); again")
            continue
        raise RuntimeError(
            f"DDP run failed (exit codes {[p.returncode for p in procs]}):\n"
            + "\n".join(f"--- {x}\n" + t[-8000:] for x, t in zip(logs, texts))
        )
    raise AssertionError("unreachable")


def _start(cfg: dict, cfg_path: str, tmp_dir: str, script: str) -> tuple[list[subprocess.Popen], list[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs, logs = [], []
    for r in range(cfg["world"]):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(cfg["world"]),
            "NODE_RANK": "0",
            "LOCAL_RANK": str(r),
            "RANK": str(r),
            "PYTHONUNBUFFERED": "1",
        }
        log_path = os.path.join(tmp_dir, f"rank{r}-{time.monotonic_ns()}.log")
        logs.append(log_path)
        procs.append(
            subprocess.Popen(
                [sys.executable, _WITH_STACK_DUMP, script, cfg_path],
                env=env,
                stdout=open(log_path, "w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return procs, logs


def _wait(procs: list[subprocess.Popen], logs: list[str], timeout: float) -> None:
    """Until every rank has ended; a rank left running ``timeout`` s after the start, or ``PEER_GRACE_S``
    after another rank failed, prints its stacks and is killed (a timeout raises ``TimeoutError``)."""
    deadline = time.monotonic() + timeout
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        if None not in codes:
            return
        now = time.monotonic()
        if failed_at is None and any(c for c in codes if c is not None):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + PEER_GRACE_S):
            break
        time.sleep(0.2)
    # Every process of each running rank's group (the rank and its loader workers) prints its threads'
    # stacks into the rank's log before it is killed, so that a hang says where it hangs.
    for p in procs:
        if p.poll() is None:
            for pid in _group_members(p.pid):  # one at a time: their dumps share the rank's log
                _signal(pid, signal.SIGUSR1)
                time.sleep(0.5)
    time.sleep(1.0)
    for p in procs:
        _signal_group(p.pid, signal.SIGKILL)
        p.wait()
    if failed_at is None:
        raise TimeoutError(
            "DDP run timed out (hang?); each log ends with every process's stacks:\n"
            + "\n".join(f"--- {x}\n" + open(x).read()[-12000:] for x in logs)
        )


def read_records(out: str, name: str, world: int) -> list[list[dict]]:
    """Per rank, the training-step records of run ``name``."""
    rows = []
    for r in range(world):
        path = os.path.join(out, f"{name}.rank{r}.jsonl")
        rows.append([json.loads(line) for line in open(path)] if os.path.exists(path) else [])
    return rows


if __name__ == "__main__":
    main()
