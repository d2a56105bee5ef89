"""What a pool client is given for its requests (kvshare.pool.client): a lease's pages to read, a reservation's
pages to write."""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.pool import protocol as P


@dataclass(frozen=True, kw_only=True)
class LeaseGrant:
    """What a client is given for a lease: pages of the longest committed prefix, pinned until released.

    The pool's own record of the lease (holder, entries, expiry) is ``kvshare.pool.entries.Lease``.
    """

    lease_id: int
    pages: list[P.PageHeader]

    @property
    def num_pages(self) -> int:
        return len(self.pages)


@dataclass(frozen=True, kw_only=True)
class ReservationGrant:
    """What a client is given for a reservation: pages to write, (index into the keys asked for, page offset).

    The pool's own record of the reservation is ``kvshare.pool.entries.Reservation``.
    """

    reservation_id: int
    grants: list[tuple[int, int]]
    num_no_room: int
