"""Folders the tests name, wherever the test file lives: the repository, ``tests/`` (the shared helpers and
the scripts that multi-process tests launch by path) and ``tests/assets/`` (pinned files: plan digests, an
old-form recipe)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ASSETS = TESTS / "assets"
