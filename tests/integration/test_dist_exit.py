"""A CPU DDP process destroys its gloo group at exit (``_dist.destroy_gloo_group_at_exit``): a live gloo group
at interpreter finalization can abort the process (SIGABRT), which failed DDP tests at random."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from _paths import ROOT, TESTS


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


# --------------------------------------------------------------------------- issue 38: the exit race (docs/ci_flake.md)


def _env() -> dict[str, str]:
    paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


@pytest.mark.timeout(300)
def test_a_monitored_ddp_fit_exits_cleanly_while_gloo_still_frees_tensors(tmp_path):
    # The CI flake, with its window held open: each rank's last act is a gloo collective over 20,000 small
    # tensors, so gloo's worker is still freeing their Python objects (one GIL acquisition each) when the rank
    # exits. Before the fix the monitor's DDP hook kept the default group alive, the exit handler could not join
    # gloo's threads, and the ranks died with SIGABRT ("terminate called without an active exception") or SIGSEGV.
    proc = subprocess.run(
        [sys.executable, str(TESTS / "_gloo_exit_runner.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=280, env=_env(), cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fit done" in proc.stdout
    assert "terminate called" not in proc.stderr


def test_all_gather_floats_frees_its_tensors_on_the_calling_thread(tmp_path):
    # Without the wait, gloo's worker thread freed the gather's tensors (taking the GIL) in about 1 call of 6.
    script = textwrap.dedent(
        f"""
        import threading, weakref, torch, torch.distributed as dist
        from lightning_adaptiveload import _dist
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        main, elsewhere, made = threading.get_ident(), [], []

        class Torch:  # torch, with the tensors _dist makes watched
            def __getattr__(self, name):
                return getattr(torch, name)
            def _watch(self, t):
                made.append(1)
                weakref.finalize(t, lambda: threading.get_ident() != main and elsewhere.append(1))
                return t
            def tensor(self, *a, **k):
                return self._watch(torch.tensor(*a, **k))
            def empty(self, *a, **k):
                return self._watch(torch.empty(*a, **k))

        _dist.torch = Torch()
        for i in range(300):
            assert _dist.all_gather_floats([float(i), 1.0]) == [[float(i), 1.0]]
        print(len(made), len(elsewhere))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=_env()
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["600", "0"]


def test_exit_never_waits_for_a_peer_with_a_collective_in_flight(tmp_path):
    # The failure path: rank 1 leaves an all-reduce in flight that rank 0 (alive, busy elsewhere) never joins.
    # Rank 1's exit handler gives gloo's threads EXIT_JOIN_TIMEOUT_S, sends nothing, and exits without rank 0.
    script = textwrap.dedent(
        f"""
        import os, time, torch, torch.distributed as dist
        from lightning_adaptiveload import _dist
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=rank, world_size=2)
        _dist.EXIT_JOIN_TIMEOUT_S = 1.0
        _dist.destroy_gloo_group_at_exit()
        if rank == 0:
            time.sleep(120)  # stuck elsewhere; the test kills it
        work = dist.all_reduce(torch.ones(4), async_op=True)
        print("leaving with a collective in flight", flush=True)
        """
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**_env(), "RANK": str(r)})
        for r in (0, 1)
    ]  # fmt: skip
    try:
        start = time.monotonic()
        out, err = procs[1].communicate(timeout=90)
        took = time.monotonic() - start
    finally:
        procs[0].kill()
        procs[0].communicate()
    assert "leaving with a collective in flight" in out, err[-2000:]
    assert procs[1].returncode == 0, err[-2000:]
    assert took < 30, took  # rendezvous and imports included; the peer would have held it 120 s
