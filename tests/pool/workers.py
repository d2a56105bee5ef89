"""Code run in separate processes by the pool tests (spawned, so it must be importable)."""

from __future__ import annotations

import sys
import time

import numpy as np

from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolClient
from tests.pool.conftest import make_keys

NS = b"t" * 16


def page_pattern(seed: int, page_bytes: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, page_bytes, dtype=np.uint8)


def write_pages(socket_path: str, tag: str, n: int, page_bytes: int) -> list[int]:
    """Store n pages with seeded random content; returns the checksums committed."""
    with PoolClient(socket_path, name="writer") as client:
        res = client.reserve(NS, make_keys(tag, n), page_bytes)
        sums = []
        for i, offset in res.grants:
            page = client.page(offset, page_bytes)
            page[:] = page_pattern(i, page_bytes)
            sums.append(page_checksum(page))
        client.commit(res.reservation_id, sums)
        return sums


def read_pages(socket_path: str, tag: str, n: int, page_bytes: int) -> list[str]:
    """sha256 of each page found (in key order)."""
    import hashlib

    with PoolClient(socket_path, name="reader", verify_checksums=True) as client:
        lease = client.lookup(make_keys(tag, n), page_bytes)
        digests = [hashlib.sha256(client.read_checked(h).tobytes()).hexdigest() for h in lease.pages]
        client.release([lease.lease_id], wait=True)
        return digests


def race_writer(socket_path: str, tag: str, n: int, page_bytes: int, writer_id: int, barrier) -> bool:
    """Try to store the same keys as every other racer; returns whether this one got to commit."""
    with PoolClient(socket_path, name=f"racer{writer_id}") as client:
        barrier.wait()
        res = client.reserve(NS, make_keys(tag, n), page_bytes)
        if not res.grants:
            return False
        sums = []
        for _, offset in res.grants:
            page = client.page(offset, page_bytes)
            for start in range(0, page_bytes, page_bytes // 4):  # slowly, so readers could see a half page
                page[start : start + page_bytes // 4] = writer_id
                time.sleep(0.01)
            sums.append(page_checksum(page))
        client.commit(res.reservation_id, sums)
        return True


def race_reader(socket_path: str, tag: str, n: int, page_bytes: int, seconds: float) -> tuple[int, int]:
    """Poll the keys; every page seen must be complete (one writer's byte everywhere). (looks, pages seen)"""
    looks = seen = 0
    with PoolClient(socket_path, name="race-reader") as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            lease = client.lookup(make_keys(tag, n), page_bytes)
            looks += 1
            for header in lease.pages:
                page = client.page(header.offset, header.page_bytes)
                if not (page == page[0]).all() or page_checksum(page) != header.checksum:
                    raise AssertionError("a reader saw an incomplete page")
                seen += 1
            client.release([lease.lease_id])
    return looks, seen


def hold(socket_path: str, action: str, tag: str, n: int, page_bytes: int) -> None:
    """Reserve (action 'reserve') or lease (action 'lease') and then wait to be killed; with a '-dropped'
    suffix, close the connection first without ending the holds (as a timed-out request does)."""
    with PoolClient(socket_path, name=f"hold-{action}") as client:
        if action.startswith("reserve"):
            res = client.reserve(NS, make_keys(tag, n), page_bytes)
            assert res.grants
        else:
            lease = client.lookup(make_keys(tag, n), page_bytes)
            assert lease.num_pages == n
        if action.endswith("-dropped"):
            client.close(end_holds=False)
        print("ready", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    hold(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
