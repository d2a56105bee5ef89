"""The shared-memory arena: a memfd that the daemon creates and clients map.

The memfd is anonymous: it disappears with the last process that holds it, so
a stopped pool leaves no segment behind in /dev/shm.
"""

from __future__ import annotations

import mmap
import os

HUGEPAGE_BYTES = 2 << 20


class ArenaError(RuntimeError):
    """The arena cannot be created or mapped as asked."""


def hugepages_free_bytes(meminfo_path: str = "/proc/meminfo") -> int:
    """Bytes of free reserved hugepages of the default size (0 when none are reserved)."""
    fields: dict[str, int] = {}
    try:
        with open(meminfo_path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return 0
    return fields.get("HugePages_Free", 0) * fields.get("Hugepagesize", 0) * 1024


def create_arena(size_bytes: int, hugepages: bool = False) -> int:
    """A memfd of ``size_bytes``; with ``hugepages`` backed by reserved 2 MiB pages or an error."""
    if size_bytes <= 0:
        raise ArenaError(f"arena size must be positive, got {size_bytes}")
    flags = os.MFD_CLOEXEC
    if hugepages:
        available = hugepages_free_bytes()
        if size_bytes % HUGEPAGE_BYTES:
            raise ArenaError(f"with --hugepages the pool size must be a multiple of 2 MiB, got {size_bytes}")
        if available < size_bytes:
            raise ArenaError(
                f"--hugepages needs {size_bytes} bytes of free hugepages, but only {available} are reserved; "
                f"reserve them first (e.g. sysctl vm.nr_hugepages={size_bytes // HUGEPAGE_BYTES}) or drop --hugepages"
            )
        flags |= os.MFD_HUGETLB
    try:
        fd = os.memfd_create("kvshare-pool", flags)
    except OSError as exc:
        raise ArenaError(f"memfd_create failed: {exc}") from None
    try:
        os.ftruncate(fd, size_bytes)
    except OSError as exc:
        os.close(fd)
        raise ArenaError(f"cannot size the arena to {size_bytes} bytes: {exc}") from None
    return fd


def map_arena(fd: int, size_bytes: int) -> mmap.mmap:
    """Map the whole arena shared and writable."""
    try:
        return mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except (OSError, ValueError) as exc:
        raise ArenaError(f"cannot map the {size_bytes}-byte arena: {exc}") from None


def prefault(arena: mmap.mmap) -> None:
    """Touch every OS page of the arena so later copies do not pay page faults."""
    import numpy as np

    view = np.frombuffer(arena, dtype=np.uint8)
    step = mmap.PAGESIZE
    view[::step] = view[::step]  # a write per page faults it in without changing its bytes
