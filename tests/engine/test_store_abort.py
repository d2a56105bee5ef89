"""A store that fails part-way gives its reservation back only after the copies it queued have ended.

The transfer here queues each run's device-to-host copy on a thread that lands it 0.3 s later (as a CUDA copy
stream would) and fails on the second run; ``sync()`` waits for the queued copies.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from kvshare.engine import pool_kv
from kvshare.engine.stats import EngineStats
from kvshare.layout import KVLayout
from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool
from tests.pool.conftest import make_keys

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32", chunk_tokens=16)
PAGE = LAYOUT.page_bytes
NS = b"s" * 16
LATE_BYTE = 0x5A


class QueuedCopies:
    """A transfer whose stores land later, on a thread, and whose second store call fails."""

    def __init__(self, layout, client, device, config) -> None:
        self.client = client
        self.copies: list[threading.Thread] = []
        self.num_stores = 0

    def store(self, kv, first_chunk, offsets, producer_stream=None):
        self.num_stores += 1
        if self.num_stores == 2:
            raise RuntimeError("the copy engine failed")
        pages = [self.client.page(offset, PAGE) for offset in offsets]

        def land() -> None:
            time.sleep(0.3)
            for page in pages:
                page[:] = LATE_BYTE

        copy = threading.Thread(target=land, daemon=True)
        copy.start()
        self.copies.append(copy)
        return [0] * len(offsets)

    def sync(self) -> None:
        for copy in self.copies:
            copy.join()

    def close(self) -> None:
        pass


def test_a_failed_store_waits_for_its_queued_copies_before_the_pages_go_to_another_writer(monkeypatch):
    """Fails when PoolKV.store aborts without ``self.transfer.sync()``: the freed page goes to the next writer,
    and the first store's late copy overwrites what that writer committed."""
    monkeypatch.setattr(pool_kv, "make_transfer", QueuedCopies)
    keys = make_keys("abort", 3)
    with running_pool("16MiB", ("--extent-size", "4MiB"), quiet=True) as path:
        with PoolClient(path, name="other") as other:  # chunk 1 is in the pool already: the store has two runs
            reserved = other.reserve(NS, keys[1:2], PAGE, first_depth=1)
            other.commit(reserved.reservation_id, [page_checksum(other.page(reserved.grants[0][1], PAGE))])
        link = pool_kv.PoolKV(path, LAYOUT, torch.device("cpu"), EngineStats(), name="engine")
        kv = torch.zeros(1, 2, 1, 3 * LAYOUT.chunk_tokens, 64)
        with pytest.raises(RuntimeError, match="copy engine failed"):
            link.store(kv, keys, NS)
        with PoolClient(path, name="next-writer") as writer:
            reserved = writer.reserve(NS, make_keys("next", 2), PAGE)
            for _, offset in reserved.grants:
                writer.page(offset, PAGE)[:] = 7
            sums = [page_checksum(writer.page(offset, PAGE)) for _, offset in reserved.grants]
            writer.commit(reserved.reservation_id, sums)
            time.sleep(0.5)  # any copy still queued has landed by now
            lease = writer.lookup(make_keys("next", 2), PAGE)
            for header in lease.pages:  # every byte a reader uses is what its writer committed
                assert np.all(writer.page(header.offset, PAGE) == 7), f"page at {header.offset} was overwritten"
                assert page_checksum(writer.page(header.offset, PAGE)) == header.checksum
            writer.release([lease.lease_id], wait=True)
        link.close()
