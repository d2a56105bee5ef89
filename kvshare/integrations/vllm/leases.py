"""The scheduler side's leases: one per request, held from its lookup until its load has ended on every rank.

The book only records; the scheduler side (kvshare.integrations.vllm.scheduler) talks to the pool.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class LeaseState(enum.Enum):
    PENDING = "pending"  # looked up, vLLM has not allocated the blocks yet (may ask again)
    SCHEDULED = "scheduled"  # vLLM allocated blocks: the next step's metadata carries the load
    IN_FLIGHT = "in_flight"  # sent to the worker; released once every rank has reported the load's end


@dataclass
class HeldLease:
    """One request's lease on a run of pool pages, and the load it backs."""

    lease_id: int
    first_chunk: int
    pages: list  # PageHeader-like: offset, page_bytes, checksum
    keys: list[bytes]  # keys of the leased chunks (to drop a page found bad)
    taken_at: float
    owner: tuple[bytes, bytes] = (b"", b"")  # (pool id, holder token) of the link that took it
    token_start: int = 0
    token_end: int = 0
    state: LeaseState = LeaseState.PENDING
    is_resumed: bool = False  # backs a request's load after a preemption (not its provenance)
    # the load runs beside vLLM's steps, the request parked until the workers report it (metadata.LoadSpec);
    # its blocks, which no step's scheduler output names, are those vLLM allocated for it
    is_async: bool = False
    block_ids: tuple[int, ...] = ()
    # a hybrid model's lease: the checkpoint page of the GDN state at token_end, its key, and per GDN layer the block
    # vLLM resumes from (metadata.LoadSpec)
    state_page: Any = None
    state_key: bytes = b""
    state_blocks: tuple[int, ...] = ()


class LeaseBook:
    """Leases per request id: at most one each, reused when vLLM asks again, expired after a TTL.

    The book only records; the caller talks to the pool (lookup, release) and passes ``now``.
    A lease sent to a worker is released when its load has ended, not when the TTL says:
    a page is never freed while it is copied (only a report lost for ten TTLs ends it).
    """

    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"lease TTL must be positive, got {ttl_s}")
        self.ttl_s = ttl_s
        self._held: dict[str, HeldLease] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._held

    def get(self, req_id: str) -> HeldLease | None:
        return self._held.get(req_id)

    def reusable(self, req_id: str, first_chunk: int, now: float) -> HeldLease | None:
        """The lease already held for this request, if it still serves a lookup from ``first_chunk``."""
        held = self._held.get(req_id)
        if held is None or held.state is not LeaseState.PENDING:
            return None
        if held.first_chunk != first_chunk or now - held.taken_at >= self.ttl_s:
            return None
        return held

    def put(self, req_id: str, lease: HeldLease) -> HeldLease | None:
        """Record ``lease`` for ``req_id``; returns the lease it replaces (the caller releases it)."""
        previous = self._held.get(req_id)
        if previous is not None and previous.state is LeaseState.IN_FLIGHT:
            raise ValueError(f"request {req_id} has a load in flight; its lease cannot be replaced")
        self._held[req_id] = lease
        return previous

    def pop(self, req_id: str) -> HeldLease | None:
        return self._held.pop(req_id, None)

    def mark(self, req_id: str, state: LeaseState) -> HeldLease:
        held = self._held[req_id]
        held.state = state
        return held

    def with_state(self, state: LeaseState) -> list[tuple[str, HeldLease]]:
        return [(req_id, held) for req_id, held in self._held.items() if held.state is state]

    def take_expired(self, now: float) -> list[HeldLease]:
        """Remove and return pending leases older than the TTL (requests vLLM never scheduled), and
        in-flight ones older than ``IN_FLIGHT_TTL_FACTOR`` TTLs (a step whose report never came)."""

        def is_expired(held: HeldLease) -> bool:
            age = now - held.taken_at
            if held.state is LeaseState.IN_FLIGHT:
                return age >= IN_FLIGHT_TTL_FACTOR * self.ttl_s
            return age >= self.ttl_s

        expired = [r for r, h in self._held.items() if is_expired(h)]
        return [self._held.pop(r) for r in expired]


IN_FLIGHT_TTL_FACTOR = 10  # a load takes a step or a few (well under a second); ten TTLs: its report was lost
