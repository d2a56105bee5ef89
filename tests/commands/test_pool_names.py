"""Pools by name: pool-stats / pool-admin never pick one of two clusters at random, and flush asks first."""

import json
import os

import pytest

from kvshare.errors import UserError
from kvshare.paths import find_pool_socket, running_up_pools, up_pool_pointer
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool
from tests.commands.test_errors import kvshare, refused
from tests.pool.conftest import make_keys


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    path = tmp_path / "run"
    path.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(path))
    return path


def point(name: str, target) -> None:
    with open(up_pool_pointer(name), "w") as f:
        f.write(str(target))


def test_two_clusters_are_told_apart_by_name(runtime, tmp_path):
    """Fails with one pointer per user: the second cluster's up replaced the first's, and a command with no
    --socket reached whichever started last."""
    for name in ("8080", "qwen"):
        (tmp_path / f"{name}.sock").touch()
        point(name, tmp_path / f"{name}.sock")
    point("gone", tmp_path / "gone.sock")  # a cluster whose pool is gone is not listed
    assert running_up_pools() == {"8080": str(tmp_path / "8080.sock"), "qwen": str(tmp_path / "qwen.sock")}
    assert find_pool_socket("qwen") == str(tmp_path / "qwen.sock")
    with pytest.raises(UserError, match="several kvshare up pools run here .8080, qwen.: choose one with --name"):
        find_pool_socket()
    with pytest.raises(UserError, match="no running kvshare up pool is named 'other'"):
        find_pool_socket("other")
    os.unlink(up_pool_pointer("8080"))
    assert find_pool_socket() == str(tmp_path / "qwen.sock")  # one cluster: no name needed
    with pytest.raises(ValueError, match="a pool name takes"):
        up_pool_pointer("../x")


def test_flush_names_its_pool_asks_first_and_refuses_a_namespace_it_lacks():
    """Fails when flush drops chunks with no --yes and no terminal to ask, or answers an unknown namespace 0."""
    with running_pool("64MiB", ("--extent-size", "16MiB")) as socket_path:
        namespace = b"admin-namespace!"
        with PoolClient(socket_path, name="writer") as client:
            res = client.reserve(namespace, make_keys("flush-names", 1), 4096)
            client.commit(res.reservation_id, [0])
        refused(kvshare("pool-admin", "--socket", socket_path, "flush"), "without asking: add --yes")
        refused(
            kvshare("pool-admin", "--socket", socket_path, "flush", "--namespace", "ab" * 16, "--yes"),
            "holds no namespace " + "ab" * 16,
        )
        out = kvshare("pool-admin", "--socket", socket_path, "flush", "--namespace", namespace.hex(), "--yes")
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == {"dropped": 1, "namespace": namespace.hex(), "pool": socket_path}
