"""The daemon's message handlers driven directly: no socket, no process, a fake clock and a fake remote tier."""

import hashlib
import subprocess

import pytest

from kvshare.pool import protocol as P
from kvshare.pool.allocator import Allocator
from kvshare.pool.handlers import PoolHandlers, ServerCounters
from kvshare.pool.index import IndexConfig, PoolError, PoolIndex
from kvshare.pool.remote import RemoteHooks
from kvshare.pool.remote.tier import RemoteTier

MiB = 1 << 20
PAGE = 1 * MiB
NS = b"n" * 16


def keys(tag, n):
    return [hashlib.blake2b(f"{tag}{i}".encode(), digest_size=16).digest() for i in range(n)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeRemote:
    """Records what the handlers ask of the tier; ``promote`` defers while ``is_promoting``."""

    def __init__(self, is_promoting: bool = True) -> None:
        self.is_promoting = is_promoting
        self.calls: list[tuple] = []
        self.on_done = []
        self.in_copy: set[int] = set()  # reservations a worker thread may still write

    def on_reserve(self, client_id, reservation_id, entries):
        self.calls.append(("reserve", client_id, reservation_id, len(entries)))

    def on_commit(self, reservation_id):
        self.calls.append(("commit", reservation_id))

    def on_abort(self, reservation_id):
        self.calls.append(("abort", reservation_id))

    def on_disconnect(self, client_id):
        self.calls.append(("disconnect", client_id))

    def promote(self, keys, page_bytes, num_local, on_done):
        self.calls.append(("promote", len(keys), num_local))
        if self.is_promoting:
            self.on_done.append(on_done)
        return self.is_promoting

    def on_prefill(self, namespace, page_bytes, num_chunks, seconds):
        self.calls.append(("prefill", page_bytes, num_chunks, seconds))

    def tick(self, now):
        self.calls.append(("tick", now))

    def reservations_in_copy(self):
        return self.in_copy

    def stats(self):
        return {"promotions": len(self.on_done)}


def make(pages=16, remote=None, **cfg):
    answers = []
    clock = Clock()
    index = PoolIndex(Allocator(pages * PAGE, 4 * PAGE), IndexConfig(**cfg))
    handlers = PoolHandlers(index, ServerCounters(), lambda client_id, reply: answers.append((client_id, reply)), clock)
    handlers.remote = remote
    return handlers, answers, clock


def exited_pid() -> int:
    """The pid of a process that has exited and been reaped: a peer known to be gone."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def greet(handlers, client_id, name="test", pid=0):
    handlers.connect(client_id, pid=pid)
    return handlers.hello(client_id, P.Hello(protocol_version=P.PROTOCOL_VERSION, client_name=name))


def store(handlers, client_id, ks, checksums=None):
    reserved = handlers.handle(client_id, P.Reserve(namespace=NS, keys=ks, page_bytes=PAGE))
    checksums = checksums or list(range(1, len(ks) + 1))
    assert handlers.handle(client_id, P.Commit(reservation_id=reserved.reservation_id, checksums=checksums)) == P.Ok(
        count=len(ks)
    )
    return reserved


def test_reserve_commit_lookup_release():
    handlers, answers, _ = make()
    hello = greet(handlers, 1, "writer")
    assert hello.client_id == 1 and hello.arena_bytes == 16 * PAGE and hello.extent_bytes == 4 * PAGE
    ks = keys("a", 3)
    reserved = handlers.handle(1, P.Reserve(namespace=NS, keys=ks, page_bytes=PAGE))
    assert isinstance(reserved, P.ReserveReply) and [i for i, _ in reserved.grants] == [0, 1, 2]
    assert reserved.num_no_room == 0
    assert handlers.handle(1, P.Lookup(keys=ks, page_bytes=PAGE)).pages == []  # invisible until commit
    assert handlers.handle(1, P.Commit(reservation_id=reserved.reservation_id, checksums=[11, 12, 13])) == P.Ok(count=3)

    found = handlers.handle(2, P.Lookup(keys=ks, page_bytes=PAGE))
    offsets = [offset for _, offset in reserved.grants]
    assert [(p.offset, p.checksum) for p in found.pages] == list(zip(offsets, [11, 12, 13]))
    assert found.lease_id and handlers.index.num_leases == 1
    assert handlers.handle(2, P.Release(lease_ids=[found.lease_id])) == P.Ok(count=1)
    assert handlers.index.num_leases == 0
    assert handlers.handle(1, P.CheckIntegrity()) == P.Ok(count=3)
    assert answers == []  # nothing was deferred


def test_bad_messages_are_answered_with_errors_and_change_nothing():
    handlers, _, _ = make()
    greet(handlers, 1)
    store(handlers, 1, keys("a", 2))
    assert handlers.handle(1, P.Commit(reservation_id=12345, checksums=[0])).code == "unknown_reservation"
    assert handlers.handle(1, P.Lookup(keys=[b"short"], page_bytes=PAGE)).code == "bad_key"
    assert handlers.handle(1, P.Reserve(namespace=b"bad", keys=keys("b", 1), page_bytes=PAGE)).code == "bad_namespace"
    assert handlers.handle(1, P.Release(lease_ids=[999])).code == "unknown_lease"
    assert (
        handlers.handle(1, P.Hello(protocol_version=P.PROTOCOL_VERSION)).code == "unexpected"
    )  # only the first message
    assert handlers.handle(1, P.Release(lease_ids=[999], reply=False)) is None  # fire-and-forget: counted instead
    assert handlers.counters.errors == 1
    assert handlers.index.num_entries == 2 and handlers.index.num_writing == 0
    assert handlers.handle(1, P.CheckIntegrity()) == P.Ok(count=2)


def test_a_first_message_other_than_a_good_hello_is_refused():
    handlers, _, _ = make()
    handlers.connect(1)
    with pytest.raises(PoolError) as err:
        handlers.hello(1, P.GetStats())
    assert err.value.code == "hello_required"
    with pytest.raises(PoolError) as err:
        handlers.hello(1, P.Hello(protocol_version=P.PROTOCOL_VERSION + 1))
    assert err.value.code == "version_mismatch"
    assert handlers.name_of(1) == ""


def test_disconnect_aborts_reservations_and_releases_leases():
    handlers, _, _ = make()
    greet(handlers, 1, "reader", pid=exited_pid())  # its process is gone: its holds end with the connection
    store(handlers, 1, keys("a", 2))
    lease = handlers.handle(1, P.Lookup(keys=keys("a", 2), page_bytes=PAGE))
    handlers.handle(1, P.Reserve(namespace=NS, keys=keys("b", 3), page_bytes=PAGE))
    listed = handlers.handle(9, P.ListLeases())
    rows = [(info.lease_id, info.client_name, info.num_pages) for info in listed.leases]
    assert rows == [(lease.lease_id, "reader", 2)]
    assert handlers.stats()["clients"] == 1
    assert handlers.disconnect(1) == (1, 1)
    assert handlers.index.num_leases == 0 and handlers.index.num_writing == 0
    assert handlers.stats()["clients"] == 0


def test_tick_expires_leases_and_stats_count_everything():
    handlers, _, clock = make(lease_ttl_s=10.0)
    greet(handlers, 1)
    store(handlers, 1, keys("a", 2))
    handlers.handle(1, P.Lookup(keys=keys("a", 2), page_bytes=PAGE))
    clock.now += 11.0
    handlers.tick(clock.now)
    stats = handlers.handle(1, P.GetStats()).stats
    assert stats["leases"] == 0 and stats["expired_leases"] == 1
    assert stats["entries"] == 2 and stats["committed_pages"] == 2 and stats["used_bytes"] == 2 * PAGE
    assert stats["uptime_s"] == 11.0 and "remote" not in stats


def test_remote_hooks_see_reserve_commit_abort_and_disconnect():
    remote = FakeRemote()
    handlers, _, _ = make(remote=remote)
    greet(handlers, 1, pid=exited_pid())
    first = store(handlers, 1, keys("a", 2))
    second = handlers.handle(1, P.Reserve(namespace=NS, keys=keys("b", 1), page_bytes=PAGE))
    handlers.handle(1, P.Abort(reservation_id=second.reservation_id))
    handlers.disconnect(1)
    assert remote.calls == [
        ("reserve", 1, first.reservation_id, 2),
        ("commit", first.reservation_id),
        ("reserve", 1, second.reservation_id, 1),
        ("abort", second.reservation_id),
        ("disconnect", 1),
    ]
    assert handlers.stats()["remote"] == {"promotions": 0}


def test_a_partial_hit_is_deferred_to_the_remote_tier_and_answered_later():
    remote = FakeRemote()
    handlers, answers, _ = make(remote=remote)
    greet(handlers, 1)
    ks = keys("a", 4)
    store(handlers, 1, ks[:2])
    assert handlers.handle(2, P.Lookup(keys=ks, page_bytes=PAGE)) is None  # deferred: no reply now
    assert handlers.is_deferred(2) and remote.calls[-1] == ("promote", 4, 2)
    assert handlers.index.num_leases == 1  # the local prefix is pinned meanwhile
    store(handlers, 1, ks[2:], [7, 8])  # what the tier would have promoted
    remote.on_done.pop()()
    assert not handlers.is_deferred(2)
    [(client_id, reply)] = answers
    assert client_id == 2 and [p.checksum for p in reply.pages] == [1, 2, 7, 8]
    assert handlers.index.num_leases == 1  # the pin went, the answer's own lease stays
    assert handlers.stats()["lookups"] == 1  # the deferred answer is not a second lookup
    assert handlers.handle(2, P.Release(lease_ids=[reply.lease_id])) == P.Ok(count=1)


def test_a_full_hit_a_busy_tier_and_a_client_that_left_are_not_deferred():
    remote = FakeRemote(is_promoting=False)
    handlers, answers, _ = make(remote=remote)
    greet(handlers, 1)
    ks = keys("a", 3)
    store(handlers, 1, ks[:2])
    assert len(handlers.handle(2, P.Lookup(keys=ks[:2], page_bytes=PAGE)).pages) == 2  # whole: the tier is not asked
    assert len(handlers.handle(2, P.Lookup(keys=ks, page_bytes=PAGE)).pages) == 2  # the tier declined: the local answer
    assert [c for c in remote.calls if c[0] == "promote"] == [("promote", 3, 2)]
    remote.is_promoting = True
    greet(handlers, 3)
    assert handlers.handle(3, P.Lookup(keys=ks, page_bytes=PAGE)) is None
    handlers.disconnect(3)
    remote.on_done.pop()()  # the promotion ends after the client left: nobody is answered
    assert answers == [] and not handlers.is_deferred(3)


def test_the_remote_tier_implements_every_hook():
    hooks = [name for name, value in vars(RemoteHooks).items() if callable(value) and not name.startswith("_")]
    assert set(hooks) == {
        "on_reserve",
        "on_commit",
        "on_abort",
        "on_disconnect",
        "promote",
        "on_prefill",
        "poll",
        "tick",
        "reservations_in_copy",
        "stats",
        "close",
    }
    assert all(callable(getattr(RemoteTier, name, None)) for name in hooks)


def test_a_prefill_report_goes_to_the_tier_and_a_bad_one_is_refused():
    remote = FakeRemote()
    handlers, _, _ = make(remote=remote)
    greet(handlers, 1)
    assert handlers.handle(1, P.PrefillReport(namespace=bytes(16), page_bytes=PAGE, num_chunks=8, seconds=0.5)) == P.Ok(
        count=1
    )
    assert remote.calls[-1] == ("prefill", PAGE, 8, 0.5)
    for bad in (
        P.PrefillReport(namespace=b"short", page_bytes=PAGE, num_chunks=8, seconds=0.5),
        P.PrefillReport(namespace=bytes(16), page_bytes=PAGE, num_chunks=0, seconds=0.5),
        P.PrefillReport(namespace=bytes(16), page_bytes=PAGE, num_chunks=8, seconds=0.0),
        P.PrefillReport(namespace=bytes(16), page_bytes=PAGE, num_chunks=8, seconds=float("nan")),
    ):
        assert handlers.handle(1, bad).code == "bad_report"
    plain, _, _ = make()
    greet(plain, 1)
    assert plain.handle(1, P.PrefillReport(namespace=bytes(16), page_bytes=PAGE, num_chunks=8, seconds=0.5)) == P.Ok(
        count=0
    )  # no tier: nothing to weigh
