"""A store that trickles a reply cannot write into an arena page after its reservation ended.

Between pool B and Redis sits a proxy that, once told to, sends each connection's replies at a trickle (its
first bytes at once, then one byte every 50 ms: each receive gets a byte well inside the store timeout).
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool
from tests.pool.remote.conftest import (
    HAS_REDIS,
    NAMESPACE,
    NO_REDIS,
    MiB,
    make_keys,
    pool_args,
    wait_written,
    write_chain,
)

pytestmark = [pytest.mark.remote, pytest.mark.skipif(not HAS_REDIS, reason=NO_REDIS)]
PAGE = 1 * MiB
FAST_BYTES = 1000  # of each reply stream: the RESP length line, a part's header and some payload
TRICKLE_S = 0.05


class TrickleProxy:
    """TCP proxy to ``port``; after ``trickle()`` every connection's replies from there on trickle."""

    def __init__(self, port: int) -> None:
        self.port, self._upstream = 0, port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._is_trickling = threading.Event()
        self._is_closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def trickle(self) -> None:
        self._is_trickling.set()

    def close(self) -> None:
        self._is_closed.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._is_closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self._upstream))
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, is_reply: bool) -> None:
        sent_fast = 0
        try:
            while not self._is_closed.is_set():
                data = source.recv(1 << 16)
                if not data:
                    break
                if not (is_reply and self._is_trickling.is_set()):
                    sink.sendall(data)
                    continue
                fast = max(0, min(len(data), FAST_BYTES - sent_fast))
                sink.sendall(data[:fast])
                sent_fast += fast
                for i in range(fast, len(data)):
                    if self._is_closed.is_set():
                        return
                    time.sleep(TRICKLE_S)
                    sink.sendall(data[i : i + 1])
        except OSError:
            pass
        finally:
            for s in (source, sink):
                s.close()


def test_a_trickled_fetch_never_lands_in_a_page_given_to_another_writer(redis_server, prefix):
    """Pool B holds chunk 0 of a chain, the store chunk 1: B reserves a page for chunk 1 and fetches into it, at a
    trickle. Fails when a fetch into reserved pages has no deadline (and the reservation expires under it): after
    --reservation-ttl the page goes to another writer, and the late bytes overwrite what that writer committed."""
    chain = make_keys(prefix, 2)
    proxy = TrickleProxy(redis_server.port)
    quick = ("--remote-promote-timeout", "0.5", "--remote-timeout", "0.5", "--lease-ttl", "10")
    try:
        with running_pool("64MiB", pool_args(redis_server.url, prefix), quiet=True) as a, PoolClient(a) as ca:
            write_chain(ca, chain, PAGE, prefix)
            wait_written(ca, 2)
        args = pool_args(proxy.url, prefix, *quick, "--reservation-ttl", "2")
        with running_pool("16MiB", args, quiet=True) as b, PoolClient(b, timeout_s=10) as cb:
            write_chain(cb, chain[:1], PAGE, prefix)  # chunk 0 is B's own: chunk 1 is fetched into its page
            proxy.trickle()
            lease = cb.lookup(chain, PAGE)  # answered at the promote timeout with chunk 0 only
            cb.release([lease.lease_id], wait=True)
            time.sleep(2.5)  # past --reservation-ttl
            assert cb.stats()["writing"] == 0, "the fetch ran past its deadline: its page is still reserved"
            others = make_keys(prefix + "-other", 15)  # every page the arena has left
            reserved = cb.reserve(NAMESPACE, others, PAGE)
            assert len(reserved.grants) == 15, reserved
            for _, offset in reserved.grants:
                cb.page(offset, PAGE)[:] = 7
            cb.commit(reserved.reservation_id, [page_checksum(cb.page(o, PAGE)) for _, o in reserved.grants])
            time.sleep(1.5)  # a trickle still running lands ~30 bytes meanwhile
            lease = cb.lookup(others, PAGE)
            assert lease.num_pages == 15
            for header in lease.pages:  # every byte a reader uses is what its writer committed
                assert np.all(cb.page(header.offset, PAGE) == 7), f"page at {header.offset} was written into"
            cb.release([lease.lease_id], wait=True)
            cb.check_integrity()
    finally:
        proxy.close()
