"""``resolve_paths``' shortcut for plain relative shard paths (issue 40: 100k shards took seconds in
``check_index_path``) gives exactly what the full check gives, and leaves every other path to it."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.shards import index_columns
from lightning_adaptiveload.shards.format import ShardError
from lightning_adaptiveload.shards.index_columns import resolve_paths
from lightning_adaptiveload.shards.untrusted import Refused, check_index_path


def _full(p, root):
    try:
        return check_index_path(p, root)
    except Refused as err:
        return err.reason


def _fast(p, source):
    try:
        return resolve_paths([p], source, (), False)[0]
    except ShardError as err:
        return err.reason


@pytest.mark.parametrize("folder", ["/data/set", "/", "/data/set/", "//host/share"])
@pytest.mark.parametrize(
    "path",
    [
        "shard-000001.tar",
        "a/b/c.tar",
        "a_b-1.0.tar",
        "../x.tar",
        "a/../../x.tar",
        "./a.tar",
        "a//b.tar",
        ".hidden/a.tar",
        "a/",
        "/abs/a.tar",
        "s3:bucket/a.tar",
        "a b.tar",
        "a\\b.tar",
        "..",
        "a/..",
        "pipe:cat x",
    ],
)
def test_the_shortcut_agrees_with_the_full_check(folder, path):
    source = os.path.join(folder, "index.npidx")
    assert _fast(path, source) == _full(path, index_columns.index_root(source))


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab.-_/:\\ %~", min_size=1, max_size=12))
def test_the_shortcut_agrees_with_the_full_check_on_any_path(path):
    source = "/data/set/index.npidx"
    assert _fast(path, source) == _full(path, "/data/set")


def test_plain_paths_take_the_shortcut(monkeypatch):
    calls = []
    monkeypatch.setattr(index_columns, "check_index_path", lambda *a, **k: calls.append(a) or "x")
    got = resolve_paths(["a.tar", "sub/b.tar", "../c.tar"], "/data/set/index.npidx", (), False)
    assert got == ["/data/set/a.tar", "/data/set/sub/b.tar", "x"] and [c[0] for c in calls] == ["../c.tar"]
