"""The quota: bytes each owner holds, and what a reserve may add.

The owner of a page is the account its writer named (a digest of the tenant identity,
without the request's cache_salt), else its namespace (a model and tenant salt). A
namespace digest includes the client-chosen cache_salt, so only an account keeps a
tenant from holding a quota per salt; a writer that names none is charged per
namespace. An owner holds the bytes of its writing and committed entries, and of dropped
entries still leased (their pages are not free yet): a page leaves its namespace
when the allocator gets it back. With a quota, one owner may hold at most
``quota_bytes``: a reserve over it first evicts that owner's own least
recently used entries (never another's, never a leased one, never the chain
being stored: evicting its head would strand the pages written after it), and
grants fewer pages when that is not enough, keeping the chain's first pages (a
chain is only useful from its start)::

    to evict   held + num_wanted * page_bytes - quota_bytes   (bytes; <= 0: it fits)
    granted    num_wanted - num_over, num_over = num_wanted - (quota_bytes - held) // page_bytes

Pure bookkeeping: the index removes the entries ``victims`` names and counts them.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvshare.pool.entries import Entry, EntryState


class NamespaceQuota:
    """Arena bytes per owner (account or namespace), against a quota of ``quota_bytes`` each (0: no quota)."""

    def __init__(self, quota_bytes: int) -> None:
        self.quota_bytes = quota_bytes
        self._held: dict[bytes, int] = {}  # only owners that hold pages

    @property
    def is_limited(self) -> bool:
        return self.quota_bytes > 0

    def __len__(self) -> int:
        return len(self._held)

    def held(self, owner: bytes) -> int:
        return self._held.get(owner, 0)

    def add(self, owner: bytes, num_bytes: int) -> None:
        self._held[owner] = self.held(owner) + num_bytes

    def remove(self, owner: bytes, num_bytes: int) -> None:
        left = self._held[owner] - num_bytes
        if left:
            self._held[owner] = left
        else:
            del self._held[owner]

    def victims(self, owner: bytes, chain: set[bytes], num_bytes: int, lru: Iterable[Entry]) -> list[Entry]:
        """What to evict, oldest first, so that ``num_bytes`` more fit (fewer when not enough are evictable)."""
        needed = self.held(owner) + num_bytes - self.quota_bytes
        chosen = []
        for entry in lru:
            if needed <= 0:
                break
            if entry.quota_owner == owner and entry.num_leases == 0 and entry.key not in chain:
                chosen.append(entry)
                needed -= entry.page_bytes
        return chosen

    def num_over(self, owner: bytes, num_wanted: int, page_bytes: int) -> int:
        """How many of ``num_wanted`` pages would take the owner over its quota."""
        room = max(0, self.quota_bytes - self.held(owner)) // page_bytes
        return max(0, num_wanted - room)

    def rows(self, committed: Iterable[Entry]) -> list[tuple[bytes, int, int]]:
        """(owner, committed entries, bytes held) of every owner that holds pages, largest first."""
        counts: dict[bytes, int] = {}
        for entry in committed:
            counts[entry.quota_owner] = counts.get(entry.quota_owner, 0) + 1
        rows = [(ns, counts.get(ns, 0), num_bytes) for ns, num_bytes in self._held.items()]
        return sorted(rows, key=lambda row: -row[2])

    def check_integrity(self, live: Iterable[Entry]) -> None:
        """Raise AssertionError unless the bytes held are those of ``live`` (every entry whose page is not free)."""
        by_owner: dict[bytes, int] = {}
        for entry in live:
            by_owner[entry.quota_owner] = by_owner.get(entry.quota_owner, 0) + entry.page_bytes
        self.check_held(by_owner)

    def check_held(self, by_owner: dict[bytes, int]) -> None:
        """Raise AssertionError unless ``by_owner`` (bytes of the live entries, summed by the caller) is held."""
        assert by_owner == self._held, "bytes per owner disagree with the entries"


def namespace_rows(entries: Iterable[Entry]) -> list[tuple[bytes, int, int]]:
    """(namespace, committed entries, bytes held) of every namespace that holds pages, largest first: by namespace,
    whatever account a quota charges them to (an account may span namespaces)."""
    rows: dict[bytes, tuple[int, int]] = {}
    for entry in entries:
        num, held = rows.get(entry.namespace, (0, 0))
        rows[entry.namespace] = (num + (entry.state is EntryState.COMMITTED), held + entry.page_bytes)
    return sorted(((ns, num, held) for ns, (num, held) in rows.items()), key=lambda row: -row[2])
