"""Entries out of view whose pages stay allocated while a direct hold may still read them (direct.py).

The index retires an entry when it leaves view (eviction, drop, flush) and its
leases have ended. Without the directory, or for an entry never published there,
the page is freed at once; else ``settle`` frees it once no live direct hold names
the entry's generation (after the barrier that makes every hold taken before the
entry left visible to the pool).
"""

from __future__ import annotations

from collections.abc import Callable

from kvshare.pool.entries import Entry


class RetiredPages:
    def __init__(self, free: Callable[[Entry], None]) -> None:
        self.direct = None  # direct.DirectTables where clients may lease without a round trip
        self.entries: list[Entry] = []  # retired, page still allocated
        self._free = free

    def published(self, entries: list[Entry]) -> None:
        if self.direct is not None:
            self.direct.publish(entries)

    def unpublished(self, entry: Entry) -> None:
        if self.direct is not None:
            self.direct.unpublish(entry)

    def retire(self, entry: Entry) -> int:
        """Free the page now, or keep it for settle; returns the bytes kept."""
        if self.direct is None or not entry.gen:
            self._free(entry)
            return 0
        self.entries.append(entry)
        return entry.page_bytes

    def seal(self, holder_id: int) -> int:
        """The holder's live direct holds, its hold table closed to new ones first (direct.DirectTables.seal): while
        it has any, its copies may still read and holders.py keeps it; with none it may be forgotten."""
        return 0 if self.direct is None else self.direct.seal(holder_id)

    def held_gens(self) -> set[int]:
        """Generations a direct hold names now: pages eviction would take out of view and not free."""
        return set() if self.direct is None else self.direct.held_gens()

    def settle(self) -> int:
        """Free the pages of retired entries that no direct hold names any more; returns how many."""
        if not self.entries:
            return 0
        unheld = {id(entry) for entry in self.direct.unheld(self.entries)}
        for entry in self.entries:
            if id(entry) in unheld:
                self._free(entry)
        self.entries = [entry for entry in self.entries if id(entry) not in unheld]
        return len(unheld)
