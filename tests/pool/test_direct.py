"""Direct lookups (kvshare/pool/direct.py): leases without a round trip, and the pages they hold.

Each test runs a pool in a thread of the test process (PoolServer) so it can look at, and in the negative
controls break, the daemon's side.
"""

import contextlib
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from kvshare.pool import direct as direct_module
from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolClient
from kvshare.pool.daemon import PoolConfig, PoolServer
from kvshare.pool.direct_reader import DIRECT_LEASE_BIT
from kvshare.pool.index import IndexConfig
from tests.pool.conftest import MiB, make_keys

NS = b"N" * 16
MB_PAGE = 1 * MiB

pytestmark = pytest.mark.skipif(
    not direct_module.is_supported(), reason="no direct lookups here (x86-64 Linux with membarrier only)"
)


def start_server(
    tmp_path, size_bytes: int = 16 * MiB, extent_bytes: int = 4 * MiB, tick_s: float = 0.02, **index
) -> PoolServer:
    """A pool in a thread of this process (``serve_thread``), ticking every ``tick_s``; no watermark eviction unless
    ``index`` says."""
    config = PoolConfig(
        socket_path=str(tmp_path / "p.sock"),
        size_bytes=size_bytes,
        extent_bytes=extent_bytes,
        hugepages="off",
        tick_s=tick_s,
        index=IndexConfig(**({"high_watermark": 1.0, "low_watermark": 1.0} | index)),
    )
    server = PoolServer(config)
    server.start()
    server.serve_thread = threading.Thread(target=server.serve, daemon=True)
    server.serve_thread.start()
    return server


@pytest.fixture
def server(tmp_path):
    server = start_server(tmp_path)
    yield server
    server.stop()


@contextlib.contextmanager
def writer_and_reader(server: PoolServer):
    """A round-trip client to write with and a direct one to read with, both of the server's pool."""
    path = server.config.socket_path
    with PoolClient(path) as writer, PoolClient(path, direct=True) as reader:
        yield writer, reader


def write_chain(client: PoolClient, keys: list[bytes], page_bytes: int, fill: int) -> list[int]:
    """Reserve, fill (page i with fill + i) and commit ``keys``; returns their offsets."""
    grant = client.reserve(NS, keys, page_bytes)
    assert len(grant.grants) == len(keys)
    offsets = [offset for _index, offset in grant.grants]
    for i, offset in enumerate(offsets):
        client.page(offset, page_bytes)[:] = (fill + i) % 256
    client.commit(grant.reservation_id, [page_checksum(client.page(o, page_bytes)) for o in offsets])
    return offsets


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_a_direct_lease_reads_exactly_the_pages_their_writer_committed(server):
    keys = make_keys("bytes", 8)
    with (
        PoolClient(server.config.socket_path) as writer,
        PoolClient(server.config.socket_path, direct=True, verify_checksums=True) as reader,
    ):
        offsets = write_chain(writer, keys, 4096, fill=7)
        assert reader.is_direct
        grant = reader.lookup(keys, 4096)
        assert grant.lease_id & DIRECT_LEASE_BIT
        by_round_trip = writer.lookup(keys, 4096)
        assert grant.pages == by_round_trip.pages  # offset, size, checksum and its kind: the pool's own answer
        assert [p.offset for p in grant.pages] == offsets
        for i, header in enumerate(grant.pages):
            assert (reader.read_checked(header) == 7 + i).all()
        stats = reader.stats()
        assert stats["direct"]["holds"] == 8 and stats["direct"]["lookups"] == 1
        assert stats["lookups"] == 2 and stats["hit_chunks"] == 16  # the direct lookup is counted with the others
        reader.release([grant.lease_id])
        writer.release([by_round_trip.lease_id])
        assert reader.stats()["direct"]["holds"] == 0


def test_a_chain_that_misses_gets_its_committed_prefix_from_the_directory(server):
    """Without a remote tier a key the directory lacks is a miss, as the pool would answer: the prefix is leased
    with no round trip, and the miss is counted with the pool's."""
    keys = make_keys("prefix", 5)
    with PoolClient(server.config.socket_path) as writer, PoolClient(server.config.socket_path, direct=True) as reader:
        write_chain(writer, keys[:3], 4096, fill=1)
        grant = reader.lookup(keys, 4096)
        assert grant.lease_id & DIRECT_LEASE_BIT and grant.pages == writer.lookup(keys, 4096, lease=False).pages
        assert len(grant.pages) == 3 and reader.stats()["direct"]["holds"] == 3
        assert len(reader._direct._free) == direct_module.DEFAULT_HOLDS - 3  # a hold taken for each page, no more
        reader.release([grant.lease_id])
        nothing = reader.lookup(make_keys("nothing", 2), 4096)
        assert nothing.lease_id == 0 and nothing.pages == []
        assert len(reader.lookup(keys, 8192).pages) == 0  # pages of another size: a miss too
        stats = reader.stats()
        assert stats["direct"]["lookups"] == 3 and stats["direct"]["miss_chunks"] == 2 + 2 + 5
        assert stats["miss_chunks"] == stats["direct"]["miss_chunks"] + 2  # and the round-trip lookup's two


def test_a_committed_page_the_directory_could_not_place_is_found_by_the_pool(tmp_path, monkeypatch):
    """A directory of one bucket (4 slots): the fifth page of a chain is committed but not in it. The lookup must
    go to the pool, which has it. Fails when a key the directory lacks counts as a miss whatever its header says
    (the reader gets 4 of 5 pages)."""
    monkeypatch.setattr(direct_module, "directory_slots", lambda arena_bytes: direct_module.BUCKET_SLOTS)
    server = start_server(tmp_path)
    try:
        keys = make_keys("unplaced", 5)
        with writer_and_reader(server) as (writer, reader):
            write_chain(writer, keys, 4096, fill=8)
            assert reader.stats()["direct"]["unpublished"] == 1
            grant = reader.lookup(keys, 4096)
            assert len(grant.pages) == 5 and not grant.lease_id & DIRECT_LEASE_BIT
            reader.release([grant.lease_id])
            writer.drop(keys[4:])  # the unplaced entry leaves: misses are sure again
            grant = reader.lookup(keys, 4096)
            assert len(grant.pages) == 4 and grant.lease_id & DIRECT_LEASE_BIT
            reader.release([grant.lease_id])
    finally:
        server.stop()


def test_direct_leases_are_listed_with_their_holder(server):
    """`kvshare pool-admin leases` shows a page pinned through the directory too. Fails when only the pool's own
    leases are listed (the list is empty while the direct lease holds its pages)."""
    keys = make_keys("listed", 3)
    path = server.config.socket_path
    with PoolClient(path) as writer, PoolClient(path, name="direct-reader", direct=True) as reader:
        write_chain(writer, keys, 4096, fill=1)
        grant = reader.lookup(keys, 4096)
        (info,) = writer.list_leases()
        assert (info.lease_id, info.client_name, info.num_pages) == (grant.lease_id, "direct-reader", 3)
        assert info.age_s >= 0
        reader.release([grant.lease_id])
        assert writer.list_leases() == []


def fill_then_take_over(server: PoolServer, how: str) -> tuple[set[int], set[int], bool]:
    """A reader holds 4 pages of a chain that fills the arena, directly; the chain leaves view (``how``) and
    another writer takes every page it can get. Returns (held offsets, offsets the writer got, whether the held
    pages still hold what their writer committed)."""
    path = server.config.socket_path
    keys, others = make_keys(f"a-{how}", 16), make_keys(f"b-{how}", 16)
    with PoolClient(path) as writer, PoolClient(path, direct=True) as reader:
        write_chain(writer, keys, MB_PAGE, fill=1)
        held = reader.lookup(keys[:4], MB_PAGE)
        assert held.lease_id & DIRECT_LEASE_BIT
        if how == "drop":
            assert writer.drop(keys) == 16
        elif how == "flush":
            assert writer.flush(NS) == 16
        taken = writer.reserve(NS, others, MB_PAGE)  # "evict": the reserve evicts the chain to make room
        for _index, offset in taken.grants:
            writer.page(offset, MB_PAGE)[:] = 0xEE  # what another writer would put there
        intact = all((reader.read_checked(p) == 1 + i).all() for i, p in enumerate(held.pages))
        got = {offset for _index, offset in taken.grants}
        writer.abort(taken.reservation_id)
        reader.release([held.lease_id])
        return {p.offset for p in held.pages}, got, intact


@pytest.mark.parametrize("how", ["drop", "flush", "evict"])
def test_a_page_held_directly_is_never_handed_to_another_writer(server, how):
    """Fails with the pool's barrier-and-scan broken (the negative control below: the writer gets the held pages)."""
    held, got, intact = fill_then_take_over(server, how)
    assert not held & got and intact
    assert len(got) == 12  # every page but the four held
    assert wait_for(lambda: server.index.retired.entries == [])  # freed once the hold ended
    server.index.check_integrity()


def test_negative_control_without_the_barrier_and_scan_the_writer_overwrites_a_held_page(server, monkeypatch):
    """The scenario above with the pool's guard broken (every retired page freed at once): the writer gets the
    held pages and the reader's bytes change under it, so the test above can fail."""
    monkeypatch.setattr(server.direct, "unheld", lambda entries, now=None: list(entries))
    held, got, intact = fill_then_take_over(server, "drop")
    assert held <= got and not intact


def test_an_entry_that_leaves_while_its_hold_is_taken_is_not_leased(server):
    """The reader has read the slots but not yet written its holds when the chain's page 3 is dropped (the pool
    then finds no hold and frees the page): the reader sees the slot change and asks the pool instead. Fails
    without the reader's second read of the sequence numbers (it leases the freed page)."""
    keys = make_keys("race", 6)
    path = server.config.socket_path
    with PoolClient(path) as writer, PoolClient(path, direct=True) as reader:
        offsets = write_chain(writer, keys, 4096, fill=3)
        dropped = []

        class FreeHoldsThatDrop(list):  # the reader takes its free holds between reading the slots and writing them
            def pop(self):
                if not dropped:
                    dropped.append(writer.drop(keys[3:4]))
                return super().pop()

        reader._direct._free = FreeHoldsThatDrop(reader._direct._free)
        grant = reader.lookup(keys, 4096)
        assert dropped == [1]
        assert not server.allocator.is_allocated(offsets[3], 4096)  # a lease on it would read a free page
        assert not grant.lease_id & DIRECT_LEASE_BIT and len(grant.pages) == 3  # the pool's answer: the prefix
        assert reader.stats()["direct"]["holds"] == 0  # the abandoned holds were cleared
        reader.release([grant.lease_id])


CHILD = textwrap.dedent(
    """
    import sys, time
    from kvshare.pool.client import PoolClient
    from tests.pool.conftest import make_keys
    client = PoolClient(sys.argv[1], direct=True).connect()
    grant = client.lookup(make_keys("child", 4), 4096)
    print(grant.lease_id, flush=True)
    time.sleep(600)
    """
)


def test_the_holds_of_a_killed_process_end_and_free_their_pages(server):
    """Fails when the pool keeps reading the table of a holder that is gone (the pages stay pinned)."""
    path = server.config.socket_path
    keys = make_keys("child", 4)
    with PoolClient(path) as writer:
        write_chain(writer, keys, 4096, fill=5)
        used = writer.stats()["used_bytes"]
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        child = subprocess.Popen([sys.executable, "-c", CHILD, path], stdout=subprocess.PIPE, env=env, text=True)
        try:
            assert int(child.stdout.readline()) & DIRECT_LEASE_BIT
            writer.drop(keys)
            time.sleep(0.1)  # ticks pass: the child lives, its holds keep the pages
            assert len(server.index.retired.entries) == 4 and writer.stats()["used_bytes"] == used
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        assert wait_for(lambda: writer.stats()["used_bytes"] == used - 4 * 4096)
        assert server.index.retired.entries == []


def test_a_hold_past_its_ttl_no_longer_keeps_its_page(tmp_path):
    """A reader that hung: its hold counts for a lease's TTL, timed by the pool from when it first saw it."""
    server = start_server(tmp_path, lease_ttl_s=0.3)
    try:
        keys = make_keys("ttl", 2)
        with writer_and_reader(server) as (writer, reader):
            write_chain(writer, keys, 4096, fill=9)
            reader.lookup(keys, 4096)  # never released: a reader that hung
            writer.drop(keys)
            assert len(server.index.retired.entries) == 2
            assert wait_for(lambda: server.index.retired.entries == [], timeout_s=3)
    finally:
        server.stop()


def test_a_client_made_after_a_timeout_releases_what_the_one_before_leased_directly(server):
    """A PoolLink makes a new client with the same holder token after a timeout; the leases taken before are its."""
    keys, token = make_keys("relink", 3), os.urandom(16)
    with PoolClient(server.config.socket_path) as writer:
        write_chain(writer, keys, 4096, fill=2)
        first = PoolClient(server.config.socket_path, holder=token, direct=True).connect()
        grant = first.lookup(keys, 4096)
        first.close(end_holds=False)  # what a timeout does: the copies may still run
        assert writer.stats()["direct"]["holds"] == 3
        with PoolClient(server.config.socket_path, holder=token, direct=True) as second:
            second.release([grant.lease_id])
            assert second.stats()["direct"]["holds"] == 0


def test_a_holder_the_pool_forgot_gets_a_new_table_and_its_holds_there_count(server):
    """A client leaves with no holds (the pool forgets its holder and closes its table); a client of the same token
    then gets a new table. Fails when the process keeps writing into the mapping of the old one (map_direct keyed by
    token alone): the pool never sees those holds and frees the pages under them."""
    keys, token = make_keys("forgot", 3), os.urandom(16)
    with PoolClient(server.config.socket_path) as writer:
        write_chain(writer, keys, 4096, fill=6)
        first = PoolClient(server.config.socket_path, holder=token, direct=True).connect()
        first.release([first.lookup(keys, 4096).lease_id])
        first.close(end_holds=False)
        assert wait_for(lambda: not server.direct.tables)  # forgotten: its table is closed
        with PoolClient(server.config.socket_path, holder=token, direct=True) as second:
            grant = second.lookup(keys, 4096)
            assert grant.lease_id & DIRECT_LEASE_BIT
            writer.drop(keys)
            assert len(server.index.retired.entries) == 3  # the pool sees the holds: the pages stay
            second.release([grant.lease_id])
        assert wait_for(lambda: server.index.retired.entries == [])


def test_garbage_in_a_hold_table_pins_nothing_real_and_the_pool_serves_on(server):
    keys = make_keys("garbage", 4)
    with PoolClient(server.config.socket_path) as writer, PoolClient(server.config.socket_path, direct=True) as vandal:
        write_chain(writer, keys, 4096, fill=4)
        table = vandal._direct._table
        table[:] = np.random.default_rng(0).integers(0, 256, len(table), dtype=np.uint8).tobytes()
        table[:8] = (2**64 - 1).to_bytes(8, "little")  # a "holds in use" far past the table's end
        time.sleep(0.1)  # ticks read the table's touches and holds
        assert writer.drop(keys) == 4
        assert wait_for(lambda: server.index.retired.entries == [])
        stats = writer.stats()
        assert stats["used_bytes"] == 0 and stats["direct"]["holds"] >= 0
        assert writer.check_integrity() == 0


def test_no_client_can_write_the_directory(server):
    """Fails without F_SEAL_FUTURE_WRITE: a client could point any key at pages of its choosing."""
    fd, size = server.direct.fd, server.direct.num_slots * direct_module.SLOT_WORDS * 8
    with pytest.raises(PermissionError):
        mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)


def test_pages_read_directly_stay_recent_in_the_eviction_order(server):
    path = server.config.socket_path
    old, new = make_keys("old", 8), make_keys("new", 8)
    with PoolClient(path) as writer, PoolClient(path, direct=True) as reader:
        write_chain(writer, old, MB_PAGE, fill=1)
        write_chain(writer, new, MB_PAGE, fill=2)  # the arena is full; "old" is the older chain
        reader.release([reader.lookup(old, MB_PAGE).lease_id])
        time.sleep(0.1)  # a tick moves what was read to the recent end
        grant = writer.reserve(NS, make_keys("third", 4), MB_PAGE)  # evicts four pages
        writer.abort(grant.reservation_id)
        assert writer.lookup(old, MB_PAGE).pages.__len__() == 8  # "new" lost its tail, not "old"
        assert len(writer.lookup(new, MB_PAGE).pages) == 4


def test_without_membarrier_the_pool_offers_no_directory_and_lookups_take_the_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_module, "membarrier", lambda cmd: False)
    server = start_server(tmp_path)
    try:
        assert server.direct is None
        keys = make_keys("plain", 2)
        with writer_and_reader(server) as (writer, reader):
            write_chain(writer, keys, 4096, fill=1)
            assert not reader.is_direct
            grant = reader.lookup(keys, 4096)
            assert not grant.lease_id & DIRECT_LEASE_BIT and len(grant.pages) == 2
    finally:
        server.stop()


def test_a_forked_child_never_writes_its_parents_hold_table(pool):
    """A process that holds a direct client forks; the child looks up through the inherited client while the
    parent holds a lease. Fails when the child uses the parent's hold table with its own copy of the free-hold
    list: it stores its hold in the slot of the parent's, and the parent's pages are freed under its lease."""
    parent_keys, child_keys = make_keys("fork-parent", 2), make_keys("fork-child", 2)
    with PoolClient(pool) as writer:
        write_chain(writer, parent_keys, 4096, fill=1)
        write_chain(writer, child_keys, 4096, fill=2)
        parent = PoolClient(pool, direct=True).connect()
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: wait until the parent holds its lease, look up through the inherited client
            code = 1
            try:
                os.read(go_r, 1)
                parent.lookup(child_keys, 4096)
                code = 0
            except BaseException:  # a refusal (the client is its parent's) is as good
                code = 0
            finally:
                os._exit(code)
        grant = parent.lookup(parent_keys, 4096)
        assert grant.lease_id & DIRECT_LEASE_BIT
        os.write(go_w, b"x")
        assert os.waitpid(pid, 0)[1] == 0
        writer.drop(parent_keys)
        direct = writer.stats()["direct"]
        assert direct["retired_pages"] == 2, "the parent's held pages were freed (its holds were overwritten)"
        parent.release([grant.lease_id])
        assert wait_for(lambda: writer.stats()["direct"]["retired_pages"] == 0)
        parent.close()
        os.close(go_r)
        os.close(go_w)
