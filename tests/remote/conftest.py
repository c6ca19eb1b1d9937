"""Fixtures of the tests that read shards from real servers on the loopback address (``servers.py``).

- ``remote_data``: a folder of synthetic ``tiny``-mix shards with its ``index.json`` (sample spans in it).
- ``nginx``: nginx serving that folder at ``{nginx.url}/data/`` for the whole session; ``own_nginx``: a
  fresh one per test, for the tests that stop and restart it.
- ``moto_s3``: moto's S3 server with the shards in ``s3://shards/data/``; the AWS environment variables
  (key, secret, region, ``AWS_ENDPOINT_URL``) point every boto3 client of the session at it.
- ``proxy``: a :class:`~servers.FaultProxy` in front of the session's nginx.

The tests read an epoch with ``servers.plan_of`` and ``servers.read_streams`` (every rank's streams one
after another in this process) and compare what the client saw with what the server logged.

A server that is not installed skips its tests with the reason (``.ci/run`` installs nginx; moto comes
with the ``dev`` extra).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from servers import (
    BUCKET,
    PREFIX,
    FaultProxy,
    MotoS3,
    Nginx,
    moto_available,
    nginx_binary,
)

SIZES = [14, 9, 17, 6, 12, 10, 8]  # 76 samples in 7 shards, about 1.7 MB
SEED = 11


@pytest.fixture(scope="session")
def remote_data(tmp_path_factory) -> str:
    from _fixtures import uneven_shards

    return uneven_shards(tmp_path_factory, "remote-shards", SIZES, SEED)


def _need_nginx() -> None:
    if nginx_binary() is None:
        pytest.skip("nginx is not installed (apt-get install -y nginx; .ci/run installs it)")


def _www(tmp_path_factory, remote_data: str) -> str:
    www = tmp_path_factory.mktemp("www")
    shutil.copytree(remote_data, www / PREFIX)
    return str(www)


@pytest.fixture(scope="session")
def www(tmp_path_factory, remote_data) -> str:
    """The folder nginx serves: the shards under ``data/``."""
    return _www(tmp_path_factory, remote_data)


@pytest.fixture(scope="session")
def nginx(tmp_path_factory, www) -> Iterator[Nginx]:
    _need_nginx()
    server = Nginx(www, str(tmp_path_factory.mktemp("nginx"))).start()
    yield server
    server.close()


@pytest.fixture
def own_nginx(tmp_path, www) -> Iterator[Nginx]:
    """An nginx of this test alone (it may be stopped and restarted), serving the same folder."""
    _need_nginx()
    server = Nginx(www, str(tmp_path / "nginx")).start()
    yield server
    server.close()


@pytest.fixture
def proxy(nginx) -> Iterator[FaultProxy]:
    with FaultProxy(nginx.port) as p:
        yield p


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory, remote_data) -> Iterator[MotoS3]:
    if not moto_available():
        pytest.skip("moto's server mode is not installed (pip install 'moto[server]'; the dev extra has it)")
    server = MotoS3(str(tmp_path_factory.mktemp("moto"))).start()
    saved = {k: os.environ.get(k) for k in server.environ()}
    os.environ.update(server.environ())
    try:
        server.upload_folder(BUCKET, remote_data, PREFIX)
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()
