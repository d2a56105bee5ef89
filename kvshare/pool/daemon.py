"""The pool daemon: owns the arena, the index and the Unix socket, and runs the loop that serves clients.

One thread runs the index (no locks, so every message is atomic). A selector
loop accepts clients (checking their uid), reads frames from every client,
hands each request to the handlers (handlers.py: the answers against the index
and the remote tier) and sends the replies in order, never blocking on one client: a client that
does not read its replies stops being read once a little is unsent and is
closed when its unsent output passes a bound; one that sends anything but a
well-formed hello first, or nothing for a while, is closed. A closed connection
ends its holder's reservations and leases only when the holder's process is
gone (a client killed with -9); a live process keeps them (holders.py).
"""

from __future__ import annotations

import logging
import mmap
import os
import selectors
import socket
import stat
import time

import msgspec

from kvshare.pool import protocol as P
from kvshare.pool.allocator import Allocator
from kvshare.pool.arena import HUGEPAGE_BYTES, open_arena, prefault
from kvshare.pool.config import PoolConfig
from kvshare.pool.connection import MAX_HELLO_BYTES, Connection, send_now, socket_is_live
from kvshare.pool.direct import open_direct
from kvshare.pool.event_publisher import open_pool_events
from kvshare.pool.handlers import PoolHandlers, ServerCounters
from kvshare.pool.index import PoolError, PoolIndex
from kvshare.pool.peers import peer_credentials, peer_pidfd
from kvshare.pool.remote import RemoteHooks, start_remote_tier
from kvshare.pool.spin import CpuPressure, SpinPolicy

log = logging.getLogger("kvshare.pool")

_REMOTE_WAKEUP = "remote-wakeup"  # selector data of the remote tier's wake-up socket
# Items (entries, extents) the idle integrity pass checks per loop turn: ~1 ms (a whole pass took 0.41 s over 200k
# pages, ~2 us an item), so a request that arrives during the pass waits at most one step.
_INTEGRITY_ITEMS_PER_STEP = 500


class PoolServer:
    """The daemon's state; ``start`` creates the arena and socket, ``serve`` runs the loop."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.allocator = Allocator(config.size_bytes, config.extent_bytes)
        self.index = PoolIndex(self.allocator, config.index)
        self.counters = ServerCounters()
        self.handlers = PoolHandlers(self.index, self.counters, self._answer_deferred)
        self.stats_snapshot: dict = {}
        self._clients: dict[int, Connection] = {}
        self._next_client_id = 1
        self._selector: selectors.BaseSelector | None = None
        self._listener: socket.socket | None = None
        self._memfd = -1
        self.arena = None
        self.remote: RemoteHooks | None = None  # when config.remote is set (started in start())
        self._is_stopping = False
        self.events = None  # PoolEvents when config.kv_events is set (started in start())
        self._is_accept_paused = False
        self.direct = None  # DirectTables where clients may lease without a round trip (started in start())

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        cfg = self.config
        self.events = open_pool_events(cfg.kv_events, self.index)  # first: a bad endpoint leaves nothing behind
        admits_other_uids = any(uid != os.getuid() for uid in cfg.allowed_uids)
        self._memfd, self.arena, is_huge = open_arena(cfg.size_bytes, cfg.hugepages, admits_other_uids)
        self.direct = self.index.retired.direct = (
            open_direct(cfg.size_bytes, cfg.index.lease_ttl_s) if cfg.direct_lookups else None
        )
        self.handlers.arena_page_bytes = HUGEPAGE_BYTES if is_huge else mmap.PAGESIZE
        if cfg.prefault:
            prefault(self.arena)
        if os.path.exists(cfg.socket_path):
            if not stat.S_ISSOCK(os.stat(cfg.socket_path).st_mode):
                raise FileExistsError(f"{cfg.socket_path} exists and is not a socket")
            if socket_is_live(cfg.socket_path):
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
        log.info(
            "pool of %d bytes on %s pages listening on %s",
            cfg.size_bytes,
            "2 MiB huge" if is_huge else f"{mmap.PAGESIZE // 1024} KiB",
            cfg.socket_path,
        )

    def serve(self) -> None:
        """Run until ``stop()``; then close every client and remove the socket."""
        assert self._selector is not None, "start() first"
        next_tick = time.monotonic()
        busy_poll = SpinPolicy(self.config.busy_poll_us * 1e-6, CpuPressure().is_contended)
        last_activity = 0.0
        is_polling_after_activity = False
        is_checked_since_activity = True
        integrity_pass = None  # the idle integrity pass under way (a generator): one step per idle turn
        try:
            while not self._is_stopping:
                window_s = 0.0
                if is_polling_after_activity:  # busy-poll after activity, while that pays (spin.py)
                    is_polling_after_activity = False
                    window_s = busy_poll.window_s()
                events = []
                if window_s > 0 or integrity_pass is not None:  # else one blocking select below: one syscall
                    events = self._selector.select(timeout=0)
                    while not events and time.perf_counter() - last_activity < window_s:
                        events = self._selector.select(timeout=0)
                    if window_s > 0:
                        busy_poll.record(bool(events))
                if events:
                    integrity_pass = None  # requests may change the index: a new pass starts when idle again
                elif integrity_pass is not None:  # expiry waits for the pass, which only runs while idle
                    if next(integrity_pass, None) is None:
                        integrity_pass = None
                    continue
                else:
                    events = self._selector.select(timeout=self.config.tick_s)
                if events:
                    last_activity = time.perf_counter()
                    is_polling_after_activity = True
                    self._handle(events)
                now = time.monotonic()
                if now >= next_tick:
                    self._tick(now)
                    next_tick = now + self.config.tick_s
                    if not events and not is_checked_since_activity:
                        integrity_pass = self.handlers.check_when_idle(_INTEGRITY_ITEMS_PER_STEP)
                        is_checked_since_activity = True
                if events:
                    is_checked_since_activity = False
        finally:
            self.close()

    def _handle(self, events: list) -> None:
        """One select's events, in their order: the listener's accept, the remote tier's wake-up, a client's reads
        then writes (a client whose handling raises is dropped, the others are served on)."""
        for key, mask in events:
            if key.data is None:
                self._accept()
                continue
            if key.data is _REMOTE_WAKEUP:
                self.remote.poll()
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

    def _tick(self, now: float) -> None:
        """Expiry, orphans, the direct tables, the stats snapshot. A bug here is logged and counted, and the loop
        serves on: nothing a client did may end the pool for the others."""
        try:
            self._close_silent_clients(now)
            self.handlers.tick(now)
            if self.direct is not None:
                self.direct.tick(self.index, self.handlers.holders.ids())
            self._snapshot()
        except Exception:
            log.exception("internal error in the pool's tick")
            self.counters.errors += 1

    def stop(self) -> None:
        """Ask the loop to end (safe from a signal handler)."""
        self._is_stopping = True

    def close(self) -> None:
        self._close_remote()
        if self.events is not None:
            self.events.close()
            self.events = None
        for client in list(self._clients.values()):
            self._drop_client(client)
        if self._listener is not None:
            if not self._is_accept_paused:
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
        if self.direct is not None:
            self.index.retired.direct = None
            self.direct.close()
            self.direct = None

    # -- connections -------------------------------------------------------------

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # out of file descriptors: stop accepting until the next tick, serve who is here
            log.warning("cannot accept a client (%s); accepting again in %.2f s", exc, self.config.tick_s)
            self.counters.errors += 1
            self._selector.unregister(self._listener)
            self._is_accept_paused = True
            return
        pid, uid, _gid = peer_credentials(sock)
        allowed = self.config.allowed_uids or (os.getuid(),)
        if uid not in allowed:
            self.counters.refused_peers += 1
            log.warning("refused a client with uid %d (pid %d); allowed uids: %s", uid, pid, allowed)
            send_now(sock, P.encode(P.ErrorReply(code="not_allowed", message=f"uid {uid} may not use this pool")))
            sock.close()
            return
        pidfd = peer_pidfd(sock) if pid == 0 else None  # a process outside this pid namespace (holders.py)
        if pid == 0 and pidfd is None:
            log.info(
                "client of uid %d from outside this pool's pid namespace, and no SO_PEERPIDFD (Linux < 6.5): its "
                "holds outlive its connections until it says goodbye or their TTL passes",
                uid,
            )
        sock.setblocking(False)
        client = Connection(sock=sock, client_id=self._next_client_id, pid=pid, uid=uid, connected_at=time.monotonic())
        self._next_client_id += 1
        self._clients[client.client_id] = client
        self.handlers.connect(client.client_id, pid, uid, pidfd)
        self._selector.register(sock, selectors.EVENT_READ, client)
        self.counters.connections += 1

    def _close_silent_clients(self, now: float) -> None:
        """Close connections that have not said hello within hello_timeout_s; accept again if accepting paused."""
        deadline = now - self.config.hello_timeout_s
        for client in [c for c in self._clients.values() if not c.is_greeted and c.connected_at < deadline]:
            self.counters.protocol_errors += 1
            self._fail_and_close(client, "hello_required", f"no hello within {self.config.hello_timeout_s} s")
        if self._is_accept_paused and self._listener is not None:
            self._selector.register(self._listener, selectors.EVENT_READ, None)
            self._is_accept_paused = False

    def _drop_client(self, client: Connection) -> None:
        if client.client_id not in self._clients:
            return
        del self._clients[client.client_id]
        client.is_closing = True
        self._selector.unregister(client.sock)
        client.sock.close()
        label = self._label(client)
        aborted, released = self.handlers.disconnect(client.client_id)
        self.counters.disconnects += 1
        if aborted or released:
            log.info(
                "client %s (pid %d) left: aborted %d reservations, released %d leases",
                label,
                client.pid,
                aborted,
                released,
            )

    def _on_readable(self, client: Connection) -> None:
        data = client.recv_some()
        if data is None:
            return
        if not data:
            self._drop_client(client)
            return
        client.inbuf += data
        if not client.is_greeted and (length := client.first_frame_bytes()) is not None:
            if length > MAX_HELLO_BYTES:
                self.counters.protocol_errors += 1
                self._fail_and_close(client, "hello_required", f"a first message of {length} bytes is not a hello")
                return
        try:
            frames = P.split_frames(client.inbuf, self.config.max_message_bytes)
        except P.ProtocolError as exc:
            self.counters.protocol_errors += 1
            self._fail_and_close(client, "protocol", str(exc))
            return
        client.pending.extend(frames)
        self._handle_pending(client)

    def _handle_pending(self, client: Connection) -> None:
        """Handle the client's frames in order until one is deferred; then flush its replies."""
        while client.pending and not self.handlers.is_deferred(client.client_id):
            self._handle_frame(client, client.pending.popleft())
            if client.is_closing:
                return
        self._flush(client)

    def _handle_frame(self, client: Connection, payload: bytes) -> None:
        self.counters.requests += 1
        try:
            request = P.decode_request(payload)
        except P.ProtocolError as exc:
            self.counters.protocol_errors += 1
            if not client.is_greeted:  # not a kvshare client: nothing it says later can be trusted either
                self._fail_and_close(client, "hello_required", f"the first message must be hello ({exc})")
                return
            self._reply(client, P.ErrorReply(code="malformed", message=str(exc)))
            return
        if not client.is_greeted:
            self._on_hello(client, request)
            return
        reply = self.handlers.handle(client.client_id, request)
        if reply is not None:
            self._reply(client, reply)

    def _on_hello(self, client: Connection, request: P.Request) -> None:
        try:
            reply = self.handlers.hello(client.client_id, request)
        except PoolError as exc:
            self.counters.protocol_errors += 1
            self._fail_and_close(client, exc.code, str(exc))
            return
        client.is_greeted = True
        # Nothing is sent before hello, so the hello reply is the first unsent byte: _flush attaches the fds to it.
        assert not client.outbuf, "a reply was queued before the hello reply"
        client.owed_fds = [self._memfd]
        table_fd = None
        if request.direct and self.direct is not None:
            table_fd = self.direct.hold_table(self.handlers.holders.holder_id(client.client_id), client.uid)
        if table_fd is not None:
            client.owed_fds += [self.direct.fd, table_fd]
            direct = {"direct_slots": self.direct.num_slots, "direct_holds": self.direct.num_holds}
            reply = msgspec.structs.replace(reply, **direct, direct_misses=self.remote is None)
        elif request.direct and self.direct is not None:
            log.info(
                "client %s: no hold table (its uid has as many as it may have): lookups take the round trip",
                self._label(client),
            )
        client.outbuf += P.encode(reply)

    def _answer_deferred(self, client_id: int, reply: P.Reply) -> None:
        """The reply to a lookup the remote tier completed; then the client's messages that waited for it."""
        client = self._clients[client_id]  # the handlers forget the lookup of a client that leaves
        self._reply(client, reply)
        self._handle_pending(client)

    def _reply(self, client: Connection, reply: P.Reply) -> None:
        if isinstance(reply, P.ErrorReply):
            self.counters.errors += 1
        client.outbuf += P.encode(reply)

    def _fail_and_close(self, client: Connection, code: str, message: str) -> None:
        self.counters.errors += 1
        log.warning("closing client %s (pid %d): %s", self._label(client), client.pid, message)
        send_now(client.sock, P.encode(P.ErrorReply(code=code, message=message)))
        client.is_closing = True
        self._drop_client(client)

    def _flush(self, client: Connection) -> None:
        """Send what the socket takes now (never blocks); the rest waits for POLLOUT, within the client's bound."""
        try:
            client.send_unsent()
        except OSError:
            self._drop_client(client)
            return
        if len(client.outbuf) > self.config.max_unsent_bytes:
            self.counters.errors += 1
            log.warning(
                "closing client %s (pid %d): %d bytes of replies unread (bound %d)",
                self._label(client),
                client.pid,
                len(client.outbuf),
                self.config.max_unsent_bytes,
            )
            self._drop_client(client)
            return
        events = (selectors.EVENT_READ if client.is_reading else 0) | (selectors.EVENT_WRITE if client.outbuf else 0)
        if client.events != events:
            self._selector.modify(client.sock, events, client)
            client.events = events

    def _label(self, client: Connection) -> str | int:
        return self.handlers.name_of(client.client_id) or client.client_id

    # -- the remote tier (kvshare.pool.remote, through RemoteHooks; None without --remote) ---------

    def _start_remote(self) -> None:
        if self.config.remote is None:
            return
        writer_id, promoter_id = self._next_client_id, self._next_client_id + 1  # the tier's own client ids
        self._next_client_id += 2
        self.remote = start_remote_tier(
            self.config.remote, self.index, self.arena, self.config.index.lease_ttl_s, writer_id, promoter_id
        )
        self.handlers.remote = self.remote
        # a promoting lookup is answered by its deadline, which the loop sees on its next tick
        self.handlers.lookup_wait_s = self.config.remote.promote_timeout_s + self.config.tick_s
        self._selector.register(self.remote.wakeup, selectors.EVENT_READ, _REMOTE_WAKEUP)

    def _close_remote(self) -> None:
        if self.remote is not None:
            self._selector.unregister(self.remote.wakeup)
            self.remote.close()
            self.remote = self.handlers.remote = None

    def _snapshot(self) -> None:
        self.stats_snapshot = self.handlers.stats()  # read by the metrics thread; replaced, never mutated
