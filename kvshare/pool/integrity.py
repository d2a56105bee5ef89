"""The index's integrity check (index against allocator, leases, reservations and quota), as a resumable pass.

A friend of PoolIndex (``index`` below; not imported: index.py imports this
module): it reads the index's private maps and changes nothing. The
pass yields after every item it checks, so the daemon can run it a bounded number
of items per idle loop turn (an unbounded pass over 200k pages took 0.41 s).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvshare.pool.entries import Entry, EntryState


def integrity_steps(index, max_items: int) -> Iterator[int]:
    """PoolIndex.check_integrity cut into steps: yields after each ``max_items`` items checked (entries, lease and
    reservation entries, extents), with how many, so a pass over any number of pages costs its caller a bounded
    amount of work at a time. Raises AssertionError as the whole check does, at the step that finds it.

    The index must not change between steps (the iterators over its dicts would be stale): a caller that lets
    requests in between drops the pass and starts a new one.
    """
    num_checked = 0
    for _ in integrity_items(index):
        num_checked += 1
        if num_checked >= max_items:
            yield num_checked
            num_checked = 0
    yield num_checked


def integrity_items(index) -> Iterator[None]:
    """The checks of PoolIndex.check_integrity, yielding after each item checked."""
    yield from index.allocator.integrity_items()
    leased: dict[int, int] = {}
    for lease in index._leases.values():
        for entry in lease.entries:
            leased[id(entry)] = leased.get(id(entry), 0) + 1
            yield
    writing: set[int] = set()
    for reservation in index._reservations.values():
        for entry in reservation.entries:
            writing.add(id(entry))
            yield
    live_pages = 0
    num_committed = num_states = state_bytes = 0
    held: dict[bytes, int] = {}  # bytes per namespace, for the quota
    for key, entry in index._entries.items():
        yield
        assert entry.key == key
        assert not entry.is_dropped
        assert index.allocator.is_allocated(entry.offset, entry.page_bytes), f"entry page {entry.offset} not allocated"
        assert entry.num_leases == leased.get(id(entry), 0), "lease count disagrees with leases"
        if entry.state is EntryState.COMMITTED:
            assert key in index._lru and id(entry) not in writing
            num_committed += 1
            num_states += entry.is_state
            state_bytes += entry.page_bytes if entry.is_state else 0
        else:
            assert key not in index._lru and id(entry) in writing
            assert entry.num_leases == 0, "a writing entry is leased"
        live_pages += entry.page_bytes
        held[entry.quota_owner] = held.get(entry.quota_owner, 0) + entry.page_bytes
    assert len(index._lru) == num_committed
    assert (index.num_states, index.state_bytes) == (num_states, state_bytes), "state checkpoint counts disagree"
    dropped: dict[int, Entry] = {}
    for lease in index._leases.values():
        for entry in lease.entries:
            if entry.is_dropped and id(entry) not in dropped:
                dropped[id(entry)] = entry
                held[entry.quota_owner] = held.get(entry.quota_owner, 0) + entry.page_bytes
            yield
    for entry in index.retired.entries:  # out of view, page kept for a direct hold
        assert not entry.num_leases and index.allocator.is_allocated(entry.offset, entry.page_bytes)
        live_pages += entry.page_bytes
        held[entry.quota_owner] = held.get(entry.quota_owner, 0) + entry.page_bytes
        yield
    index.quota.check_held(held)
    for entry in dropped.values():
        assert index.allocator.is_allocated(entry.offset, entry.page_bytes)
        live_pages += entry.page_bytes
    used_bytes = index.allocator.used_bytes
    assert live_pages == used_bytes, f"{live_pages} bytes in entries, allocator says {used_bytes}"
