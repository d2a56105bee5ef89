"""The pool's answer to each message, against the index, the allocator and the remote tier; no sockets.

The daemon (daemon.py) owns the connections: it decodes a frame, hands the
request here with the client's id, and sends back what comes out. Everything
runs on the daemon's one loop thread, so each message is atomic::

    hello            -> HelloReply, or PoolError: the daemon closes the connection
    handle(request)  -> the reply; or None: nothing to send now (a fire-and-forget
                        release, or a lookup deferred to the remote tier, whose reply
                        goes to ``answer_later`` once and before any later reply)

Each handler validates before it mutates, so an error leaves the index intact.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvshare.keys import KEY_BYTES
from kvshare.pool import protocol as P
from kvshare.pool.direct import add_direct_stats, direct_lease_rows
from kvshare.pool.entries import Entry, LookupResult
from kvshare.pool.holders import Holders
from kvshare.pool.index import PoolError, PoolIndex
from kvshare.pool.integrity import integrity_steps
from kvshare.pool.remote import RemoteHooks

log = logging.getLogger("kvshare.pool")


@dataclass
class ServerCounters:
    connections: int = 0
    disconnects: int = 0
    requests: int = 0
    errors: int = 0  # error replies of any kind
    protocol_errors: int = 0  # malformed or oversized frames, wrong version
    refused_peers: int = 0
    orphaned_holders: int = 0  # connections closed while their process lived: their holds were kept
    ended_holders: int = 0  # orphaned holders whose process went away: their holds ended


class PoolHandlers:
    """One method per message type; ``answer_later(client_id, reply)`` delivers a deferred lookup's reply."""

    def __init__(
        self,
        index: PoolIndex,
        counters: ServerCounters,
        answer_later: Callable[[int, P.Reply], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.allocator = index.allocator
        self.counters = counters
        self.remote: RemoteHooks | None = None  # set by the daemon once the arena exists (--remote)
        self.lookup_wait_s = 0.0  # the longest a lookup may wait for the remote tier (HelloReply.lookup_wait_s)
        self.arena_page_bytes = 0  # the OS page size backing the arena (2 MiB on hugepages), set once it exists
        self.started_at = clock()
        self.pool_id = os.urandom(P.POOL_ID_BYTES)  # this daemon instance, told apart from any with the same pid
        self._answer_later = answer_later
        self._clock = clock
        self._names: dict[int, str] = {}  # every connected client, by id: its name ("" until hello)
        # The index keys holds by holder (holders.py), which outlives a connection of a live process.
        self.holders = Holders()
        self._deferred: set[int] = set()  # clients whose lookup waits for the remote tier
        self._by_type = {
            P.Lookup: self.lookup,
            P.Release: self.release,
            P.Reserve: self.reserve,
            P.Commit: self.commit,
            P.Abort: self.abort,
            P.Drop: self.drop,
            P.Flush: self.flush,
            P.GetStats: self.get_stats,
            P.ListLeases: self.list_leases,
            P.CheckIntegrity: self.check_integrity,
            P.ListNamespaces: self.list_namespaces,
            P.PrefillReport: self.prefill_report,
            P.Goodbye: self.goodbye,
        }

    # -- clients ---------------------------------------------------------------

    def connect(self, client_id: int, pid: int = 0, uid: int = 0, pidfd: int | None = None) -> None:
        """A connection from process ``pid`` of ``uid``; pid 0: not in the pool's pid namespace, known by ``pidfd``
        where the kernel gave one (the handlers own it from now on; holders.Process)."""
        self._names[client_id] = ""
        self.holders.connect(client_id, pid, uid, pidfd)

    def hello(self, client_id: int, request: P.Request) -> P.HelloReply:
        """Greet a client; raises PoolError (the daemon then closes the connection) for anything but a good hello."""
        if not isinstance(request, P.Hello):
            raise PoolError("hello_required", "the first message must be hello")
        if request.protocol_version != P.PROTOCOL_VERSION:
            raise PoolError(
                "version_mismatch",
                f"client speaks protocol {request.protocol_version}, this pool speaks {P.PROTOCOL_VERSION}; "
                "run the same kvshare version on both sides",
            )
        if len(request.holder) > P.MAX_HOLDER_BYTES:
            raise PoolError(
                "bad_holder", f"a holder token has at most {P.MAX_HOLDER_BYTES} bytes, got {len(request.holder)}"
            )
        self._names[client_id] = request.client_name[:64]
        self.holders.attach(client_id, request.holder, self._names[client_id])
        return P.HelloReply(
            protocol_version=P.PROTOCOL_VERSION,
            format_version=P.FORMAT_VERSION,
            arena_bytes=self.allocator.arena_bytes,
            extent_bytes=self.allocator.extent_bytes,
            client_id=client_id,
            server_pid=os.getpid(),
            pool_id=self.pool_id,
            wants_token_ids=self.index.listener is not None,
            lookup_wait_s=self.lookup_wait_s,
        )

    def disconnect(self, client_id: int) -> tuple[int, int]:
        """A connection closed; returns (reservations aborted, leases released).

        The holds of its holder end now only when no other connection speaks for it and its process is
        gone; a live process's holds stay (orphaned) until it reconnects and ends them, it exits (seen on
        ``tick``) or their TTL passes: a copy it enqueued may still touch their pages.
        """
        self._names.pop(client_id, None)
        self._deferred.discard(client_id)  # its deferred lookup, if any, is never answered
        holder = self.holders.detach(client_id)
        if holder is None:  # no hello: its holds (if any) are keyed by the connection and end with it
            return self._end_holds(client_id)
        if holder.connections:  # another connection speaks for the holder
            return 0, 0
        if not holder.process.is_gone():
            if self._is_holding(holder.holder_id):
                self.counters.orphaned_holders += 1
            else:
                self.holders.forget(holder)
            return 0, 0
        self.holders.forget(holder)
        return self._end_holds(holder.holder_id)

    def _is_holding(self, holder_id: int) -> bool:
        """Whether a holder no connection speaks for holds anything: leases, reservations, or direct holds (its
        hold table closed to new ones first, so that a lookup of its live process cannot hold after this answer)."""
        return bool(self.index.num_holds(holder_id) or self.index.retired.seal(holder_id))

    def _end_holds(self, holder_id: int) -> tuple[int, int]:
        aborted, released = self.index.disconnect(holder_id)
        if self.remote is not None:
            self.remote.on_disconnect(holder_id)
        return aborted, released

    def name_of(self, client_id: int) -> str:
        """The name a connection, or the holder of a lease, gave in its hello."""
        return self._names.get(client_id, "") or self.holders.name(client_id)

    def _holder(self, client_id: int) -> int:
        return self.holders.holder_id(client_id)

    def is_deferred(self, client_id: int) -> bool:
        """Whether the client's lookup waits for the remote tier (its later messages must wait too)."""
        return client_id in self._deferred

    # -- messages --------------------------------------------------------------

    def handle(self, client_id: int, request: P.Request) -> P.Reply | None:
        """The reply to a greeted client's request; a refusal or a bug becomes an ErrorReply."""
        handler = self._by_type.get(type(request))
        if handler is None:
            return P.ErrorReply(code="unexpected", message=f"{type(request).__name__} is not valid now")
        try:
            return handler(client_id, request)
        except PoolError as exc:
            return P.ErrorReply(code=exc.code, message=str(exc))
        except Exception as exc:  # a bug must not take the pool down for everyone
            log.exception("internal error on %s", type(request).__name__)
            return P.ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")

    def lookup(self, client_id: int, req: P.Lookup) -> P.Reply | None:
        result = self.index.lookup(self._holder(client_id), req.keys, req.page_bytes, self._clock(), lease=req.lease)
        if self._defer_to_remote(client_id, req, result):
            return None  # answered by _finish_deferred_lookup
        return lookup_reply(result)

    def release(self, client_id: int, req: P.Release) -> P.Reply | None:
        errors = []
        for lease_id in req.lease_ids:
            try:
                self.index.release(self._holder(client_id), lease_id)
            except PoolError as exc:
                errors.append(exc)
        if not req.reply:
            if errors:
                self.counters.errors += len(errors)
                log.warning("client %s: fire-and-forget release failed: %s", client_id, errors[0])
            return None
        if errors:
            return P.ErrorReply(code=errors[0].code, message=str(errors[0]))
        return P.Ok(count=len(req.lease_ids))

    def reserve(self, client_id: int, req: P.Reserve) -> P.Reply:
        holder_id = self._holder(client_id)
        result = self.index.reserve(
            holder_id,
            req.namespace,
            req.keys,
            req.page_bytes,
            req.first_depth,
            self._clock(),
            tokens_le32=req.tokens_le32,
            account=req.account,
            parent_key=req.parent_key,
        )
        if self.remote is not None:
            self.remote.on_reserve(holder_id, result.reservation_id, [entry for _, entry in result.grants])
        grants = [(i, entry.offset) for i, entry in result.grants]
        return P.ReserveReply(reservation_id=result.reservation_id, grants=grants, num_no_room=result.num_no_room)

    def commit(self, client_id: int, req: P.Commit) -> P.Reply:
        count = self.index.commit(self._holder(client_id), req.reservation_id, req.checksums, req.checksum_kind)
        if self.remote is not None:
            self.remote.on_commit(req.reservation_id)  # write-behind: queues, never waits
        return P.Ok(count=count)

    def abort(self, client_id: int, req: P.Abort) -> P.Reply:
        count = self.index.abort(self._holder(client_id), req.reservation_id)
        if self.remote is not None:
            self.remote.on_abort(req.reservation_id)
        return P.Ok(count=count)

    def goodbye(self, client_id: int, req: P.Goodbye) -> None:
        """The holder's copies have all ended: its holds end now (no reply; the connection closes next)."""
        aborted, released = self._end_holds(self._holder(client_id))
        if aborted or released:
            log.info(
                "client %s said goodbye: aborted %d reservations, released %d leases",
                self.name_of(client_id) or client_id,
                aborted,
                released,
            )

    def drop(self, client_id: int, req: P.Drop) -> P.Reply:
        return P.Ok(count=self.index.drop(req.keys))

    def flush(self, client_id: int, req: P.Flush) -> P.Reply:
        return P.Ok(count=self.index.flush(req.namespace))

    def get_stats(self, client_id: int, req: P.GetStats) -> P.Reply:
        return P.StatsReply(stats=self.stats())

    def list_leases(self, client_id: int, req: P.ListLeases) -> P.Reply:
        now = self._clock()
        rows = [
            (lease.lease_id, lease.client_id, len(lease.entries), now - lease.created_at)
            for lease in self.index.leases()
        ]
        rows += direct_lease_rows(self.index.retired)  # leases taken from the directory, aged since the pool saw them
        leases = [
            P.LeaseInfo(lease_id=i, client_id=c, client_name=self.name_of(c), num_pages=n, age_s=round(age, 3))
            for i, c, n, age in rows
        ]
        return P.LeasesReply(leases=leases)

    def list_namespaces(self, client_id: int, req: P.ListNamespaces) -> P.Reply:
        rows = [P.NamespaceInfo(namespace=ns, num_entries=n, num_bytes=b) for ns, n, b in self.index.namespaces()]
        accounts = [
            P.NamespaceInfo(namespace=owner, num_entries=n, num_bytes=b) for owner, n, b in self.index.accounts()
        ]
        return P.NamespacesReply(
            namespaces=rows, quota_bytes=self.index.config.namespace_quota_bytes, accounts=accounts
        )

    def prefill_report(self, client_id: int, req: P.PrefillReport) -> P.Reply:
        if (
            len(req.namespace) != KEY_BYTES
            or req.page_bytes < 1
            or req.num_chunks < 1
            or not 0 < req.seconds < math.inf
        ):
            raise PoolError(
                "bad_report",
                f"a prefill report needs a {KEY_BYTES}-byte namespace, a page size, "
                f"at least one chunk and a positive time; got {req}",
            )
        if self.remote is None:
            return P.Ok(count=0)
        self.remote.on_prefill(req.namespace, req.page_bytes, req.num_chunks, req.seconds)
        return P.Ok(count=1)

    def check_integrity(self, client_id: int, req: P.CheckIntegrity) -> P.Reply:
        problem = self._integrity_problem()
        if problem is not None:
            return P.ErrorReply(code="integrity", message=problem)
        return P.Ok(count=self.index.num_entries)

    # -- between messages --------------------------------------------------------

    def tick(self, now: float) -> None:
        """End holds past their TTL and those of orphaned holders whose process is gone; answer promoting
        lookups past their deadline."""
        self.index.expire(now)
        in_copy = self.remote.reservations_in_copy() if self.remote is not None else ()
        for reservation_id in self.index.expire_reservations(now, in_copy):
            if self.remote is not None:
                self.remote.on_abort(reservation_id)
        for holder in self.holders.orphans():
            if holder.process.is_gone():
                self._end_holds(holder.holder_id)
                self.counters.ended_holders += 1
                self.holders.forget(holder)
            elif not self._is_holding(holder.holder_id):  # ended by TTL, or released after a reconnect
                self.holders.forget(holder)
        if self.remote is not None:
            self.remote.tick(now)

    def check_when_idle(self, max_items: int) -> Iterator[int]:
        """An integrity pass in steps of at most ``max_items`` items (integrity.integrity_steps), for the loop to run
        one step per idle turn; a problem is logged and counted (say so loudly, keep serving what is consistent)."""
        try:
            yield from integrity_steps(self.index, max_items)
        except AssertionError as exc:
            log.error("integrity check failed: %s", exc)
            self.counters.errors += 1

    def stats(self) -> dict:
        alloc, idx = self.allocator, self.index
        counters = idx.counters.__dict__ | self.counters.__dict__
        stats = {
            "capacity_bytes": alloc.arena_bytes,
            "extent_bytes": alloc.extent_bytes,
            "arena_page_bytes": self.arena_page_bytes,
            "used_bytes": alloc.used_bytes,
            "free_bytes": alloc.arena_bytes - alloc.used_bytes,
            "pages_used": {str(size): n for size, n in alloc.page_sizes().items()},
            "pages_free": {str(size): alloc.num_free_pages(size) for size in alloc.page_sizes()},
            "entries": idx.num_entries,
            "writing": idx.num_writing,
            "leases": idx.num_leases,
            "reservations": idx.num_reservations,
            "namespaces": idx.num_namespaces,
            "namespace_quota_bytes": idx.config.namespace_quota_bytes,
            "clients": len(self._names),
            "uptime_s": round(self._clock() - self.started_at, 3),
            **counters,
            **({"remote": self.remote.stats()} if self.remote is not None else {}),
            **({"kv_events": self.index.listener.stats()} if self.index.listener is not None else {}),
        }
        return add_direct_stats(stats, idx.retired)

    def _integrity_problem(self) -> str | None:
        """None when the index and allocator agree; else what is wrong (logged: it is a bug)."""
        try:
            self.index.check_integrity()
        except AssertionError as exc:
            log.error("integrity check failed: %s", exc)
            return str(exc) or "index and allocator disagree"
        return None

    # -- lookups deferred to the remote tier -------------------------------------------

    def _defer_to_remote(self, client_id: int, req: P.Lookup, result: LookupResult) -> bool:
        """On a partial local hit, let the remote tier fetch the rest before the client is answered."""
        if self.remote is None or not req.lease or len(result.entries) == len(req.keys):
            return False
        on_done = functools.partial(
            self._finish_deferred_lookup, client_id, self._holder(client_id), req, result.lease_id
        )
        if not self.remote.promote(req.keys, req.page_bytes, len(result.entries), on_done):
            return False
        self._deferred.add(client_id)
        return True

    def _finish_deferred_lookup(self, client_id: int, holder_id: int, req: P.Lookup, pin_lease_id: int) -> None:
        """Answer a deferred lookup from the index as it is now (through ``answer_later``)."""
        if client_id not in self._deferred:  # its connection closed meanwhile: nobody reads the pin's pages
            if pin_lease_id:
                try:
                    self.index.release(holder_id, pin_lease_id)
                except PoolError:
                    pass  # its holds ended meanwhile
            return
        self._deferred.discard(client_id)
        try:
            result = self.index.lookup(holder_id, req.keys, req.page_bytes, self._clock(), is_counted=False)
            reply = lookup_reply(result)
        except Exception as exc:  # a bug: answer it like any handler's, keep serving the client
            log.exception("internal error answering a deferred lookup")
            reply = P.ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")
        if pin_lease_id:  # the lease of the first, local-only answer kept the local prefix in place
            try:
                self.index.release(holder_id, pin_lease_id)
            except PoolError:
                pass  # expired meanwhile
        self._answer_later(client_id, reply)


def lookup_reply(result: LookupResult) -> P.LookupReply:
    return P.LookupReply(lease_id=result.lease_id, pages=[e.header or _page_header(e) for e in result.entries])


def _page_header(entry: Entry) -> P.PageHeader:
    """The entry's PageHeader, kept on it: its offset, size and checksum are fixed once committed."""
    entry.header = P.PageHeader(
        offset=entry.offset, page_bytes=entry.page_bytes, checksum=entry.checksum, checksum_kind=entry.checksum_kind
    )
    return entry.header
