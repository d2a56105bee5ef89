"""What a client writes into its hold table (direct lookups, kvshare/pool/hold_tables.py) can make the pool refuse
that client, never crash it, stall it beyond a bound, keep a page past its TTL or free a page another client holds.

Each test runs the pool in a thread of the test process (tests/pool/test_direct.py's ``start_server``), so it can
look at the daemon's side; a client that must race the pool's scans writes from a process of its own (no GIL).
"""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
import time

import pytest

from kvshare.pool import direct as direct_module
from kvshare.pool.client import PoolClient, PoolUnavailable
from kvshare.pool.direct_reader import DIRECT_LEASE_BIT
from kvshare.pool.hold_tables import (
    HIT_CHUNKS,
    HOLD_WORDS,
    HOLDS_AT_WORD,
    HWM,
    LOOKUPS,
    MAX_TABLES_PER_UID,
    MISS_CHUNKS,
    TOUCHES,
)
from tests.pool.conftest import make_keys
from tests.pool.test_direct import start_server, wait_for, write_chain

pytestmark = pytest.mark.skipif(
    not direct_module.is_supported(), reason="no direct lookups here (x86-64 Linux with membarrier only)"
)

PAGE = 4096
HOLDS_AT = HOLDS_AT_WORD * 8
U64 = struct.Struct("<Q")


@pytest.fixture
def server(tmp_path):
    server = start_server(tmp_path)
    yield server
    server.stop()


def set_word(table, word: int, value: int) -> None:
    U64.pack_into(table, word * 8, value)


def set_hold(table, slot: int, gen: int, lease: int = DIRECT_LEASE_BIT + 1) -> None:
    struct.pack_into("<QQ", table, HOLDS_AT + slot * HOLD_WORDS * 8, gen, lease)


def gens_of(server, keys: list[bytes]) -> list[int]:
    return [server.index.entry(key).gen for key in keys]


FLIPPER = textwrap.dedent(
    """
    import struct, sys
    from kvshare.pool.client import PoolClient
    from kvshare.pool.hold_tables import HOLDS_AT_WORD, HWM
    client = PoolClient(sys.argv[1], direct=True).connect()
    table, at = client._direct._table, HOLDS_AT_WORD * 8
    struct.pack_into("<Q", table, HWM * 8, 1)  # one hold in use: the pool's column of holds is one word
    print("flipping", flush=True)
    while True:
        struct.pack_into("<Q", table, at, 7)
        struct.pack_into("<Q", table, at, 0)
    """
)


def test_a_client_that_flips_a_hold_while_the_pool_scans_does_not_stop_the_pool(tmp_path):
    """A process flips the one hold of its table as fast as it can while the pool scans it (its stats, asked for
    back to back, and its ticks). Fails when the pool scans the live table (numpy counts the holds, then finds
    another number: about one scan in a thousand raises, and the exception ends the daemon's loop)."""
    server = start_server(tmp_path, tick_s=0.005)
    path = server.config.socket_path
    flipper = subprocess.Popen([sys.executable, "-c", FLIPPER, path], stdout=subprocess.PIPE, text=True)
    try:
        assert flipper.stdout.readline().strip() == "flipping"
        deadline = time.monotonic() + 4.0
        with PoolClient(path, name="bystander") as bystander:
            while time.monotonic() < deadline:
                assert server.serve_thread.is_alive(), "the pool's loop ended"
                bystander.stats()
    finally:
        flipper.kill()
        flipper.wait()
        server.stop()


def test_a_link_dropped_between_the_slot_read_and_the_hold_store_leases_nothing_the_pool_may_free(server):
    """The reader has read the slots when its connection drops; the pool forgets its holder (no hold visible then)
    and closes its table; only then does the reader store its holds. Fails when the pool forgets a live holder
    without closing the table to new holds first (a barrier on its side, a word the reader checks after its
    store): the lease is granted from a table nobody scans and the dropped pages are freed under it."""
    keys = make_keys("link-drop", 4)
    path = server.config.socket_path
    with PoolClient(path) as writer:
        offsets = write_chain(writer, keys, PAGE, fill=5)
        reader = PoolClient(path, direct=True).connect()
        direct = reader._direct
        dropped = []

        class LinkDropsBeforeTheStore(list):  # the reader takes its free holds between reading slots and storing
            def pop(self):
                if not dropped:
                    reader._close_socket()  # the link drops (a timeout): the pool sees the connection close
                    dropped.append(wait_for(lambda: not server.direct.tables))
                return super().pop()

        direct._free = LinkDropsBeforeTheStore(direct._free)
        try:
            grant = reader.lookup(keys, PAGE)
        except PoolUnavailable:
            grant = None
        assert dropped == [True], "the pool kept the table of a holder with no holds"
        if grant is not None and grant.lease_id & DIRECT_LEASE_BIT:
            writer.drop(keys)
            freed = [o for o in offsets if not server.allocator.is_allocated(o, PAGE)]
            assert not freed, f"pages {freed} were freed under a direct lease"
        reader.close(end_holds=False)


def test_rewriting_a_holds_lease_id_does_not_keep_a_page_past_the_ttl(tmp_path):
    """A reader that hung, or one that means to pin: it rewrites the lease id of its holds every 20 ms. Fails when
    the pool times a hold by (slot, generation, lease id): each rewrite is a new hold and the dropped pages stay."""
    server = start_server(tmp_path, lease_ttl_s=0.3)
    try:
        keys = make_keys("relabel", 2)
        with PoolClient(server.config.socket_path) as writer, PoolClient(server.config.socket_path, direct=True) as r:
            write_chain(writer, keys, PAGE, fill=2)
            r.lookup(keys, PAGE)
            writer.drop(keys)
            assert len(server.index.retired.entries) == 2
            gens, deadline = gens_of_retired(server), time.monotonic() + 1.5
            lease = DIRECT_LEASE_BIT + 1000
            while time.monotonic() < deadline and server.index.retired.entries:
                lease += 1
                for slot, gen in enumerate(gens):
                    set_hold(r._direct._table, slot, gen, lease)
                time.sleep(0.02)
            assert server.index.retired.entries == [], "a hold relabelled by its client outlived its TTL"
    finally:
        server.stop()


def gens_of_retired(server) -> list[int]:
    return [entry.gen for entry in server.index.retired.entries]


def test_a_hold_moved_between_slots_or_named_after_its_page_left_keeps_nothing_past_the_ttl(tmp_path):
    """A client that never leased the pages names their generations (which count up from 1) in fresh slots, one
    slot after another, while they are out of view. Fails when a hold on a page already out of view counts (only a
    hold the pool saw at the page's retirement can have been taken by a reader it did not turn away) and when
    the TTL restarts with each slot."""
    server = start_server(tmp_path, lease_ttl_s=0.3)
    try:
        keys = make_keys("guessed", 3)
        with PoolClient(server.config.socket_path) as writer, PoolClient(server.config.socket_path, direct=True) as r:
            write_chain(writer, keys, PAGE, fill=3)
            gens = gens_of(server, keys)
            set_word(r._direct._table, HWM, 4000)
            for slot, gen in enumerate(gens):  # held before the pages leave: the pool sees these at retirement
                set_hold(r._direct._table, slot, gen)
            writer.drop(keys)
            assert len(server.index.retired.entries) == 3
            deadline, slot = time.monotonic() + 1.5, 3
            while time.monotonic() < deadline and server.index.retired.entries:
                for gen in gens:  # the same generations in slots the pool has not seen them in
                    set_hold(r._direct._table, slot, gen)
                    slot += 1
                time.sleep(0.02)
            assert server.index.retired.entries == [], "holds moved between slots kept pages past the TTL"
    finally:
        server.stop()


def test_eviction_skips_pages_held_directly_instead_of_evicting_the_index(tmp_path):
    """512 pages of 4 KiB fill the arena; a direct reader holds the 256 oldest; one page is reserved. Fails when
    eviction cannot see direct holds: it takes the held pages out of view one round (a barrier and a scan of
    every table) at a time, frees nothing with them, and the index empties before a page comes free."""
    server = start_server(tmp_path, size_bytes=2 << 20, extent_bytes=1 << 20)
    barriers = []
    membarrier = direct_module.membarrier
    try:
        path = server.config.socket_path
        with PoolClient(path) as writer, PoolClient(path, direct=True) as reader:
            chains = [make_keys(f"evict/{c}", 64) for c in range(8)]
            for chain in chains:
                write_chain(writer, chain, PAGE, fill=1)
            held = [reader.lookup(chain, PAGE) for chain in chains[:4]]  # the 256 oldest pages
            assert all(h.lease_id & DIRECT_LEASE_BIT and len(h.pages) == 64 for h in held)
            direct_module.membarrier = lambda cmd: barriers.append(cmd) or membarrier(cmd)
            grant = writer.reserve(b"N" * 16, make_keys("one-more", 1), PAGE)
            direct_module.membarrier = membarrier
            assert len(grant.grants) == 1
            stats = writer.stats()
            assert stats["evictions"] <= 2 and stats["entries"] >= 510, stats
            assert len(barriers) <= 2, f"{len(barriers)} barriers for one page"
            for h in held:
                reader.release([h.lease_id])
    finally:
        direct_module.membarrier = membarrier
        server.stop()


def test_hold_tables_per_uid_are_capped_and_a_client_past_the_cap_takes_the_round_trip(tmp_path):
    """Each table costs the pool two fds and a scan per tick: a uid gets at most MAX_TABLES_PER_UID of them, and
    a client past that is served over the socket. Fails when every hello that asks gets a table."""
    server = start_server(tmp_path)
    clients = []
    try:
        path = server.config.socket_path
        keys = make_keys("capped", 2)
        with PoolClient(path) as writer:
            write_chain(writer, keys, PAGE, fill=1)
            for i in range(MAX_TABLES_PER_UID + 3):
                clients.append(PoolClient(path, name=f"c{i}", direct=True).connect())
            assert sum(c.is_direct for c in clients) == MAX_TABLES_PER_UID
            assert len(server.direct.tables) == MAX_TABLES_PER_UID
            late = clients[-1]
            grant = late.lookup(keys, PAGE)
            assert len(grant.pages) == 2 and not grant.lease_id & DIRECT_LEASE_BIT
            late.release([grant.lease_id])
    finally:
        for client in clients:
            client.close()
        server.stop()


def test_counters_at_their_maximum_leave_the_stats_encodable(server):
    """Two tables' lookup counters at 2**64 - 1: the pool's stats (their sum with its own) must still go out.
    Fails when the pool adds them up unbounded: the reply cannot be encoded and every stats() caller is cut off."""
    path = server.config.socket_path
    with PoolClient(path, direct=True) as a, PoolClient(path, direct=True) as b, PoolClient(path) as plain:
        plain.lookup(make_keys("miss", 1), PAGE)
        for client in (a, b):
            for word in (LOOKUPS, HIT_CHUNKS, MISS_CHUNKS, TOUCHES):
                set_word(client._direct._table, word, 2**64 - 1)
        time.sleep(0.1)  # ticks read the tables (and their touch rings)
        stats = plain.stats()
        assert 0 < stats["lookups"] < 2**63 and stats["direct"]["lookups"] < 2**63
        assert server.serve_thread.is_alive()


def test_a_page_leased_again_and_again_is_held_by_its_latest_lease_past_the_ttl_of_the_first(tmp_path):
    """An honest reader leases one chain for 30 ms at a time, the next lease right after the last release (a hot
    prefix on a busy replica), for twice the TTL: it stores the same generations in the same slots each time, and
    the pool's scans (every 20 ms) see them set. Its last lease must still hold the pages. Fails when the pool
    times a hold by (slot, generation) alone: it takes every lease for the first one, and the dropped pages are
    freed under the last."""
    server = start_server(tmp_path, lease_ttl_s=0.3)
    try:
        keys = make_keys("hot", 3)
        with PoolClient(server.config.socket_path) as writer, PoolClient(server.config.socket_path, direct=True) as r:
            offsets = write_chain(writer, keys, PAGE, fill=4)
            deadline = time.monotonic() + 0.6
            grant = r.lookup(keys, PAGE)
            while time.monotonic() < deadline:
                time.sleep(0.03)
                r.release([grant.lease_id])
                grant = r.lookup(keys, PAGE)
            assert grant.lease_id & DIRECT_LEASE_BIT
            writer.drop(keys)
            assert all(server.allocator.is_allocated(offset, PAGE) for offset in offsets), "freed under the lease"
            r.release([grant.lease_id])
            assert wait_for(lambda: not server.index.retired.entries)
    finally:
        server.stop()
