"""Which committed entries eviction takes, oldest first: a pure function of the index's records."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvshare.pool.entries import Entry, Lease, Reservation


def victims(
    lru: Iterable[Entry],
    leases: Iterable[Lease],
    reservations: Iterable[Reservation],
    extent_bytes: int,
    page_bytes: int = 0,
    held_gens: frozenset[int] | set[int] = frozenset(),
) -> Iterator[list[Entry]]:
    """Groups of entries to evict, in LRU order (``lru`` oldest first); never a leased one, nor one whose
    generation a direct hold names (``held_gens``: its page would stay allocated while read, so evicting it
    frees nothing now).

    Each unheld entry alone, except when the room is for pages of ``page_bytes`` (a reserve): then an
    entry of another size goes only with every entry of its extent, and only from an extent where no page
    is held or being written. Only a whole free extent takes pages of another size, so evicting part of
    a held extent would give up that model's cache for nothing.
    """
    by_extent: dict[int, list[Entry]] | None = None  # built at the first entry of another size
    for entry in lru:
        if entry.num_leases or entry.gen in held_gens:
            continue
        if not page_bytes or entry.page_bytes == page_bytes:
            yield [entry]
            continue
        if by_extent is None:
            by_extent = unheld_extents(lru, leases, reservations, extent_bytes, held_gens)
        group = by_extent.pop(entry.offset // extent_bytes, None)  # None: held, or emptied already
        if group:
            yield group


def unheld_extents(
    lru: Iterable[Entry],
    leases: Iterable[Lease],
    reservations: Iterable[Reservation],
    extent_bytes: int,
    held_gens: frozenset[int] | set[int] = frozenset(),
) -> dict[int, list[Entry]]:
    """Extent index -> its committed entries, for every extent where no page is held or being written."""
    held = {e.offset // extent_bytes for lease in leases for e in lease.entries}
    held |= {e.offset // extent_bytes for r in reservations for e in r.entries}
    held |= {e.offset // extent_bytes for e in lru if e.gen in held_gens}
    by_extent: dict[int, list[Entry]] = {}
    for entry in lru:
        by_extent.setdefault(entry.offset // extent_bytes, []).append(entry)
    return {extent: entries for extent, entries in by_extent.items() if extent not in held}
