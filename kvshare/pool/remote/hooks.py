"""What the pool daemon asks of its remote tier: the one interface between the two.

The daemon and its handlers call these, always on the loop thread; nothing else of
kvshare.pool.remote is theirs to touch::

    handlers   on_reserve / on_commit / on_abort / on_disconnect   write-behind bookkeeping
               promote                                             a lookup that goes on to the store
               on_prefill                                          a replica's cold prefill time (PrefillReport)
               stats                                               stats["remote"]
               reservations_in_copy                                never expired by their TTL meanwhile
    daemon     wakeup (readable: results are back) -> poll, tick, close
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvshare.pool.entries import Entry
    from kvshare.pool.index import PoolIndex
    from kvshare.pool.remote.config import RemoteConfig


class RemoteHooks(Protocol):
    """The remote tier as the daemon sees it (kvshare.pool.remote.tier.RemoteTier implements it)."""

    wakeup: socket.socket  # the loop's selector watches it; readable when worker results wait for ``poll``

    def on_reserve(self, client_id: int, reservation_id: int, entries: list[Entry]) -> None:
        """A client reserved ``entries``: remember them until that reservation is committed or aborted."""

    def on_commit(self, reservation_id: int) -> None:
        """A reservation's pages became visible: pin them and queue their write-behind (never waits)."""

    def on_abort(self, reservation_id: int) -> None:
        """A reservation was aborted: forget its entries."""

    def on_disconnect(self, client_id: int) -> None:
        """A client left: forget its reservations (the index aborts them)."""

    def promote(self, keys: list[bytes], page_bytes: int, num_local: int, on_done: Callable[[], None]) -> bool:
        """Fetch ``keys[num_local:]`` from the store into the index; True: ``on_done()`` is called once, later."""

    def on_prefill(self, namespace: bytes, page_bytes: int, num_chunks: int, seconds: float) -> None:
        """A replica prefilled ``num_chunks`` chunks of ``namespace`` cold in ``seconds``: promote only what
        beats that."""

    def poll(self) -> None:
        """Apply the results the worker threads handed back (``wakeup`` was readable)."""

    def tick(self, now: float) -> None:
        """Answer promoting lookups past their deadline."""

    def reservations_in_copy(self) -> Collection[int]:
        """The tier's reservations whose pages a worker thread may still write: the pool must not expire them
        (each is committed or aborted once its thread is done, which a deadline bounds)."""

    def stats(self) -> dict[str, int]:
        """The tier's counters and queue lengths (``stats["remote"]``)."""

    def close(self) -> None:
        """Stop the worker threads and the store client; no ``on_done`` is called afterwards."""


def start_remote_tier(
    config: RemoteConfig, index: PoolIndex, arena, lease_ttl_s: float, writer_id: int, promoter_id: int
) -> RemoteHooks:
    """Start the tier's threads over ``arena`` (the daemon's mapping); its own client ids pin and promote pages."""
    from kvshare.pool.remote.tier import RemoteTier  # imported (numpy, threads) only when --remote is given

    return RemoteTier(config, index, arena, lease_ttl_s, writer_id, promoter_id)
