"""``python -m lightning_adaptiveload ...``; see :mod:`lightning_adaptiveload.cli`."""

from lightning_adaptiveload.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
