"""Run a runner script as ``__main__`` with a stack dump of every thread on SIGUSR1 (used by
``_ddp_data_runner.launch``)::

    python tests/_with_stack_dump.py RUNNER.py ARGS...

``faulthandler`` installs its handler in C, so it prints even while the main thread is blocked inside a
collective, and the loader workers a rank forks inherit it. Python's ``signal`` module does not know about
that handler, and Lightning's signal connector restores every signal it saw at the start of ``fit`` when
the fit ends: SIGUSR1 goes back to ``SIG_DFL``, and a later SIGUSR1 then kills the process without a word.
That is why the timeouts of a launch that ran several fits came back without stacks (CI, sessions 19
and 24). So the wrapper re-registers the dump whenever anything sets SIGUSR1 back to its default.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys

_set_handler = signal.signal


def _keep_stack_dump(signum, handler):
    previous = _set_handler(signum, handler)
    if signum == signal.SIGUSR1 and handler in (signal.SIG_DFL, None):
        # faulthandler still counts its handler as installed and would not install it again.
        faulthandler.unregister(signal.SIGUSR1)
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    return previous


def main() -> None:
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    signal.signal = _keep_stack_dump
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
