"""Several clients on two pools while the store dies and returns: every leased page is byte-exact, no state leaks."""

import random
import threading
import time

import numpy as np
import pytest

from kvshare.pool.client import PoolClient
from tests.pool.remote.conftest import (
    HAS_REDIS,
    NO_REDIS,
    RedisServer,
    make_keys,
    page_data,
    remote_stats,
    two_pools,
    wait_until,
    wait_written,
    write_chain,
)

pytestmark = [pytest.mark.remote, pytest.mark.skipif(not HAS_REDIS, reason=NO_REDIS)]
PAGE = 512 << 10


def reader(socket_path: str, chains: dict, stop: threading.Event, errors: list, seed: int) -> None:
    rng = random.Random(seed)
    try:
        with PoolClient(socket_path, name=f"reader{seed}") as client:
            while not stop.is_set():
                tag = rng.choice(list(chains))
                keys = chains[tag][: rng.randint(1, len(chains[tag]))]
                lease = client.lookup(keys, PAGE)
                for i, header in enumerate(lease.pages):
                    if not np.array_equal(client.page(header.offset, PAGE), page_data(tag, i, PAGE)):
                        errors.append(f"{tag} chunk {i}: bytes differ")
                client.release([lease.lease_id], wait=rng.random() < 0.5)
                if rng.random() < 0.2:
                    client.flush()  # forget everything: the next lookups promote again
    except Exception as exc:  # reported by the test
        errors.append(repr(exc))


def test_readers_on_b_while_a_writes_and_the_store_restarts(prefix):
    server = RedisServer().start()
    try:
        with two_pools(server.url, prefix, size="128MiB") as (a, b), PoolClient(a) as ca, PoolClient(b) as cb:
            chains = {f"{prefix}-{c}": make_keys(f"{prefix}-{c}", 6) for c in range(3)}
            for tag, keys in chains.items():
                write_chain(ca, keys, PAGE, tag)
            wait_written(ca, 18)
            stop, errors = threading.Event(), []
            threads = [threading.Thread(target=reader, args=(b, chains, stop, errors, s)) for s in range(3)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            server.kill()
            more = {f"{prefix}-late{c}": make_keys(f"{prefix}-late{c}", 4) for c in range(2)}
            for tag, keys in more.items():
                write_chain(ca, keys, PAGE, tag)  # written while the store is down: dropped, counted
            time.sleep(1.0)
            server.start()
            time.sleep(1.5)
            stop.set()
            for t in threads:
                t.join(30)
            assert not errors, errors[:5]
            assert remote_stats(cb)["promoted_pages"] >= 6
            assert remote_stats(cb)["discarded_checksum"] == 0
            for client in (ca, cb):
                assert wait_until(lambda c=client: c.stats()["leases"] == 0 and c.stats()["writing"] == 0, 10)
                client.check_integrity()
            assert remote_stats(ca)["write_queue_pages"] == 0
    finally:
        server.stop()
