"""The choice of checksum kind per transfer and per page, on CPU (torch's int64 sums stand in for the GPU's)."""

from __future__ import annotations

import numpy as np
import torch

from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind, PageHasher, page_checksum
from kvshare.pool.protocol import PageHeader
from kvshare.transfer.verify import PageCheck, can_sum_staged, store_checksum_kind

PAGE_BYTES = 4096


class ArenaClient:
    """What PageCheck needs of a PoolClient: views of a numpy arena's pages."""

    def __init__(self, arena: np.ndarray) -> None:
        self.arena = arena

    def page(self, offset: int, num_bytes: int) -> np.ndarray:
        return self.arena[offset : offset + num_bytes]


class RecordingHasher(PageHasher):
    """A PageHasher that records the kinds of the pages it was given to check on the host."""

    def __init__(self) -> None:
        super().__init__(1)
        self.kinds = []

    def submit_valid(self, page, header):
        self.kinds.append(ChecksumKind(header.checksum_kind))
        return super().submit_valid(page, header)


def test_kinds_chosen_per_transfer():
    fp8 = KVLayout(2, 1, 2, "float8_e4m3fn", chunk_tokens=1)  # a layer row of 4 bytes: one word
    odd = KVLayout(1, 1, 1, "float8_e4m3fn", chunk_tokens=1)  # 2 bytes: not a whole word
    assert store_checksum_kind(fp8, is_staged=True) == ChecksumKind.WSUM32
    assert store_checksum_kind(fp8, is_staged=False) == ChecksumKind.XXH3  # the CPU transfer: xxhash
    assert not can_sum_staged(odd) and store_checksum_kind(odd, is_staged=True) == ChecksumKind.XXH3


def test_each_page_is_checked_by_its_kind_and_bad_ones_reported():
    rng = np.random.default_rng(0)
    arena = rng.integers(0, 256, 4 * PAGE_BYTES, dtype=np.uint8)
    kinds = [ChecksumKind.WSUM32, ChecksumKind.XXH3, ChecksumKind.WSUM32, ChecksumKind.XXH3]
    headers = [
        PageHeader(
            offset=i * PAGE_BYTES,
            page_bytes=PAGE_BYTES,
            checksum=page_checksum(arena[i * PAGE_BYTES : (i + 1) * PAGE_BYTES], k),
            checksum_kind=k,
        )
        for i, k in enumerate(kinds)
    ]
    arena[2 * PAGE_BYTES + 5] ^= 1  # page 2 (WSUM32) and page 3 (XXH3) go bad after commit
    arena[3 * PAGE_BYTES + 9] ^= 1

    def staged_check(chosen, on_device=True) -> tuple[PageCheck, RecordingHasher]:
        hasher = RecordingHasher()
        check = PageCheck(headers, chosen, ArenaClient(arena), hasher, torch.device("cpu"), on_device=on_device)
        words = torch.from_numpy(arena.copy()).view(torch.int32).view(4, -1)  # [pages, W]
        half = words.shape[1] // 2
        for lo, hi in ((0, half), (half, words.shape[1])):  # two layer groups, in any order
            check.add_staged(0, 4, words[:, lo:hi].contiguous(), lo)
        return check, hasher

    check, hasher = staged_check([0, 1, 2, 3])
    assert check.needs_staged_sums and hasher.kinds == [ChecksumKind.XXH3, ChecksumKind.XXH3]
    assert check.bad_pages() == [2, 3]
    check, hasher = staged_check([0, 1])  # sampled: only the chosen pages are looked at
    assert check.bad_pages() == []
    check, hasher = staged_check([1, 3])  # no WSUM32 page chosen: nothing summed from the staged bytes
    assert not check.needs_staged_sums and check.bad_pages() == [3]
    check, hasher = staged_check([0, 1, 2, 3], on_device=False)  # no staged sums: every kind on the host
    assert not check.needs_staged_sums and len(hasher.kinds) == 4 and check.bad_pages() == [2, 3]
