"""Page allocator over one arena, serving several page sizes.

The arena is cut into extents; an extent in use belongs to one page size and
is carved into consecutive pages of that size::

    arena   |---- extent 0 ----|---- extent 1 ----|---- extent 2 ----|...
             [p0][p1][p2][p3]   [P0    ][P1    ]    (free: any size)
             page size A        page size B

An extent whose last page is freed returns to the common free list, so when
one model goes idle another can reclaim the whole arena. A page never
straddles an extent boundary; CUDA registration happens in pieces whose
boundaries are extent boundaries, so no copy of a page or of a run of pages
spans two registrations. Pure bookkeeping: no memory is touched here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

# A pool's default extent grows with its arena: a run of pages never crosses an extent (each is its
# own CUDA registration), so an extent bounds the longest 2-D copy of a load. On the H200 a 128k load
# of the Qwen3-32B shape ran at 0.974 of one 1-D copy with 256 MiB extents (4096 copies of 8 MiB) and
# at 0.995 with 1 GiB (1024 of 32 MiB); the 8B shape at 256k at 0.984 and 0.998; 4 GiB added at most
# 0.004 (docs/results/2026-12-02-cfe763f-h200-pool-extents-service-256k). Small arenas keep 256 MiB extents
# and at least 16 of them, so that several page sizes (models) still share the arena.
MIN_DEFAULT_EXTENT_BYTES = 256 << 20
MAX_DEFAULT_EXTENT_BYTES = 1 << 30
MIN_DEFAULT_EXTENTS = 16


def default_extent_bytes(arena_bytes: int) -> int:
    """The extent of a pool started without --extent-size: 1 GiB from a 16 GiB arena on, halved
    (down to 256 MiB) while the arena would hold fewer than 16 extents."""
    extent = MAX_DEFAULT_EXTENT_BYTES
    while extent > MIN_DEFAULT_EXTENT_BYTES and arena_bytes < MIN_DEFAULT_EXTENTS * extent:
        extent //= 2
    return extent


@dataclass(frozen=True)
class AllocatedRun:
    """``num_pages`` consecutive pages of ``page_bytes`` starting at byte ``offset``, taken from one extent.

    (A transfer's view of a call's pages that lie consecutive in the arena is ``kvshare.transfer.plan.PageRun``.)
    """

    offset: int
    page_bytes: int
    num_pages: int

    def page_offset(self, i: int) -> int:
        return self.offset + i * self.page_bytes

    @property
    def num_bytes(self) -> int:
        return self.page_bytes * self.num_pages


@dataclass
class _Extent:
    base: int
    length: int
    page_bytes: int = 0  # 0: free extent, no page size yet
    free_slots: bytearray = field(default_factory=bytearray)  # 1 = slot free
    num_used: int = 0

    @property
    def num_slots(self) -> int:
        return len(self.free_slots)

    def free_runs(self) -> list[tuple[int, int]]:
        """(first slot, length) of each run of free slots, in address order."""
        runs, start = [], None
        for i, is_free in enumerate(self.free_slots):
            if is_free and start is None:
                start = i
            elif not is_free and start is not None:
                runs.append((start, i - start))
                start = None
        if start is not None:
            runs.append((start, self.num_slots - start))
        return runs


class AllocationError(ValueError):
    """A page size the arena cannot serve, or a free of a page that is not allocated."""


class Allocator:
    """Extent-based allocator; mutates only its own bookkeeping."""

    def __init__(self, arena_bytes: int, extent_bytes: int) -> None:
        if arena_bytes <= 0 or extent_bytes <= 0:
            raise ValueError("arena and extent sizes must be positive")
        self.arena_bytes = arena_bytes
        self.extent_bytes = min(extent_bytes, arena_bytes)
        self._extents = [
            _Extent(base=base, length=min(self.extent_bytes, arena_bytes - base))
            for base in range(0, arena_bytes, self.extent_bytes)
        ]
        self._by_size: dict[int, list[int]] = {}  # page size -> extent indices holding it
        self._free_extents: set[int] = set(range(len(self._extents)))
        self.used_bytes = 0

    # -- queries -------------------------------------------------------------

    @property
    def num_extents(self) -> int:
        return len(self._extents)

    def extent_bounds(self) -> list[tuple[int, int]]:
        """(offset, length) of every extent: the registration pieces for CUDA."""
        return [(e.base, e.length) for e in self._extents]

    def max_pages(self, page_bytes: int) -> int:
        """Pages of this size the whole arena holds when nothing else is allocated."""
        return sum(e.length // page_bytes for e in self._extents)

    def num_free_pages(self, page_bytes: int) -> int:
        in_own = sum(self._extents[i].num_slots - self._extents[i].num_used for i in self._by_size.get(page_bytes, ()))
        in_free = sum(self._extents[i].length // page_bytes for i in self._free_extents)
        return in_own + in_free

    def page_sizes(self) -> dict[int, int]:
        """Page size -> pages in use."""
        return {size: sum(self._extents[i].num_used for i in idx) for size, idx in self._by_size.items()}

    def is_allocated(self, offset: int, page_bytes: int) -> bool:
        """Whether ``offset`` is the start of an allocated page of ``page_bytes``."""
        located = self._locate(offset, page_bytes)
        if located is None:
            return False
        extent, slot = located
        return not extent.free_slots[slot]

    # -- mutation ------------------------------------------------------------

    def check_page_size(self, page_bytes: int) -> None:
        if page_bytes <= 0:
            raise AllocationError(f"page size must be positive, got {page_bytes}")
        if page_bytes > self.extent_bytes:
            raise AllocationError(
                f"page of {page_bytes} bytes is larger than the pool's extent of {self.extent_bytes} bytes; "
                "start the pool with a larger --extent-size (and a pool at least that large)"
            )

    def allocate(self, page_bytes: int, num_pages: int) -> list[AllocatedRun]:
        """Up to ``num_pages`` pages, as few runs as possible; fewer (or none) when the arena is full."""
        self.check_page_size(page_bytes)
        runs: list[AllocatedRun] = []
        wanted = num_pages
        while wanted > 0:
            run = self._take_run(page_bytes, wanted)
            if run is None:
                break
            runs.append(run)
            wanted -= run.num_pages
        return runs

    def free(self, offset: int, page_bytes: int) -> None:
        located = self._locate(offset, page_bytes)
        if located is None or located[0].free_slots[located[1]]:
            raise AllocationError(f"page at offset {offset} of {page_bytes} bytes is not allocated")
        extent, slot = located
        extent.free_slots[slot] = 1
        extent.num_used -= 1
        self.used_bytes -= page_bytes
        if extent.num_used == 0:
            self._release_extent(extent)

    # -- internals -----------------------------------------------------------

    def _locate(self, offset: int, page_bytes: int) -> tuple[_Extent, int] | None:
        if page_bytes <= 0 or not 0 <= offset < self.arena_bytes:
            return None
        extent = self._extents[offset // self.extent_bytes]
        if extent.page_bytes != page_bytes:
            return None
        slot, rem = divmod(offset - extent.base, page_bytes)
        if rem or slot >= extent.num_slots:
            return None
        return extent, slot

    def _take_run(self, page_bytes: int, wanted: int) -> AllocatedRun | None:
        own = self._by_size.get(page_bytes, ())
        pattern = b"\x01" * wanted
        for idx in own:  # first fit of a whole run in an extent of this size (bytearray.find is C)
            extent = self._extents[idx]
            if extent.num_slots - extent.num_used >= wanted:
                first = extent.free_slots.find(pattern)
                if first >= 0:
                    return self._mark(idx, first, wanted)
        fresh = self._claim_extent(page_bytes)
        if fresh is not None:
            return self._mark(fresh, 0, min(wanted, self._extents[fresh].num_slots))
        best: tuple[int, int, int] | None = None  # (length, extent index, first slot)
        for idx in own:  # fragmented: the longest free run there is
            for first, length in self._extents[idx].free_runs():
                if best is None or length > best[0]:
                    best = (length, idx, first)
        if best is not None:
            return self._mark(best[1], best[2], best[0])
        return None

    def _claim_extent(self, page_bytes: int) -> int | None:
        usable = [i for i in self._free_extents if self._extents[i].length >= page_bytes]
        if not usable:
            return None
        idx = min(usable)  # low addresses first keeps the used part of the arena compact
        self._free_extents.discard(idx)
        extent = self._extents[idx]
        extent.page_bytes = page_bytes
        extent.free_slots = bytearray(b"\x01" * (extent.length // page_bytes))
        self._by_size.setdefault(page_bytes, []).append(idx)
        return idx

    def _release_extent(self, extent: _Extent) -> None:
        idx = extent.base // self.extent_bytes
        self._by_size[extent.page_bytes].remove(idx)
        if not self._by_size[extent.page_bytes]:
            del self._by_size[extent.page_bytes]
        extent.page_bytes = 0
        extent.free_slots = bytearray()
        self._free_extents.add(idx)

    def _mark(self, idx: int, first: int, count: int) -> AllocatedRun:
        extent = self._extents[idx]
        extent.free_slots[first : first + count] = bytes(count)
        extent.num_used += count
        self.used_bytes += count * extent.page_bytes
        offset = extent.base + first * extent.page_bytes
        return AllocatedRun(offset=offset, page_bytes=extent.page_bytes, num_pages=count)

    def check_integrity(self) -> None:
        """Raise AssertionError if the bookkeeping contradicts itself."""
        for _ in self.integrity_items():
            pass

    def integrity_items(self) -> Iterator[None]:
        """check_integrity one extent at a time: yields after each extent (a resumable pass; see PoolIndex)."""
        used = 0
        for idx, extent in enumerate(self._extents):
            yield
            if extent.page_bytes == 0:
                assert idx in self._free_extents, f"extent {idx} has no page size but is not free"
                assert extent.num_used == 0 and not extent.free_slots
                continue
            assert idx not in self._free_extents, f"extent {idx} is both free and in use"
            assert idx in self._by_size.get(extent.page_bytes, ()), f"extent {idx} missing from its size list"
            assert extent.num_slots == extent.length // extent.page_bytes
            n_used = extent.num_slots - extent.free_slots.count(1)
            assert n_used == extent.num_used, f"extent {idx}: {n_used} slots used, counter says {extent.num_used}"
            assert extent.num_used > 0, f"extent {idx} is empty but still holds page size {extent.page_bytes}"
            used += n_used * extent.page_bytes
        assert used == self.used_bytes, f"used bytes {used} != counter {self.used_bytes}"
