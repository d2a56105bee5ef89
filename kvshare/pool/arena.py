"""The shared-memory arena: a memfd that the daemon creates and clients map.

The memfd is anonymous: it disappears with the last process that holds it, so
a stopped pool leaves no segment behind in /dev/shm. It is sealed at its size
(no shrink, no grow, no further seals) before any client sees it: a client that
ftruncates its copy of the fd gets EPERM instead of making every other mapping
fault with SIGBUS.

No seal forbids punching a hole (fallocate PUNCH_HOLE) while writes are allowed:
only F_SEAL_WRITE and F_SEAL_FUTURE_WRITE do, and clients map the arena writable.
On 4 KiB pages a hole reads as zeros (a page's checksum catches it, as it catches
any bytes a client writes); on hugepages the punched page goes back to the
reserve, and a mapping that touches it later dies of SIGBUS once the reserve is
empty. A process of the pool's own uid can kill the pool and its replicas anyway;
one of another uid (``--allow-uid``) must not be able to, so a pool that admits
another uid never puts its arena on hugepages.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os

HUGEPAGE_BYTES = 2 << 20
# The size seals, which a client demands before it maps an arena, and the seal on seals, which the daemon adds so
# nobody can take them off: the size never changes again, while writes stay allowed (clients write pages).
# hugetlbfs memfds take these seals too (Linux >= 4.16).
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
ARENA_SEALS = SIZE_SEALS | fcntl.F_SEAL_SEAL

log = logging.getLogger("kvshare.pool")


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


HUGEPAGES_MODES = ("auto", "on", "off")


def uses_hugepages(mode: str, size_bytes: int, free_hugepage_bytes: int, admits_other_uids: bool = False) -> bool:
    """Whether an arena of ``size_bytes`` goes on reserved 2 MiB hugepages (pure; ``on`` refuses what it cannot do).

    ``auto`` (the default) takes them when enough are free and the size is whole 2 MiB pages, unless the pool
    admits clients of another uid (``admits_other_uids``: any of them could punch a hole that kills the others'
    mappings, see above); ``on`` demands them; ``off`` never uses them. A device reading host memory through an
    IOMMU (a GPU in a virtual machine) pays per page translated: on the lent H200 a 256k load through the service
    ran at 0.95 of a pinned copy on 4 KiB pages and at 0.99 on hugepages (docs/operations.md, "Hugepages").
    """
    if mode not in HUGEPAGES_MODES:
        raise ArenaError(f"--hugepages takes one of {', '.join(HUGEPAGES_MODES)}, got {mode!r}")
    if mode == "off":
        return False
    if admits_other_uids:
        if mode == "on":
            raise ArenaError(
                "--hugepages on with an --allow-uid of another user: any client holding the arena can punch a hole "
                "in a hugepage arena (fallocate), which kills every other mapping of it; use --hugepages off, or "
                "run every replica as the pool's user"
            )
        return False
    is_whole = size_bytes % HUGEPAGE_BYTES == 0
    is_enough = free_hugepage_bytes >= size_bytes
    if mode == "auto":
        return is_whole and is_enough
    if not is_whole:
        raise ArenaError(f"with --hugepages the pool size must be a multiple of 2 MiB, got {size_bytes}")
    if not is_enough:
        raise ArenaError(
            f"--hugepages needs {size_bytes} bytes of free hugepages, but only {free_hugepage_bytes} are reserved; "
            f"reserve them first (e.g. sysctl vm.nr_hugepages={size_bytes // HUGEPAGE_BYTES}) "
            "or leave --hugepages at auto"
        )
    return True


def create_arena(size_bytes: int, hugepages: bool = False) -> int:
    """A memfd of ``size_bytes``, sealed at that size; with ``hugepages`` backed by reserved 2 MiB pages.

    A memfd that cannot be sealed is refused (ArenaError): an unsealed arena lets any client crash the others.
    """
    if size_bytes <= 0:
        raise ArenaError(f"arena size must be positive, got {size_bytes}")
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | (os.MFD_HUGETLB if hugepages else 0)
    try:
        fd = os.memfd_create("kvshare-pool", flags)
    except OSError as exc:
        raise ArenaError(f"memfd_create failed: {exc}") from None
    try:
        os.ftruncate(fd, size_bytes)
    except OSError as exc:
        os.close(fd)
        raise ArenaError(f"cannot size the arena to {size_bytes} bytes: {exc}") from None
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
    except OSError as exc:
        os.close(fd)
        raise ArenaError(f"cannot seal the arena's size ({exc}); this kernel is too old to share it safely") from None
    return fd


def open_arena(size_bytes: int, mode: str = "auto", admits_other_uids: bool = False) -> tuple[int, mmap.mmap, bool]:
    """(memfd, its shared mapping, is on hugepages) of a new arena, hugepages chosen by ``mode`` (uses_hugepages).

    A hugetlb mapping reserves its pages when it is made, so a pool that lost a race for the last free
    hugepages to another process learns it here: ``on`` reports it, ``auto`` goes on with 4 KiB pages.
    """
    is_huge = uses_hugepages(mode, size_bytes, hugepages_free_bytes(), admits_other_uids)
    fd = create_arena(size_bytes, is_huge)
    try:
        return fd, map_arena(fd, size_bytes), is_huge
    except ArenaError:
        os.close(fd)
        if not is_huge or mode == "on":
            raise
    log.warning("the free hugepages were taken before this pool could map them: its arena is on 4 KiB pages")
    fd = create_arena(size_bytes, False)
    return fd, map_arena(fd, size_bytes), False


def check_sealed(fd: int) -> None:
    """Raise ArenaError unless the memfd's size is sealed (a peer could otherwise shrink it under our mapping)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise ArenaError(f"the pool's arena is not a sealable memfd ({exc}); refusing to map it") from None
    if seals & SIZE_SEALS != SIZE_SEALS:
        raise ArenaError("the pool's arena is not sealed against resizing; refusing to map it (upgrade the pool)")


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
