"""Fetch pages straight into reserved arena pages: the promotion's fast path (a reader thread's side).

The loop has reserved one arena page per chunk (invisible until commit, owned by the
tier's promoter id). Here, the replies of one pipelined GET land in those pages::

    reply of part j of page p:  $len | header (88 B) -> checked later | payload -> arena[offset_p + part offset, ...)

The header's part offset says where a payload goes; a header that cannot be a
part of the page, or a payload that would overrun it, is read and dropped. Then
every check of format.check_parts runs (the same as for values fetched whole:
versions, key, size, namespace, depth, part order and offsets, lengths), and the
page's xxh3-64 is taken once, as the page now lies in the arena: it is both the
check against the writer's checksum and the checksum the loop commits (with a
page key, the page's tag is checked over the same bytes: format.check_page). A page
that fails stays reserved here and is aborted by the loop; nothing of it is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvshare.pool.checksum import page_checksum
from kvshare.pool.remote.breaker import CircuitBreaker
from kvshare.pool.remote.config import MIN_PART_BYTES, RemoteConfig
from kvshare.pool.remote.format import (
    BROKEN,
    HEADER,
    HEADER_BYTES,
    MAGIC,
    BadRemoteValue,
    check_page,
    check_parts,
    max_value_bytes,
    num_parts,
    part_keys,
    part_place,
)
from kvshare.pool.remote.store import RemoteStore, RemoteStoreError
from kvshare.pool.remote.workers import BREAKER, ERROR, MISS, delete_quietly


@dataclass
class LandedResult:
    checksums: list[int]  # of the first len(checksums) pages asked for: whole, valid, in place
    end: str | None  # None: every page landed; else MISS, ERROR, BREAKER or a discard reason
    num_errors: int = 0
    num_deleted: int = 0  # broken values removed so a writer can replace them
    discarded: list[tuple[str, str]] = field(default_factory=list)  # (reason, what was wrong)


def fetch_into(
    store: RemoteStore,
    breaker: CircuitBreaker,
    cfg: RemoteConfig,
    arena: np.ndarray,
    pages: list[tuple[bytes, int]],
    page_bytes: int,
    namespace: bytes,
    first_depth: int,
    *,
    deadline: float,
) -> LandedResult:
    """Fetch chunks ``pages`` ((key, reserved arena offset), chain order, from depth ``first_depth``) into place.

    No byte is received after ``deadline`` (monotonic; the pages are reserved well past it): a reply still
    arriving then fails the fetch (ERROR), and when this returns nothing writes into the pages any more."""
    if not breaker.allow():
        return LandedResult([], BREAKER)
    count = num_parts(page_bytes, cfg.part_bytes)
    try:
        parts = _read_parts(store, cfg, arena, pages, page_bytes, count, deadline)
        breaker.record_success()
    except RemoteStoreError as exc:
        breaker.record_failure(str(exc))
        return LandedResult([], ERROR, num_errors=1)
    return _check_pages(store, cfg, arena, pages, parts, page_bytes, namespace, first_depth, count)


def _read_parts(
    store: RemoteStore,
    cfg: RemoteConfig,
    arena: np.ndarray,
    pages: list[tuple[bytes, int]],
    page_bytes: int,
    count: int,
    deadline: float,
) -> list[list]:
    """Read every part of every page, its payload straight into the page's place in the arena; per page, per
    part, (header, payload bytes) or None (never arrived). Raises RemoteStoreError, as store.read does."""
    arena_bytes = memoryview(arena).cast("B")
    parts: list[list] = [[None] * count for _ in pages]  # per page: per part (header, payload bytes)
    slots: list[tuple[int, int]] = []  # per key read: (page, part)

    def place(i: int, head: bytes, rest: int) -> memoryview | None:
        p, j = slots[i]
        parts[p][j] = (head, rest)
        at = part_place(head, rest, page_bytes)
        if at is None:
            return None
        start = pages[p][1] + at
        return arena_bytes[start : start + rest]

    def read(names: list[str], where: list[tuple[int, int]]) -> None:
        slots[:] = where
        store.read(names, cfg.ttl_s, HEADER_BYTES, place, max_value_bytes(page_bytes), deadline)

    read(
        [k for key, _ in pages for k in part_keys(cfg.prefix, key, count)],
        [(p, j) for p in range(len(pages)) for j in range(count)],
    )
    extra = _extra_parts(cfg, pages, parts, page_bytes, count)
    if extra:
        names, where = zip(*extra)
        read(list(names), list(where))
    return parts


def _check_pages(
    store: RemoteStore,
    cfg: RemoteConfig,
    arena: np.ndarray,
    pages: list[tuple[bytes, int]],
    parts: list[list],
    page_bytes: int,
    namespace: bytes,
    first_depth: int,
    count: int,
) -> LandedResult:
    """Check the landed pages in chain order (format.check_parts, then the page's checksum as it lies in the
    arena); the result holds the checksums of those before the first that fails, which ends the fetch."""
    result = LandedResult([], None)
    for p, (key, offset) in enumerate(pages):
        try:
            checked = check_parts(parts[p], key, page_bytes, namespace, first_depth + p)
            if checked is None:
                result.end = MISS
                break
            page = arena[offset : offset + page_bytes]
            checksum = page_checksum(page)
            check_page(checked[0], checksum, [page], cfg.auth_key)
        except BadRemoteValue as exc:
            result.end = exc.reason
            result.discarded.append((exc.reason, f"chunk {key.hex()}: {exc}"))
            if exc.reason in BROKEN:
                result.num_deleted += delete_quietly(store, part_keys(cfg.prefix, key, max(len(parts[p]), count)))
            break
        result.checksums.append(checksum)
    return result


def _extra_parts(cfg: RemoteConfig, pages, parts: list[list], page_bytes: int, count: int) -> list:
    """A page written with a smaller part size has more parts than were asked for: (key, (page, part)) of the rest."""
    limit = num_parts(page_bytes, MIN_PART_BYTES)
    extra = []
    for p, (key, _) in enumerate(pages):
        first = parts[p][0]
        if first is None or len(first[0]) < HEADER_BYTES or first[0][:4] != MAGIC:
            continue
        claimed = HEADER.unpack_from(first[0])[4]
        if count < claimed <= limit:
            parts[p].extend([None] * (claimed - count))
            names = part_keys(cfg.prefix, key, claimed)
            extra += [(names[j], (p, j)) for j in range(count, claimed)]
    return extra
