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
