"""A CPU DDP process destroys its gloo group at exit (``_dist.destroy_gloo_group_at_exit``): a live gloo group
at interpreter finalization can abort the process (SIGABRT), which failed DDP tests at random."""

from __future__ import annotations

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
