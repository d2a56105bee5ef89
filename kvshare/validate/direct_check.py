"""The bytes level's direct-lookup check: a lease taken with no round trip reads exactly what the pool would answer.

A writer commits a chain of pages with random bytes through the checked pool's client; a client that asks for the
pool's directory (as the engines' pool links do) leases the chain with no round trip. The check passes when that
lease is direct, names the pages, sizes and checksums the pool's own lookup names, and reads the writer's bytes.
A control drops one page and looks again: the lookup must lease just the pages before it. Where the pool offers
no directory (not x86-64 Linux with membarrier, or ``--no-direct-lookups``), the row says so and every lookup takes
the round trip.
"""

from __future__ import annotations

import hashlib
import os

from kvshare.validate.report import CAUGHT, FAIL, PASS, SKIP, Row

NUM_PAGES = 8
PAGE_BYTES = 64 << 10
NAMESPACE = hashlib.blake2b(b"kvshare-validate-direct", digest_size=16).digest()


def direct_rows(pool) -> list[Row]:
    from kvshare.pool.checksum import page_checksum
    from kvshare.pool.client import PoolClient
    from kvshare.pool.direct_reader import DIRECT_LEASE_BIT

    writer = pool.client
    keys = [hashlib.blake2b(os.urandom(16), digest_size=16).digest() for _ in range(NUM_PAGES)]
    grant = writer.reserve(NAMESPACE, keys, PAGE_BYTES)
    if len(grant.grants) != NUM_PAGES:
        if grant.reservation_id:
            writer.abort(grant.reservation_id)
        return [Row("direct lookup", FAIL, f"the pool granted {len(grant.grants)} of {NUM_PAGES} pages")]
    written = []
    for _index, offset in grant.grants:
        page = writer.page(offset, PAGE_BYTES)
        page[:] = memoryview(os.urandom(PAGE_BYTES))
        written.append(bytes(page))
    writer.commit(grant.reservation_id, [page_checksum(writer.page(o, PAGE_BYTES)) for _i, o in grant.grants])
    try:
        with PoolClient(pool.socket, name="kvshare-validate-direct", direct=True) as reader:
            if not reader.is_direct:
                return [Row("direct lookup", SKIP, "the pool offers no directory here: every lookup is a round trip")]
            lease = reader.lookup(keys, PAGE_BYTES)
            by_pool = writer.lookup(keys, PAGE_BYTES)
            writer.release([by_pool.lease_id])
            is_direct = bool(lease.lease_id & DIRECT_LEASE_BIT)
            same = lease.pages == by_pool.pages
            wrong = sum(bytes(reader.read_checked(h)) != w for h, w in zip(lease.pages, written))
            reader.release([lease.lease_id])
            status = PASS if is_direct and same and not wrong else FAIL
            rows = [
                Row(
                    "direct lookup",
                    status,
                    f"{NUM_PAGES} pages leased with no round trip: "
                    + ("direct" if is_direct else "NOT direct")
                    + f", {'the pool' if same else 'NOT the pool'}'s pages and checksums, {wrong} pages wrong",
                )
            ]
            writer.drop(keys[NUM_PAGES // 2 : NUM_PAGES // 2 + 1])
            after = reader.lookup(keys, PAGE_BYTES)
            reader.release([after.lease_id])
            is_caught = after.pages == lease.pages[: NUM_PAGES // 2]
            rows.append(
                Row(
                    "direct lookup control",
                    CAUGHT if is_caught else FAIL,
                    f"page {NUM_PAGES // 2} dropped: the lookup leased {len(after.pages)} of {NUM_PAGES} pages, "
                    f"{'those before it' if is_caught else 'NOT just those before it'}",
                )
            )
            return rows
    finally:
        writer.drop(keys)
