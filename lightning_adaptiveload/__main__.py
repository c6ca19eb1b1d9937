"""``python -m lightning_adaptiveload ...``; see :mod:`lightning_adaptiveload.cli.main`."""

from lightning_adaptiveload.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
