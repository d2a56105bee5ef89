"""The remote tier's background work: write pages behind, fetch pages, copy them into the arena.

These functions run on worker threads and never touch the index: they read
or write arena bytes the loop thread has pinned (a lease) or reserved for them,
talk to the store, and return a result that the loop thread applies (counters
included, so every counter has one writer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from kvshare.pool.checksum import is_valid, page_checksum
from kvshare.pool.remote.breaker import CircuitBreaker
from kvshare.pool.remote.config import MIN_PART_BYTES, RemoteConfig
from kvshare.pool.remote.format import (
    BROKEN,
    BadRemoteValue,
    PageMeta,
    RemotePage,
    decode_page,
    encode_part,
    max_value_bytes,
    num_parts,
    page_tag,
    part_count_of,
    part_keys,
    part_payload_bytes,
)
from kvshare.pool.remote.store import RemoteStore, RemoteStoreError

MISS, ERROR, BREAKER = "miss", "error", "breaker"  # why a fetch stopped, besides the discard reasons


@dataclass(frozen=True)
class PageToWrite:
    meta: PageMeta
    offset: int  # in the arena; pinned by the write job's lease


@dataclass
class WriteResult:
    num_written: int = 0
    num_existing: int = 0  # complete in the store already: only their expiry was refreshed
    num_bytes: int = 0
    num_failed: int = 0  # not written: the store failed
    num_breaker: int = 0  # not written: the breaker was open
    num_expired: int = 0  # not written: the pin would have expired before the read (a store far too slow)
    num_bad: int = 0  # not written: arena bytes disagree with the commit checksum
    num_errors: int = 0  # failed store operations


@dataclass
class FetchResult:
    pages: list[RemotePage]  # the longest run of the keys asked for that the store holds, verified
    end: str | None  # None: every key found; else MISS, ERROR, BREAKER or a discard reason
    num_errors: int = 0
    num_deleted: int = 0  # broken values removed so a writer can replace them
    discarded: list[tuple[str, str]] = field(default_factory=list)  # (reason, what was wrong)


def write_pages(
    store: RemoteStore,
    breaker: CircuitBreaker,
    cfg: RemoteConfig,
    arena: np.ndarray,
    pages: list[PageToWrite],
    read_deadline: float,
    is_closing: Callable[[], bool],
) -> WriteResult:
    """Write pinned pages the store lacks; read no arena byte after ``read_deadline`` (monotonic)."""
    result = WriteResult()
    if not pages:
        return result
    if not breaker.allow():
        result.num_breaker = len(pages)
        return result
    page_bytes = pages[0].meta.page_bytes
    count = num_parts(page_bytes, cfg.part_bytes)
    groups = [part_keys(cfg.prefix, p.meta.key, count) for p in pages]
    try:
        existing = store.count_existing(groups)
        refresh = [k for keys, n in zip(groups, existing) if n == count for k in keys]
        if refresh and cfg.ttl_s:
            store.expire(refresh, cfg.ttl_s)
        breaker.record_success()
    except RemoteStoreError as exc:
        breaker.record_failure(str(exc))
        result.num_errors += 1
        result.num_failed = len(pages)
        return result
    todo = [(p, keys) for p, keys, n in zip(pages, groups, existing) if n != count]
    result.num_existing = len(pages) - len(todo)
    for done, (page, keys) in enumerate(todo):
        left = len(todo) - done
        if is_closing():
            result.num_failed += left
            break
        if not breaker.allow():
            result.num_breaker += left
            break
        try:
            values = _encode_page(arena, page, cfg, read_deadline)
        except _PastDeadline:
            result.num_expired += left
            break
        except _ArenaPageBad:
            result.num_bad += 1
            continue
        try:
            store.put(keys, values, cfg.ttl_s)
            breaker.record_success()
        except RemoteStoreError as exc:
            breaker.record_failure(str(exc))
            result.num_errors += 1
            result.num_failed += 1
            continue
        result.num_written += 1
        result.num_bytes += page_bytes
    return result


class _PastDeadline(Exception):
    """The pin on the page may expire before the read ends: the page may not be read any more."""


class _ArenaPageBad(Exception):
    """The arena's bytes disagree with the checksum recorded at commit."""


def _encode_page(arena: np.ndarray, page: PageToWrite, cfg: RemoteConfig, read_deadline: float) -> list[bytes]:
    """The values of a page's parts (tagged with the page key, if any), copied out of the arena while its pin holds."""
    page_bytes = page.meta.page_bytes
    if time.monotonic() > read_deadline:
        raise _PastDeadline()
    view = arena[page.offset : page.offset + page_bytes]
    if not is_valid(view, page.meta):
        raise _ArenaPageBad()  # never spread a page the arena does not hold as committed
    meta = replace(page.meta, tag=page_tag(cfg.auth_key, page.meta, [view])) if cfg.auth_key else page.meta
    payload_bytes = part_payload_bytes(page_bytes, cfg.part_bytes)
    count = num_parts(page_bytes, cfg.part_bytes)
    values = []
    for i in range(count):
        if time.monotonic() > read_deadline:
            raise _PastDeadline()
        start = i * payload_bytes
        values.append(encode_part(meta, i, count, start, view[start : min(start + payload_bytes, page_bytes)]))
    return values


def fetch_pages(
    store: RemoteStore,
    breaker: CircuitBreaker,
    cfg: RemoteConfig,
    keys: list[bytes],
    page_bytes: int,
    namespace: bytes | None,
    deadline: float | None = None,
) -> FetchResult:
    """The longest run of ``keys`` the store holds whole and valid (one round trip, two if part sizes differ), all
    in by ``deadline`` (monotonic; else ERROR)."""
    if not breaker.allow():
        return FetchResult([], BREAKER)
    count = num_parts(page_bytes, cfg.part_bytes)
    result = FetchResult([], None)
    names = [k for key in keys for k in part_keys(cfg.prefix, key, count)]
    try:
        flat = store.get(names, cfg.ttl_s, max_value_bytes(page_bytes), deadline)
        groups = [flat[i * count : (i + 1) * count] for i in range(len(keys))]
        _fetch_extra_parts(store, cfg, keys, groups, page_bytes, deadline)
        breaker.record_success()
    except RemoteStoreError as exc:
        breaker.record_failure(str(exc))
        return FetchResult([], ERROR, num_errors=1)
    for key, values in zip(keys, groups):
        try:
            page = decode_page(values, key, page_bytes, namespace, cfg.auth_key)
        except BadRemoteValue as exc:
            result.end = exc.reason
            result.discarded.append((exc.reason, f"chunk {key.hex()}: {exc}"))
            if exc.reason in BROKEN:
                result.num_deleted += delete_quietly(store, part_keys(cfg.prefix, key, max(len(values), count)))
            break
        if page is None:
            result.end = MISS
            break
        namespace = page.meta.namespace
        result.pages.append(page)
    return result


def _fetch_extra_parts(
    store: RemoteStore,
    cfg: RemoteConfig,
    keys: list[bytes],
    groups: list[list],
    page_bytes: int,
    deadline: float | None,
) -> None:
    """A page written with a smaller part size has more parts than we asked for: fetch the rest."""
    limit = num_parts(page_bytes, MIN_PART_BYTES)
    wanted = []
    for key, values in zip(keys, groups):
        claimed = part_count_of(values[0])
        if claimed is not None and len(values) < claimed <= limit:
            wanted.append((values, part_keys(cfg.prefix, key, claimed)[len(values) :]))
    if wanted:
        extra = store.get([k for _, ks in wanted for k in ks], cfg.ttl_s, max_value_bytes(page_bytes), deadline)
        for values, ks in wanted:
            values.extend(extra[: len(ks)])
            del extra[: len(ks)]


def delete_quietly(store: RemoteStore, keys: list[str]) -> int:
    """Delete a broken value's parts; 1 when done, 0 when the store failed (the next reader tries again)."""
    try:
        store.delete(keys)
        return 1
    except RemoteStoreError:
        return 0


def probe(store: RemoteStore, breaker: CircuitBreaker) -> str | None:
    """Ping the store (at start, so an operator learns of a wrong URL at once); the error, if any."""
    try:
        store.ping()
    except RemoteStoreError as exc:
        breaker.record_failure(str(exc))
        return str(exc)
    breaker.record_success()
    return None


def copy_pages(arena: np.ndarray, placements: list[tuple[RemotePage, int]]) -> list[int]:
    """Copy verified pages into reserved arena pages; the checksum of each page as it now lies there."""
    checksums = []
    for page, offset in placements:
        dst = arena[offset : offset + page.meta.page_bytes]
        position = 0
        for payload in page.payloads:
            dst[position : position + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            position += len(payload)
        checksums.append(page_checksum(dst))
    return checksums
