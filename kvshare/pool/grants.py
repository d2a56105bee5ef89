"""What a pool client is given for its requests (a lease's pages, a reservation's pages to write) and the
errors it raises when the pool cannot be reached, refuses, or a page fails its check (kvshare.pool.client)."""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.pool import protocol as P


class PoolUnavailable(ConnectionError):
    """The pool daemon cannot be reached (not started, stopped or crashed)."""


class PoolRequestError(RuntimeError):
    """The daemon refused a request; ``code`` says why in one word."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


class ChecksumMismatch(RuntimeError):
    """A page's bytes do not match the checksum recorded at commit."""


@dataclass(frozen=True)
class LeaseGrant:
    """What a client is given for a lease: pages of the longest committed prefix, pinned until released.

    The pool's own record of the lease (holder, entries, expiry) is ``kvshare.pool.entries.Lease``.
    """

    lease_id: int
    pages: list[P.PageHeader]

    @property
    def num_pages(self) -> int:
        return len(self.pages)


@dataclass(frozen=True)
class ReservationGrant:
    """What a client is given for a reservation: pages to write, (index into the keys asked for, page offset).

    The pool's own record of the reservation is ``kvshare.pool.entries.Reservation``.
    """

    reservation_id: int
    grants: list[tuple[int, int]]
    num_no_room: int
