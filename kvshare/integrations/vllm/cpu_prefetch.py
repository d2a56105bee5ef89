"""On CPU: the connector's prefetch buffer, where copies ahead of a load land, verified, and where the load reads them.

One host buffer of ``prefetch_mib`` MiB (its memory committed as runs land), handed out first fit
(prefetch.Regions). On the hint listener's thread a run's whole pages are copied out of the arena into it
and each page's checksum is checked there, over the private copy, by the one check (kvshare.pool.checksum's
PageHasher); the run is in the book only once both are done. A load then takes the verdicts with the pages:
its verification is already done, off vLLM's step, and what it copies into vLLM's blocks are the very bytes
that were checked (nothing else writes the buffer). A page found bad ends the load there, as when a load
checks it itself.

    arena pages --copy--> buffer | checksums of the buffer's pages | book        (listener thread)
    load:       buffer --whole blocks--> vLLM's blocks                            (the hooks' or loader thread)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvshare.integrations.vllm.prefetch import Regions
from kvshare.pool.checksum import PageHasher
from kvshare.pool.protocol import PageHeader


@dataclass(eq=False)
class CpuAheadCopy:
    """A run's first ``num_pages`` pages, ``[num_pages, page_bytes]`` in the buffer, and each page's verdict."""

    pages: np.ndarray
    verdicts: list[bool]
    owner: CpuAhead
    start: int

    @property
    def num_pages(self) -> int:
        return len(self.verdicts)

    def is_done(self) -> bool:
        return True  # copied and checked before it was handed out

    def release(self) -> None:
        self.owner.free(self.start)


class CpuAhead:
    """The prefetch buffer of one CPU worker (prefetch.DeviceAhead)."""

    def __init__(self, page_bytes: int, num_bytes: int, hasher: PageHasher) -> None:
        self.page_bytes, self.hasher, self.num_bytes = page_bytes, hasher, num_bytes
        self.buffer = np.empty(num_bytes, dtype=np.uint8)  # pages are committed by the OS as they are written
        self._regions = Regions(num_bytes)
        self._lock = threading.Lock()

    def free(self, start: int) -> None:
        with self._lock:
            self._regions.free(start)

    def room(self) -> int:
        with self._lock:
            return self._regions.largest()

    def wanted(self, pages: Sequence[PageHeader]) -> int:
        return min(len(pages) * self.page_bytes, self.num_bytes)

    def copy_ahead(self, client, pages: Sequence[PageHeader]) -> CpuAheadCopy | None:
        with self._lock:
            n = min(len(pages), self._regions.largest() // self.page_bytes)
            start = self._regions.allocate(n * self.page_bytes) if n else None
        if start is None:
            return None
        try:
            copies = self.buffer[start : start + n * self.page_bytes].reshape(n, self.page_bytes)
            for copy, page in zip(copies, pages[:n]):
                np.copyto(copy, client.page(page.offset, self.page_bytes))
            verdicts = self.hasher.valid(list(copies), list(pages[:n]))
        except BaseException:
            self.free(start)
            raise
        return CpuAheadCopy(copies, verdicts, self, start)
