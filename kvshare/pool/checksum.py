"""Page checksums: xxh3-64 over a page's bytes (tens of GB/s, so loads can afford to verify)."""

from __future__ import annotations

import xxhash


def page_checksum(data) -> int:
    """64-bit checksum of a bytes-like object (a numpy array or memoryview of a page)."""
    return xxhash.xxh3_64_intdigest(data)
