"""A CPU DDP process destroys its gloo group at exit (``_dist.destroy_gloo_group_at_exit``): a live gloo group
at interpreter finalization can abort the process (SIGABRT), which failed DDP tests at random."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_gloo_group_is_destroyed_before_interpreter_finalization(tmp_path):
    script = textwrap.dedent(
        f"""
        import atexit, torch.distributed as dist
        from lightning_adaptiveload import _dist
        # Registered first, so it runs last (atexit is last-in, first-out): after the library's handler.
        atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        _dist.destroy_gloo_group_at_exit()
        _dist.destroy_gloo_group_at_exit()  # once per process
        print("handlers registered")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "initialized at exit: False" in proc.stdout


def test_no_group_no_handler():
    from lightning_adaptiveload import _dist

    before = _dist._EXIT_HOOK_REGISTERED
    _dist.destroy_gloo_group_at_exit()  # not distributed: nothing to destroy, nothing registered
    assert _dist._EXIT_HOOK_REGISTERED == before


def test_end_of_run_teardown_destroys_the_group_and_leaves_the_exit_handler_nothing(tmp_path):
    script = textwrap.dedent(
        f"""
        import torch.distributed as dist
        from lightning_adaptiveload import _dist
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        _dist.destroy_gloo_group_at_exit()
        _dist.destroy_gloo_group_now()
        print("initialized after teardown:", dist.is_initialized(), flush=True)
        _dist.destroy_gloo_group_now()  # nothing left: a no-op
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "initialized after teardown: False" in proc.stdout


def test_the_cli_tears_the_group_down_after_every_subcommand(monkeypatch):
    from types import SimpleNamespace

    from lightning_adaptiveload import _dist
    from lightning_adaptiveload.cli.fit import _cli_class

    calls = []
    monkeypatch.setattr(_dist, "destroy_gloo_group_now", lambda: calls.append(1))
    cli = _cli_class(default_model=True)
    trainer = SimpleNamespace(
        log_dir=None, default_root_dir=None, is_global_zero=False
    )  # a rank other than 0
    me = SimpleNamespace(trainer=trainer, datamodule=None)
    for name in ("after_fit", "after_validate", "after_test", "after_predict"):
        getattr(cli, name)(me)
    assert len(calls) == 4


def _two_ranks(tmp_path, body: str) -> list[subprocess.CompletedProcess]:
    """Run ``body`` in two processes forming a gloo group (rank in ``RANK``); their results."""
    script = (
        textwrap.dedent(
            f"""
        import atexit, os, time, torch.distributed as dist
        from lightning_adaptiveload import _dist
        rank = int(os.environ["RANK"])
        atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
        atexit.register(lambda: print(f"waited at exit: {{time.time() - body_end:.2f}}", flush=True))
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=rank, world_size=2)
        _dist.EXIT_BARRIER_TIMEOUT_S = 3.0
        _dist.destroy_gloo_group_at_exit()
        """
        )
        + textwrap.dedent(body)
        + "\nbody_end = time.time()\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "RANK": str(r)},
        )
        for r in (0, 1)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    return [subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outputs)]


def test_two_ranks_wait_for_each_other_at_exit_then_destroy(tmp_path):
    # Rank 1 leaves late: rank 0's handler waits for it at the barrier instead of tearing down under it.
    results = _two_ranks(tmp_path, "if rank == 1:\n    time.sleep(1.0)\n")
    for r in results:
        assert r.returncode == 0, r.stderr[-2000:]
        assert "initialized at exit: False" in r.stdout
    waited = float(results[0].stdout.split("waited at exit: ")[1].split()[0])
    assert waited >= 0.8, results[0].stdout


def test_a_peer_that_dies_does_not_hold_the_exit(tmp_path):
    # Rank 1 dies without its handlers: rank 0 waits at most EXIT_BARRIER_TIMEOUT_S, then destroys its group.
    results = _two_ranks(tmp_path, "if rank == 1:\n    os._exit(0)\n")
    assert results[0].returncode == 0, results[0].stderr[-2000:]
    assert "initialized at exit: False" in results[0].stdout
