"""A promoting lookup's state (a job) and its batches: plain data, read and changed by ``promotion.Promotions``
on the loop thread only."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Batch:
    """Keys of one job sent to the store in one round trip."""

    number: int
    start: int  # index of its first key in the job's keys
    num_keys: int
    reservations: tuple[int, ...] = ()  # direct: one reservation per page, in chain order; as values: none


@dataclass(eq=False)
class PromotingLookup:
    """One promoting lookup: the chunks the arena lacked, the batches sent and applied, who waits for it."""

    keys: list[bytes]  # the chunks the arena lacked, in chain order
    page_bytes: int
    namespace: bytes | None  # of the chain (from the arena's last chunk before them, else the first page)
    first_depth: int | None  # depth of keys[0] (known likewise)
    waiters: list[Callable[[], None]]
    deadline: float
    batch_len: int
    started_at: float
    num_asked: int = 0  # keys sent to the store so far
    num_found: int = 0  # chunks of the chain fetched whole and valid
    num_promoted_bytes: int = 0
    outstanding: int = 0  # fetch and copy tasks in flight
    num_batches: int = 0  # batches sent so far
    num_applied: int = 0  # batches applied, in order
    arrived: dict = field(default_factory=dict)  # batch number -> (batch, result), waiting for its turn
    pins: list[int] = field(default_factory=list)  # the promoter's leases on committed pages, until the answer
    is_confirmed: bool = False  # a page of the chain came back whole: reserving ahead is safe
    is_ended: bool = False  # no further batch is fetched (the chain broke, or the lookups were answered)
    is_broken: bool = False  # the chain broke: no further page is placed
    is_answered: bool = False
    parent_key: bytes = b""  # the arena's chunk before keys[0]; nothing: keys[0] starts the chain, or it is unknown
    holds_states: bool = False  # the keys name state checkpoints (protocol.Reserve.holds_states), not chunks

    def parent_of(self, i: int) -> bytes:
        """The key KV events name as keys[i]'s parent (the chunk before it in the chain), or nothing."""
        if i == 0:
            return self.parent_key
        return self.keys[i - 1] if 0 < i <= len(self.keys) else b""

    def break_chain(self) -> None:
        """A chunk is missing or bad: no further page is placed and no further batch fetched."""
        self.is_broken = self.is_ended = True
