"""The pool daemon: owns the arena, the index and eviction; serves clients on a Unix socket.

One thread runs the index (no locks, so every message is atomic). A selector
loop reads frames from every client, answers each in order, and treats a
closed connection (including a client killed with -9) as a disconnect: its
reservations are aborted and its leases released.
"""

from __future__ import annotations

import functools
import logging
import os
import selectors
import socket
import stat
import struct
import time
from collections import deque
from dataclasses import dataclass, field

from kvshare.pool import protocol as P
from kvshare.pool.allocator import Allocator
from kvshare.pool.arena import create_arena, map_arena, prefault
from kvshare.pool.index import IndexConfig, LookupResult, PoolError, PoolIndex
from kvshare.pool.remote.config import RemoteConfig

log = logging.getLogger("kvshare.pool")

DEFAULT_EXTENT_BYTES = 256 << 20
_PEERCRED = struct.Struct("3i")  # pid, uid, gid
_REMOTE_WAKEUP = "remote-wakeup"  # selector data of the remote tier's wake-up socket


@dataclass(frozen=True)
class PoolConfig:
    """Everything ``kvshare pool`` takes; validated on construction."""

    socket_path: str
    size_bytes: int
    extent_bytes: int = DEFAULT_EXTENT_BYTES
    hugepages: bool = False
    prefault: bool = False
    socket_mode: int = 0o600  # owner-only unless the operator says otherwise
    allowed_uids: tuple[int, ...] = ()  # empty: only the daemon's own uid
    max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES
    index: IndexConfig = field(default_factory=IndexConfig)
    tick_s: float = 0.25  # lease expiry and stats snapshot period
    # After activity the loop polls without sleeping this long before it blocks: a cross-core
    # wake-up costs ~30 us on these VMs, so a client's next message is seen sooner when it comes soon.
    busy_poll_us: float = 100.0
    remote: RemoteConfig | None = None  # the remote tier (--remote URL); None: this host's arena only

    def __post_init__(self) -> None:
        if self.size_bytes <= 0:
            raise ValueError(f"pool size must be positive, got {self.size_bytes}")
        if self.extent_bytes <= 0:
            raise ValueError(f"extent size must be positive, got {self.extent_bytes}")
        if not self.socket_path:
            raise ValueError("a socket path is required")
        if len(os.fsencode(self.socket_path)) > 107:
            raise ValueError(f"socket path too long for a Unix socket (max 107 bytes): {self.socket_path}")
        if self.remote is not None:
            self.remote.check_lease_ttl(self.index.lease_ttl_s)


@dataclass(eq=False)
class _Client:
    sock: socket.socket
    client_id: int
    pid: int
    uid: int
    name: str = ""
    is_greeted: bool = False
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    is_closing: bool = False
    # frames not handled yet: while a reply is deferred (a lookup that goes on to the remote tier),
    # the client's later messages wait here, so every client is answered in order
    pending: deque = field(default_factory=deque)
    is_deferred: bool = False


@dataclass
class ServerCounters:
    connections: int = 0
    disconnects: int = 0
    requests: int = 0
    errors: int = 0  # error replies of any kind
    protocol_errors: int = 0  # malformed or oversized frames, wrong version
    refused_peers: int = 0


class PoolServer:
    """The daemon's state; ``start`` creates the arena and socket, ``serve`` runs the loop."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.allocator = Allocator(config.size_bytes, config.extent_bytes)
        self.index = PoolIndex(self.allocator, config.index)
        self.counters = ServerCounters()
        self.started_at = time.monotonic()
        self.stats_snapshot: dict = {}
        self._clients: dict[int, _Client] = {}
        self._next_client_id = 1
        self._selector: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._memfd = -1
        self.arena = None
        self.remote = None  # RemoteTier when config.remote is set (started in start())
        self._is_stopping = False
        self._handlers = {
            P.Lookup: self._on_lookup,
            P.Release: self._on_release,
            P.Reserve: self._on_reserve,
            P.Commit: self._on_commit,
            P.Abort: self._on_abort,
            P.Drop: self._on_drop,
            P.Flush: self._on_flush,
            P.GetStats: self._on_stats,
            P.ListLeases: self._on_list_leases,
            P.CheckIntegrity: self._on_check_integrity,
            P.ListNamespaces: self._on_list_namespaces,
        }

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        self._memfd = create_arena(cfg.size_bytes, cfg.hugepages)
        self.arena = map_arena(self._memfd, cfg.size_bytes)
        if cfg.prefault:
            prefault(self.arena)
        if os.path.exists(cfg.socket_path):
            if not stat.S_ISSOCK(os.stat(cfg.socket_path).st_mode):
                raise FileExistsError(f"{cfg.socket_path} exists and is not a socket")
            if _socket_is_live(cfg.socket_path):
                raise FileExistsError(f"a pool is already listening on {cfg.socket_path}")
            os.unlink(cfg.socket_path)  # stale socket of a dead daemon
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)  # no window in which the socket is open to others
        try:
            listener.bind(cfg.socket_path)
        finally:
            os.umask(old_umask)
        os.chmod(cfg.socket_path, cfg.socket_mode)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._start_remote()
        self._snapshot()
        log.info("pool of %d bytes listening on %s", cfg.size_bytes, cfg.socket_path)

    def serve(self) -> None:
        """Run until ``stop()``; then close every client and remove the socket."""
        assert self._selector is not None, "start() first"
        next_tick = time.monotonic()
        busy_poll_s = self.config.busy_poll_us * 1e-6
        last_activity = 0.0
        is_checked_since_activity = True
        try:
            while not self._is_stopping:
                events = self._selector.select(timeout=0)
                while not events and time.perf_counter() - last_activity < busy_poll_s:
                    events = self._selector.select(timeout=0)
                if not events:
                    events = self._selector.select(timeout=self.config.tick_s)
                if events:
                    last_activity = time.perf_counter()
                for key, mask in events:
                    if key.data is None:
                        self._accept()
                        continue
                    if key.data is _REMOTE_WAKEUP:
                        self._on_remote_ready()
                        continue
                    client = key.data
                    try:
                        if mask & selectors.EVENT_READ:
                            self._on_readable(client)
                        if mask & selectors.EVENT_WRITE and not client.is_closing:
                            self._flush(client)
                    except Exception:  # a bug on one connection must not stop the pool for the others
                        log.exception("closing client %s after an internal error", client.client_id)
                        self.counters.errors += 1
                        self._drop_client(client)
                now = time.monotonic()
                if now >= next_tick:
                    self.index.expire(now)
                    self._tick_remote(now)
                    self._snapshot()
                    next_tick = now + self.config.tick_s
                    if not events and not is_checked_since_activity:
                        self._check_when_idle()
                        is_checked_since_activity = True
                if events:
                    is_checked_since_activity = False
        finally:
            self.close()

    def stop(self) -> None:
        """Ask the loop to end (safe from a signal handler)."""
        self._is_stopping = True

    def close(self) -> None:
        self._close_remote()
        for client in list(self._clients.values()):
            self._drop_client(client)
        if self._listener is not None:
            self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.config.socket_path)
            except FileNotFoundError:
                pass
        if self._memfd >= 0:
            os.close(self._memfd)
            self._memfd = -1

    # -- connections -------------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        allowed = self.config.allowed_uids or (os.getuid(),)
        if uid not in allowed:
            self.counters.refused_peers += 1
            log.warning("refused a client with uid %d (pid %d); allowed uids: %s", uid, pid, allowed)
            _send_now(sock, P.encode(P.ErrorReply("not_allowed", f"uid {uid} may not use this pool")))
            sock.close()
            return
        sock.setblocking(False)
        client = _Client(sock=sock, client_id=self._next_client_id, pid=pid, uid=uid)
        self._next_client_id += 1
        self._clients[client.client_id] = client
        self._selector.register(sock, selectors.EVENT_READ, client)
        self.counters.connections += 1

    def _drop_client(self, client: _Client) -> None:
        if client.client_id not in self._clients:
            return
        del self._clients[client.client_id]
        client.is_closing = True
        self._selector.unregister(client.sock)
        client.sock.close()
        aborted, released = self.index.disconnect(client.client_id)
        if self.remote is not None:
            self.remote.on_disconnect(client.client_id)
        self.counters.disconnects += 1
        if aborted or released:
            log.info("client %s (pid %d) left: aborted %d reservations, released %d leases",
                     client.name or client.client_id, client.pid, aborted, released)

    def _on_readable(self, client: _Client) -> None:
        try:
            data = client.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop_client(client)
            return
        client.inbuf += data
        try:
            frames = P.split_frames(client.inbuf, self.config.max_message_bytes)
        except P.ProtocolError as exc:
            self.counters.protocol_errors += 1
            self._fail_and_close(client, "protocol", str(exc))
            return
        client.pending.extend(frames)
        self._handle_pending(client)

    def _handle_pending(self, client: _Client) -> None:
        """Handle the client's frames in order until one is deferred; then flush its replies."""
        while client.pending and not client.is_deferred:
            self._handle_frame(client, client.pending.popleft())
            if client.is_closing:
                return
        self._flush(client)

    def _handle_frame(self, client: _Client, payload: bytes) -> None:
        self.counters.requests += 1
        try:
            request = P.decode_request(payload)
        except P.ProtocolError as exc:
            self.counters.protocol_errors += 1
            self._reply(client, P.ErrorReply("malformed", str(exc)))
            return
        if not client.is_greeted:
            self._on_hello(client, request)
            return
        handler = self._handlers.get(type(request))
        if handler is None:
            self._reply(client, P.ErrorReply("unexpected", f"{type(request).__name__} is not valid now"))
            return
        try:
            reply = handler(client, request)
        except PoolError as exc:
            reply = P.ErrorReply(exc.code, str(exc))
        except Exception as exc:  # a bug must not take the pool down for everyone
            log.exception("internal error on %s", type(request).__name__)
            reply = P.ErrorReply("internal", f"{type(exc).__name__}: {exc}")
        if reply is not None:
            self._reply(client, reply)

    def _on_hello(self, client: _Client, request: P.Request) -> None:
        if not isinstance(request, P.Hello):
            self.counters.protocol_errors += 1
            self._fail_and_close(client, "hello_required", "the first message must be hello")
            return
        if request.protocol_version != P.PROTOCOL_VERSION:
            self.counters.protocol_errors += 1
            self._fail_and_close(
                client,
                "version_mismatch",
                f"client speaks protocol {request.protocol_version}, this pool speaks {P.PROTOCOL_VERSION}; "
                "run the same kvshare version on both sides",
            )
            return
        client.name = request.client_name[:64]
        client.is_greeted = True
        reply = P.HelloReply(
            protocol_version=P.PROTOCOL_VERSION,
            format_version=P.FORMAT_VERSION,
            arena_bytes=self.config.size_bytes,
            extent_bytes=self.allocator.extent_bytes,
            client_id=client.client_id,
            server_pid=os.getpid(),
        )
        self._flush(client)  # nothing may precede the reply that carries the fd
        try:
            client.sock.setblocking(True)
            socket.send_fds(client.sock, [P.encode(reply)], [self._memfd])
        except OSError:
            self._drop_client(client)
        else:
            client.sock.setblocking(False)

    def _reply(self, client: _Client, reply: P.Reply) -> None:
        if isinstance(reply, P.ErrorReply):
            self.counters.errors += 1
        client.outbuf += P.encode(reply)

    def _fail_and_close(self, client: _Client, code: str, message: str) -> None:
        self.counters.errors += 1
        log.warning("closing client %s (pid %d): %s", client.name or client.client_id, client.pid, message)
        _send_now(client.sock, P.encode(P.ErrorReply(code, message)))
        client.is_closing = True
        self._drop_client(client)

    def _flush(self, client: _Client) -> None:
        if client.outbuf:
            try:
                sent = client.sock.send(client.outbuf)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._drop_client(client)
                return
            del client.outbuf[:sent]
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if client.outbuf else 0)
        if self._selector.get_key(client.sock).events != events:
            self._selector.modify(client.sock, events, client)

    # -- handlers: each validates before it mutates, so an error leaves the index intact --

    def _on_lookup(self, client: _Client, req: P.Lookup) -> P.Reply | None:
        result = self.index.lookup(client.client_id, req.keys, req.page_bytes, time.monotonic(), lease=req.lease)
        if self._defer_to_remote(client, req, result):
            return None  # answered by _finish_deferred_lookup
        return _lookup_reply(result)

    def _on_release(self, client: _Client, req: P.Release) -> P.Reply | None:
        errors = []
        for lease_id in req.lease_ids:
            try:
                self.index.release(client.client_id, lease_id)
            except PoolError as exc:
                errors.append(exc)
        if not req.reply:
            if errors:
                self.counters.errors += len(errors)
                log.warning("client %s: fire-and-forget release failed: %s", client.client_id, errors[0])
            return None
        if errors:
            return P.ErrorReply(errors[0].code, str(errors[0]))
        return P.Ok(count=len(req.lease_ids))

    def _on_reserve(self, client: _Client, req: P.Reserve) -> P.Reply:
        result = self.index.reserve(
            client.client_id, req.namespace, req.keys, req.page_bytes, req.first_depth, time.monotonic()
        )
        if self.remote is not None:
            self.remote.on_reserve(client.client_id, result.reservation_id, [entry for _, entry in result.grants])
        grants = [(i, entry.offset) for i, entry in result.grants]
        return P.ReserveReply(reservation_id=result.reservation_id, grants=grants, num_no_room=result.num_no_room)

    def _on_commit(self, client: _Client, req: P.Commit) -> P.Reply:
        count = self.index.commit(client.client_id, req.reservation_id, req.checksums)
        if self.remote is not None:
            self.remote.on_commit(req.reservation_id)  # write-behind: queues, never waits
        return P.Ok(count=count)

    def _on_abort(self, client: _Client, req: P.Abort) -> P.Reply:
        count = self.index.abort(client.client_id, req.reservation_id)
        if self.remote is not None:
            self.remote.on_abort(req.reservation_id)
        return P.Ok(count=count)

    def _on_drop(self, client: _Client, req: P.Drop) -> P.Reply:
        return P.Ok(count=self.index.drop(req.keys))

    def _on_flush(self, client: _Client, req: P.Flush) -> P.Reply:
        return P.Ok(count=self.index.flush(req.namespace))

    def _on_stats(self, client: _Client, req: P.GetStats) -> P.Reply:
        return P.StatsReply(stats=self.stats())

    def _on_list_leases(self, client: _Client, req: P.ListLeases) -> P.Reply:
        now = time.monotonic()
        leases = [
            P.LeaseInfo(
                lease.lease_id,
                lease.client_id,
                self._clients[lease.client_id].name if lease.client_id in self._clients else "",
                len(lease.entries),
                round(now - lease.created_at, 3),
            )
            for lease in self.index.leases()
        ]
        return P.LeasesReply(leases=leases)

    def _on_list_namespaces(self, client: _Client, req: P.ListNamespaces) -> P.Reply:
        rows = [P.NamespaceInfo(ns, n, b) for ns, n, b in self.index.namespaces()]
        return P.NamespacesReply(namespaces=rows, quota_bytes=self.config.index.namespace_quota_bytes)

    def _integrity_problem(self) -> str | None:
        """None when the index and allocator agree; else what is wrong (logged: it is a bug)."""
        try:
            self.index.check_integrity()
        except AssertionError as exc:
            log.error("integrity check failed: %s", exc)
            return str(exc) or "index and allocator disagree"
        return None

    def _check_when_idle(self) -> None:
        if self._integrity_problem() is not None:  # say so loudly, keep serving what is consistent
            self.counters.errors += 1

    def _on_check_integrity(self, client: _Client, req: P.CheckIntegrity) -> P.Reply:
        problem = self._integrity_problem()
        if problem is not None:
            return P.ErrorReply("integrity", problem)
        return P.Ok(count=self.index.num_entries)

    # -- remote tier hooks (kvshare.pool.remote; each is a no-op without --remote) ---------

    def _start_remote(self) -> None:
        if self.config.remote is None:
            return
        from kvshare.pool.remote.tier import RemoteTier

        writer_id, promoter_id = self._next_client_id, self._next_client_id + 1  # the tier's own client ids
        self._next_client_id += 2
        self.remote = RemoteTier(self.config.remote, self.index, self.arena, self.config.index.lease_ttl_s,
                                 writer_id, promoter_id)
        self._selector.register(self.remote.wakeup, selectors.EVENT_READ, _REMOTE_WAKEUP)

    def _on_remote_ready(self) -> None:
        self.remote.poll()

    def _tick_remote(self, now: float) -> None:
        if self.remote is not None:
            self.remote.tick(now)

    def _close_remote(self) -> None:
        if self.remote is not None:
            self._selector.unregister(self.remote.wakeup)
            self.remote.close()
            self.remote = None

    def _defer_to_remote(self, client: _Client, req: P.Lookup, result: LookupResult) -> bool:
        """On a partial local hit, let the remote tier fetch the rest before the client is answered."""
        if self.remote is None or not req.lease or len(result.entries) == len(req.keys):
            return False
        on_done = functools.partial(self._finish_deferred_lookup, client, req, result.lease_id)
        client.is_deferred = self.remote.promote(req.keys, req.page_bytes, len(result.entries), on_done)
        return client.is_deferred

    def _finish_deferred_lookup(self, client: _Client, req: P.Lookup, pin_lease_id: int) -> None:
        """Answer a deferred lookup from the index as it is now, then the client's waiting messages."""
        if self._clients.get(client.client_id) is not client:
            return  # it left meanwhile; its leases went with it
        client.is_deferred = False
        try:
            reply = _lookup_reply(self.index.lookup_uncounted(client.client_id, req.keys, req.page_bytes,
                                                              time.monotonic()))
        except Exception as exc:  # a bug: answer it like any handler's, keep serving the client
            log.exception("internal error answering a deferred lookup")
            reply = P.ErrorReply("internal", f"{type(exc).__name__}: {exc}")
        if pin_lease_id:  # the lease of the first, local-only answer kept the local prefix in place
            try:
                self.index.release(client.client_id, pin_lease_id)
            except PoolError:
                pass  # expired meanwhile
        self._reply(client, reply)
        self._handle_pending(client)

    # -- stats -------------------------------------------------------------------

    def stats(self) -> dict:
        alloc, idx = self.allocator, self.index
        counters = idx.counters.__dict__ | self.counters.__dict__
        return {
            "capacity_bytes": alloc.arena_bytes,
            "extent_bytes": alloc.extent_bytes,
            "used_bytes": alloc.used_bytes,
            "free_bytes": alloc.arena_bytes - alloc.used_bytes,
            "pages_used": {str(size): n for size, n in alloc.page_sizes().items()},
            "pages_free": {str(size): alloc.num_free_pages(size) for size in alloc.page_sizes()},
            "entries": idx.num_entries,
            "writing": idx.num_writing,
            "leases": idx.num_leases,
            "reservations": idx.num_reservations,
            "namespaces": idx.num_namespaces,
            "namespace_quota_bytes": self.config.index.namespace_quota_bytes,
            "clients": len(self._clients),
            "uptime_s": round(time.monotonic() - self.started_at, 3),
            **counters,
            **({"remote": self.remote.stats()} if self.remote is not None else {}),
        }

    def _snapshot(self) -> None:
        self.stats_snapshot = self.stats()  # read by the metrics thread; replaced, never mutated


def _lookup_reply(result: LookupResult) -> P.LookupReply:
    pages = [P.PageHeader(e.offset, e.page_bytes, e.checksum) for e in result.entries]
    return P.LookupReply(lease_id=result.lease_id, pages=pages)


def _send_now(sock: socket.socket, data: bytes) -> None:
    """Best-effort send of a final error before closing."""
    try:
        sock.setblocking(False)
        sock.send(data)
    except OSError:
        pass


def _socket_is_live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()
