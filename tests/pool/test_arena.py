"""The arena's choice of pages (pure): auto takes hugepages only when enough are free, on refuses otherwise."""

import pytest

from kvshare.pool.arena import HUGEPAGE_BYTES, ArenaError, uses_hugepages

GiB = 1 << 30


@pytest.mark.parametrize("size, free, expected", [
    (4 * GiB, 4 * GiB, True),  # exactly enough
    (4 * GiB, 8 * GiB, True),
    (4 * GiB, 4 * GiB - HUGEPAGE_BYTES, False),  # one page short: the OS's pages, not part of each
    (4 * GiB, 0, False),  # none reserved (CI, most hosts)
    (4 * GiB + 4096, 8 * GiB, False),  # not whole 2 MiB pages
])
def test_auto_takes_hugepages_only_when_enough_are_free(size, free, expected):
    assert uses_hugepages("auto", size, free) is expected


def test_off_never_and_on_demands():
    assert uses_hugepages("off", 4 * GiB, 8 * GiB) is False
    assert uses_hugepages("on", 4 * GiB, 4 * GiB) is True
    with pytest.raises(ArenaError, match="nr_hugepages=2048"):
        uses_hugepages("on", 4 * GiB, GiB)
    with pytest.raises(ArenaError, match="multiple of 2 MiB"):
        uses_hugepages("on", 4 * GiB + 4096, 8 * GiB)
    with pytest.raises(ArenaError, match="auto, on, off"):
        uses_hugepages("yes", 4 * GiB, 8 * GiB)
