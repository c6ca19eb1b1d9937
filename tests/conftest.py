"""Shared by every folder of tests/ (tests/README.md): the helper modules of this folder importable from
the test files of any subfolder (``from _fixtures import ...``), the ``cuda`` marker's skip, and the
``synthetic_shards`` fixture."""

import os
import sys

import pytest
import torch

# The helpers (_fixtures.py, _paths.py, _ddp_data_runner.py, ...) live here, beside this file; the test files
# live in subfolders, whose own folder is all that pytest puts on sys.path.
sys.path.insert(0, os.path.dirname(__file__))
from _fixtures import uneven_shards  # noqa: E402

# Keep CPU tests light on the 2-core CI machine.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def synthetic_shards(tmp_path_factory):
    """Factory: ``synthetic_shards(sizes, seed, name="shards", **settings)`` writes a new folder of synthetic
    ``tiny``-mix shards with these shard sizes and returns its path (a fresh folder every call: a test may
    change its data)."""

    def make(sizes, seed, name="shards", **settings) -> str:
        return uneven_shards(tmp_path_factory, name, sizes, seed, **settings)

    return make
