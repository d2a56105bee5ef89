"""Tensor parallel replicas: which KV heads a rank holds, its part of a page's checksum, and the
scheduler's book of pages whose parts the ranks are still writing.

Pages hold every KV head, as with one rank (the canonical ``[L, 2, C, H, D]``), so replicas of
any TP size share them. With TP = T each rank holds ``H / T`` consecutive heads, or, when
``H < T``, one head replicated on ``T / H`` ranks (vLLM's QKVParallelLinear: rank r holds head
``r // (T / H)``)::

    H = 4, T = 2   rank 0: heads 0-1   rank 1: heads 2-3
    H = 2, T = 4   rank 0, 1: head 0   rank 2, 3: head 1   (ranks 0 and 2 write; 1 and 3 only read)

A store: the scheduler reserves the pages, each rank writes its heads into them and reports its
part of the page's WSUM32 (kvshare.pool.checksum: a sum over words, so the parts of disjoint
heads add up to the page's checksum); the scheduler commits once all T parts are in, and aborts
when any rank could not write its part (``TensorParallelStores``). A page is therefore visible only with every
head in it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from kvshare.integrations.vllm.counters import ConnectorCounters
from kvshare.integrations.vllm.metadata import StorePart, StoreSpec
from kvshare.layout import KVLayout
from kvshare.pool.checksum import MOD64, ChecksumKind
from kvshare.pool.client import PoolRequestError
from kvshare.pool.link import POOL_DOWN_ERRORS, PoolLink, guarded

log = logging.getLogger("kvshare.integrations")


@dataclass(frozen=True)
class HeadSlice:
    """The KV heads ``first_head .. first_head + num_heads - 1`` of one rank; ``is_writer``: it writes them
    into pages (of ranks holding the same replicated head, the first one)."""

    tp_rank: int
    tp_size: int
    first_head: int
    num_heads: int
    is_writer: bool = True

    @property
    def heads(self) -> slice:
        return slice(self.first_head, self.first_head + self.num_heads)


def head_slice(total_kv_heads: int, tp_rank: int, tp_size: int) -> HeadSlice:
    """Rank ``tp_rank``'s heads of ``total_kv_heads``, as vLLM shards them over ``tp_size`` ranks."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside tp_size {tp_size}")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not divide over {tp_size} ranks")
        per_rank = total_kv_heads // tp_size
        return HeadSlice(tp_rank, tp_size, tp_rank * per_rank, per_rank)
    if tp_size % total_kv_heads:
        raise ValueError(f"{tp_size} ranks do not replicate {total_kv_heads} KV heads evenly")
    replicas = tp_size // total_kv_heads
    return HeadSlice(tp_rank, tp_size, tp_rank // replicas, 1, is_writer=tp_rank % replicas == 0)


def partial_wsum32(page: np.ndarray, layout: KVLayout, heads: HeadSlice) -> int:
    """The terms of the page's WSUM32 that lie in ``heads`` (every layer, K and V, token).

    Words of a page as ``[R, H, W]`` (R = L * 2 * C rows, W words per head), word index
    ``i = (r * H + h) * W + w``; so ``i + 1 = r * H * W + h * W + (w + 1)`` and::

        sum (i + 1) x = H W * sum_r r * rowsum_r + W * sum_h h * headsum_h + sum_w (w + 1) * colsum_w

    over the slice's heads only. Sums of int32 words are exact in int64; weighted sums wrap mod 2**64.
    """
    row_bytes = layout.head_dim * layout.itemsize
    if row_bytes % 4:
        raise ValueError(f"a head of {layout.head_dim} x {layout.itemsize} bytes is not a whole number of words")
    H, W = layout.num_kv_heads, row_bytes // 4
    words = page.reshape(-1).view(np.uint8).view("<i4").reshape(-1, H, W)[:, heads.heads]  # [R, h, W]
    rows = words.sum(axis=(1, 2), dtype=np.int64).view(np.uint64)
    per_head = words.sum(axis=(0, 2), dtype=np.int64).view(np.uint64)
    cols = words.sum(axis=(0, 1), dtype=np.int64).view(np.uint64)
    head_ids = np.arange(heads.first_head, heads.first_head + heads.num_heads, dtype=np.uint64)
    by_row = int((rows * np.arange(rows.size, dtype=np.uint64)).sum(dtype=np.uint64))
    by_head = int((per_head * head_ids).sum(dtype=np.uint64))
    by_col = int((cols * np.arange(1, W + 1, dtype=np.uint64)).sum(dtype=np.uint64))
    return (H * W * by_row + W * by_head + by_col) % MOD64


class PartedStores:
    """The scheduler's reservations whose pages the ranks are writing: commit when all parts are in."""

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        # (pool id, reservation id) -> tp rank -> its part; ids restart in every pool, so the pool id tells apart
        # the parts of a reservation of a pool that is gone from those of a new one of the same id
        self._parts: dict[tuple[bytes, int], dict[int, StorePart]] = {}

    def expect(self, reservation_id: int, pool_id: bytes) -> None:
        self._parts[pool_id, reservation_id] = {}

    def add(self, part: StorePart) -> tuple[int, list[int] | None] | None:
        """Record a rank's part; once the reservation has all of them: (reservation id, the page checksums
        to commit, or None to abort it). None while parts are missing."""
        parts = self._parts.get((part.pool_id, part.reservation_id))
        if parts is None:
            log.error("kvshare: a store part for reservation %d that is not pending", part.reservation_id)
            return None
        parts[part.tp_rank] = part
        if len(parts) < self.tp_size:
            return None
        del self._parts[part.pool_id, part.reservation_id]
        if not all(p.is_written for p in parts.values()):
            failed = sorted(r for r, p in parts.items() if not p.is_written)
            log.warning(
                "kvshare: rank(s) %s could not write their part of reservation %d (%s); its pages are aborted",
                failed,
                part.reservation_id,
                "; ".join(p.reason for p in parts.values() if p.reason),
            )
            return part.reservation_id, None
        sums = [sum(column) % MOD64 for column in zip(*(p.checksums for p in parts.values()))]
        return part.reservation_id, sums

    def pending(self, pool_id: bytes) -> list[int]:
        """The ids of the reservations of pool ``pool_id`` whose parts are not all in."""
        return [reservation_id for pid, reservation_id in self._parts if pid == pool_id]

    def __len__(self) -> int:
        return len(self._parts)


class TensorParallelStores:
    """The scheduler's side of a tensor parallel replica's stores, through its pool link: reserve a store's
    pages, commit them once every rank's part is in (abort them when a rank could not write its part)."""

    def __init__(self, tp_size: int, link: PoolLink, counters: ConnectorCounters, page_bytes: int) -> None:
        self.link = link
        self.counters = counters
        self.page_bytes = page_bytes
        self.book = PartedStores(tp_size)

    def reserve(self, spec: StoreSpec) -> StoreSpec | None:
        """The spec with pages reserved for its chunks the pool lacks (None: no pages)."""
        client = self.link.client()
        if client is None:
            return None
        reservation = guarded(
            self.link,
            self.counters,
            "a reserve",
            lambda: spec.reserve(client, self.page_bytes),
        )
        if reservation is None:
            return None
        self.counters.skipped_stores += reservation.num_no_room
        if not reservation.grants:
            return None
        self.book.expect(reservation.reservation_id, self.link.pool_id)
        return dataclasses.replace(
            spec, reservation_id=reservation.reservation_id, grants=tuple(reservation.grants), pool_id=self.link.pool_id
        )

    def add_part(self, part: StorePart) -> None:
        """A rank's part of a reserved store; the last one commits the pages (or aborts them)."""
        done = self.book.add(part)
        if done is None:
            return
        reservation_id, checksums = done
        pool_id = part.pool_id
        client = self.link.client()
        if client is None:  # the pool keeps it until told, or its TTL
            self.link.end_later(reservation_id=reservation_id, pool_id=pool_id)
            return
        if self.link.pool_id != pool_id:  # granted by a pool that is gone; the id may name a live reservation
            return
        try:
            if checksums is None:
                client.abort(reservation_id)
                return
            committed = client.commit(reservation_id, checksums, ChecksumKind.WSUM32)
        except POOL_DOWN_ERRORS as exc:
            self.counters.pool_errors += 1
            self.link.failed(exc)
            # refused then, if the commit went through
            self.link.end_later(reservation_id=reservation_id, pool_id=pool_id)
            return
        except PoolRequestError as exc:
            self.counters.pool_errors += 1
            log.warning("kvshare: the pool refused a commit of reservation %d: %s", reservation_id, exc)
            return
        self.counters.stored_chunks += committed
        self.counters.store_bytes += committed * self.page_bytes

    def abort_pending(self) -> None:
        """Abort the reservations whose parts are not all in (the scheduler closes)."""
        client = self.link.client() if len(self.book) else None
        for reservation_id in self.book.pending(self.link.pool_id) if client is not None else ():
            try:
                client.abort(reservation_id)
            except (PoolRequestError, *POOL_DOWN_ERRORS):
                break  # closing the connection drops them too
