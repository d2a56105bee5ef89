"""One pool daemon for the transfer tests, with small extents so runs meet extent boundaries."""

from __future__ import annotations

import pytest

from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool
from tests.transfer.helpers import EXTENT_BYTES


@pytest.fixture(scope="session")
def pool_socket():
    with running_pool("16MiB", ("--extent-size", str(EXTENT_BYTES))) as socket_path:
        yield socket_path


@pytest.fixture
def client(pool_socket):
    with PoolClient(pool_socket, name="test-transfer") as c:
        yield c
