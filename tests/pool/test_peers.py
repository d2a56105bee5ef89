"""Both ends of the pool socket check who is on the other end (SO_PEERCRED)."""

import os
import stat

import pytest

import kvshare.pool.client as client_module
from kvshare.pool.client import PoolClient, PoolRequestError
from kvshare.pool.peers import PeerCredentials, peer_credentials, untrusted_pool_reason


def dir_stat(uid: int, mode: int) -> os.stat_result:
    return os.stat_result((stat.S_IFDIR | mode, 0, 0, 2, uid, uid, 4096, 0, 0, 0))


@pytest.mark.parametrize(
    "pool_uid, dir_uid, mode, is_trusted",
    [
        (1000, 1000, 0o700, True),  # the client's own uid
        (0, 1000, 0o777, True),  # root
        (2000, 2000, 0o750, True),  # another user who alone may write the socket's directory (a shared pool)
        (2000, 2000, 0o770, False),  # ... but the directory's group may write it too
        (2000, 1000, 0o700, False),  # another user's pool in a directory it does not own
        (2000, 3000, 0o755, False),
    ],
)
def test_which_pools_a_client_trusts(pool_uid, dir_uid, mode, is_trusted):
    reason = untrusted_pool_reason(pool_uid, 1000, dir_stat(dir_uid, mode), "/run/kvshare/pool.sock")
    assert (reason is None) is is_trusted
    if not is_trusted:
        assert f"runs as uid {pool_uid}" in reason and "/run/kvshare/pool.sock" in reason


def test_a_client_refuses_a_pool_of_an_untrusted_uid(pool, monkeypatch):
    """The pool here runs as this uid; the client is told the kernel saw uid 4242 at the other end.

    Fails when the peer check is removed from PoolClient.connect: the client connects and maps the arena.
    """
    monkeypatch.setattr(client_module, "peer_credentials", lambda sock: PeerCredentials(1, 4242, 4242))
    with pytest.raises(PoolRequestError, match="untrusted_pool: refusing the pool at .* runs as uid 4242"):
        PoolClient(pool, timeout_s=5).connect()


def test_peer_credentials_name_this_process(pool):
    with PoolClient(pool, timeout_s=5) as client:
        pid, uid, _gid = peer_credentials(client._sock)
        assert uid == os.getuid() and pid != os.getpid()  # the daemon, a child process
