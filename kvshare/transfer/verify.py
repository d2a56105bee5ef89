"""Which checksum a transfer records, and the check of a load's pages that runs beside its copies.

A page's checksum carries its kind (kvshare.pool.checksum). A GPU transfer records WSUM32, summed on
the GPU over the staged bytes it copies out (kvshare.pool.wsum); a CPU transfer records XXH3
(xxhash on host cores, cheaper there than numpy's wsum32). A load checks each chosen page by the kind
its writer recorded, without holding up the caller::

    WSUM32 page   summed on the device over the staged bytes, piece by piece as they arrive (add_staged),
                  into one int64 per page, read back once in bad_pages()
    XXH3 page     hashed on host threads while the copies run (a leased page does not change)

So a page written by a CPU replica and one written by a GPU replica both verify on either. The sums
cover the bytes that actually reached the staging buffer, so a bad copy is caught as well as a bad page.
Both end in the one check of kvshare.pool.checksum (``is_valid`` on the host threads of its PageHasher,
``checksum_is_valid`` for the GPU's sums).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind, PageHasher, checksum_is_valid
from kvshare.pool.wsum import add_rows, as_unsigned

if TYPE_CHECKING:
    from kvshare.pool.client import PoolClient
    from kvshare.pool.protocol import PageHeader


def can_sum_staged(layout: KVLayout) -> bool:
    """True when WSUM32 can be summed over staged rows (a group of layers of a page): whole 32-bit words."""
    return layout.layer_bytes % 4 == 0


def store_checksum_kind(layout: KVLayout, is_staged: bool) -> ChecksumKind:
    """The kind a transfer records at commit: WSUM32 where it stages pages on the GPU and can sum them, else XXH3."""
    return ChecksumKind.WSUM32 if is_staged and can_sum_staged(layout) else ChecksumKind.XXH3


class PageCheck:
    """The check of one load's chosen pages, each by its kind; ``bad_pages`` once the copies completed.

    ``on_device``: WSUM32 pages are summed from the staged bytes (``add_staged``); False: on the host too.
    ``client``: whose arena holds the pages (``client.page``), read by ``hasher``'s threads.
    """

    def __init__(
        self,
        pages: Sequence[PageHeader],
        chosen: Sequence[int],
        client: PoolClient,
        hasher: PageHasher,
        device: torch.device,
        on_device: bool,
    ) -> None:
        self._pages = list(pages)
        self._chosen = list(chosen)
        kinds = [ChecksumKind(page.checksum_kind) for page in self._pages]
        self._device_pages = {i for i in self._chosen if on_device and kinds[i] == ChecksumKind.WSUM32}
        self._host = {
            i: hasher.submit_valid(client.page(self._pages[i].offset, self._pages[i].page_bytes), self._pages[i])
            for i in self._chosen
            if i not in self._device_pages
        }
        # WSUM32 of every page of the load, [n] int64; allocated on the caller's current stream
        self._acc = torch.zeros(len(self._pages), dtype=torch.int64, device=device) if self._device_pages else None
        self._bad: list[int] | None = None

    @property
    def needs_staged_sums(self) -> bool:
        return self._acc is not None

    def add_staged(self, page_start: int, page_stop: int, rows: torch.Tensor, word_offset: int) -> None:
        """Add the staged rows ``[page_stop - page_start, W]`` (int32) of pages page_start.. at ``word_offset``.

        Enqueued on the current stream, which must be ordered after the copy into the rows and before
        their next overwrite; nothing is read back.
        """
        sums = self.staged_sums(page_start, page_stop)
        if sums is not None:
            add_rows(sums, rows, word_offset)

    def staged_sums(self, page_start: int, page_stop: int) -> torch.Tensor | None:
        """The WSUM32 accumulators of pages page_start.. (``[n]`` int64 on the device) that the staged rows
        of those pages are added to (kvshare.transfer.pipeline), or None when none is summed on the device."""
        return self._acc[page_start:page_stop] if self._acc is not None else None

    def bad_pages(self) -> list[int]:
        """Indices of the chosen pages whose checksum does not match (in page order).
        Call after the copies completed."""
        if self._bad is None:
            sums = as_unsigned(self._acc) if self._acc is not None else []
            self._bad = [
                i
                for i in self._chosen
                if not (
                    checksum_is_valid(self._pages[i], sums[i]) if i in self._device_pages else self._host[i].result()
                )
            ]
            self._acc = None
        return self._bad
