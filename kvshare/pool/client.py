"""PoolClient: one connection to the pool daemon and a zero-copy map of its arena.

Synchronous and thread-safe (one request in flight per client, under a lock). The client's holds (leases and
reservations) belong to its holder token, kept across reconnects: ``close()`` says every copy has ended and ends
them; ``close(end_holds=False)`` (after a timeout or a lost link) leaves them to the pool, which keeps them while
this process lives (kvshare.pool.holders). With ``direct`` a full hit is leased from the pool's directory with no
round trip (kvshare.pool.direct). Page views are numpy arrays over the mapped arena: contiguous by construction,
and asserted, because torch silently stages a non-contiguous pinned view through pageable memory.
"""

from __future__ import annotations

import mmap
import os
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

from kvshare.pool import protocol as P
from kvshare.pool.arena import ArenaError, check_sealed, map_arena
from kvshare.pool.checksum import ChecksumKind, is_valid
from kvshare.pool.client_errors import (
    ChecksumMismatch,
    PoolRequestError,
    PoolUnavailable,
)  # re-exported: callers import them from here
from kvshare.pool.direct import register_client
from kvshare.pool.direct_reader import DirectLeases, map_direct
from kvshare.pool.forks import fork_count
from kvshare.pool.grants import LeaseGrant, ReservationGrant
from kvshare.pool.holders import TOKEN_BYTES
from kvshare.pool.peers import peer_credentials, untrusted_pool_reason
from kvshare.pool.spin import CpuPressure, SpinPolicy


class PoolClient:
    def __init__(
        self,
        socket_path: str,
        name: str = "",
        timeout_s: float = 30.0,
        verify_checksums: bool = False,
        spin_us: float = 200.0,
        holder: bytes | None = None,
        direct: bool = False,
    ) -> None:
        self.socket_path = socket_path
        # names this client's holds in the pool across reconnects (a new random token unless given)
        self.holder = holder if holder is not None else os.urandom(TOKEN_BYTES)
        # Waiting for a reply first spins up to this long while spinning pays (spin.py says when it does).
        self.spin = SpinPolicy(spin_us * 1e-6, CpuPressure().is_contended)
        self.name = name or f"pid{os.getpid()}"
        self.timeout_s = timeout_s
        self.verify_checksums = verify_checksums
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._inbuf = bytearray()
        self._poller: select.poll | None = None  # a reply's wait: POLLIN only (connect says why)
        self._mmap: mmap.mmap | None = None
        self.arena: np.ndarray | None = None  # uint8 view of the whole arena
        self.hello: P.HelloReply | None = None
        self._unmap_hooks: list[Callable[[], None]] = []
        self.wants_direct = direct  # lease committed chains with no round trip where the pool offers it (direct.py)
        self._direct: DirectLeases | None = None
        self._owner = fork_count()  # the process whose connection this is: a forked child's copy sends nothing on it
        # A client dropped without close() (an engine never closed, collected later) unmaps its arena as
        # the mmap is freed: run the hooks then too. The finalizer holds the list, never the client.
        weakref.finalize(self, _run_hooks, self._unmap_hooks)

    # -- connection --------------------------------------------------------------

    def connect(self) -> PoolClient:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
            socket_dir = os.stat(os.path.dirname(os.path.abspath(self.socket_path)))
            reason = untrusted_pool_reason(peer_credentials(sock).uid, os.getuid(), socket_dir, self.socket_path)
            if reason is not None:
                sock.close()
                raise PoolRequestError("untrusted_pool", reason)
            direct = self.wants_direct and register_client()
            hello = P.Hello(
                protocol_version=P.PROTOCOL_VERSION, client_name=self.name, holder=self.holder, direct=direct
            )
            sock.sendall(P.encode(hello))
            data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 3)
        except OSError as exc:
            refusal = _refusal_before_close(sock)
            sock.close()
            if refusal is not None:
                raise PoolRequestError(refusal.code, refusal.message) from None
            raise PoolUnavailable(f"cannot reach the pool at {self.socket_path}: {exc}") from None
        self._use(sock)
        self._inbuf = bytearray(data)
        try:
            reply = self._read_reply(self.timeout_s)
            if isinstance(reply, P.ErrorReply):
                raise PoolRequestError(reply.code, reply.message)
            if not isinstance(reply, P.HelloReply) or not fds:
                raise P.ProtocolError("the pool's hello reply carried no arena")
            if reply.protocol_version != P.PROTOCOL_VERSION or len(reply.pool_id) != P.POOL_ID_BYTES:
                raise PoolRequestError(
                    "version_mismatch",
                    f"pool speaks protocol {reply.protocol_version}, this client "
                    f"{P.PROTOCOL_VERSION}; run the same kvshare version on both sides",
                )
            if reply.format_version != P.FORMAT_VERSION:
                raise PoolRequestError(
                    "version_mismatch",
                    f"pool stores page format {reply.format_version}, this client {P.FORMAT_VERSION}",
                )
            try:
                check_sealed(fds[0])
            except ArenaError as exc:
                raise PoolRequestError("unsealed_arena", str(exc)) from None
            self._mmap = map_arena(fds[0], reply.arena_bytes)
            self._direct = map_direct(reply, fds[1:], self.holder)
        except BaseException:
            for fd in fds:
                os.close(fd)
            self._close_socket()
            raise
        for fd in fds:
            os.close(fd)  # the mappings keep the memfds alive
        self.arena = np.frombuffer(self._mmap, dtype=np.uint8)
        self.hello = reply
        self._owner = fork_count()
        return self

    def _use(self, sock: socket.socket) -> None:
        """Requests go over ``sock`` from now on. Sends block, the timeout in the kernel (SO_SNDTIMEO); a reply is
        waited for in poll(POLLIN): the pool reading a request makes the socket writable, which wakes a task blocked
        in recv (a stream socket's readers and writers share one wait queue) but not one polling for input."""
        sock.settimeout(None)
        timeout_s = max(self.timeout_s, 1e-3)  # a zero timeval would mean no timeout at all
        timeval = struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self._sock, self._poller = sock, select.poll()
        self._poller.register(sock, select.POLLIN)

    @property
    def is_direct(self) -> bool:  # lookups of fully committed chains take no round trip
        return self._direct is not None

    def on_unmap(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` before the arena is unmapped (close): e.g. to drop CUDA registrations of it."""
        self._unmap_hooks.append(hook)

    def close(self, end_holds: bool = True) -> None:
        """Close the connection and unmap the arena (after the unmap hooks).

        ``end_holds``: the caller says every copy touching this client's pages has ended, so the pool
        ends its holds now. Without it (a timeout, a lost link) the pool keeps them while this process
        lives, or until their TTL, and a client with the same holder token can still release them.
        """
        end_holds = end_holds and fork_count() == self._owner  # a forked child's copy ends nothing of its parent's
        if end_holds:
            if self._direct is not None:
                self._direct, direct = None, self._direct
                direct.close()  # ends its holds first
            self._say_goodbye()
        self._close_socket()
        _run_hooks(self._unmap_hooks)
        self.arena = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # views still exist; the mapping goes with the last of them
            self._mmap = None

    def __enter__(self) -> PoolClient:
        return self.connect() if self._sock is None else self

    def __exit__(self, exc_type, exc, tb) -> None:
        # Left by an exception, a copy into or out of this client's pages may still run: the holds stay
        # (until this process exits, a client with the same token ends them, or their TTL).
        self.close(end_holds=exc_type is None)

    @property
    def is_connected(self) -> bool:
        return self._sock is not None

    def is_peer_closed(self) -> bool:
        """True when the pool has closed this connection; looks without reading, so any thread may ask."""
        sock = self._sock
        if sock is None:
            return True
        try:
            return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False  # open, nothing to read
        except OSError:
            return True

    def _say_goodbye(self) -> None:
        if not self._lock.acquire(timeout=min(self.timeout_s, 1.0)):
            return  # a request is stuck on the socket: the pool ends the holds when this process exits
        try:
            if self._sock is not None:
                self._send(P.encode(P.Goodbye()))
        except (OSError, TimeoutError):
            pass  # the pool is gone, or not reading: it keeps or ends the holds by its own rules
        finally:
            self._lock.release()

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    # -- requests ----------------------------------------------------------------

    def _call(self, request: P.Request, wait_s: float | None = None) -> P.Reply:
        """One request and its reply, waited for ``wait_s`` (None: ``timeout_s``)."""
        with self._lock:
            if self._sock is None:
                raise PoolUnavailable(f"not connected to the pool at {self.socket_path}")
            if fork_count() != self._owner:  # replies on a shared connection would go to either process
                raise PoolUnavailable("this client's connection is its parent process's (fork): connect a new one")
            try:
                self._send(P.encode(request))
                reply = self._read_reply(self.timeout_s if wait_s is None else wait_s)
            except (OSError, EOFError) as exc:
                self._close_socket()
                raise PoolUnavailable(f"lost the pool at {self.socket_path}: {exc}") from None
        if isinstance(reply, P.ErrorReply):
            raise PoolRequestError(reply.code, reply.message)
        return reply

    def _read_reply(self, wait_s: float) -> P.Reply:
        while True:
            frames = P.split_frames(self._inbuf, 1 << 30) if self._inbuf else []
            if frames:
                if len(frames) > 1 or self._inbuf:
                    raise P.ProtocolError("the pool sent more than one reply")
                return P.decode_reply(frames[0])
            chunk = self._recv_some(wait_s)
            if not chunk:
                raise EOFError("the pool closed the connection")
            size = P.FRAME_HEADER.size
            if not self._inbuf and len(chunk) > size and P.FRAME_HEADER.unpack_from(chunk)[0] == len(chunk) - size:
                return P.decode_reply(memoryview(chunk)[size:])  # the usual case: one whole reply at once
            self._inbuf += chunk

    def _recv_some(self, wait_s: float) -> bytes:
        """What the socket holds next (b"": closed): polled without sleeping for the spin window (spin.py), then
        waited for in poll (at most ``wait_s``)."""
        sock = self._sock
        window_s = self.spin.window_s()
        if window_s > 0:
            spin_until = time.perf_counter() + window_s
            while True:
                try:
                    chunk = sock.recv(1 << 16, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    if time.perf_counter() < spin_until:
                        continue
                    self.spin.record(False)
                    break
                self.spin.record(True)
                return chunk
        if not self._poller.poll(max(1, int(wait_s * 1000))):
            raise TimeoutError(f"the pool did not answer within {wait_s} s")
        return sock.recv(1 << 16, socket.MSG_DONTWAIT)

    def _send(self, data: bytes) -> None:
        try:
            self._sock.sendall(data)
        except BlockingIOError:  # SO_SNDTIMEO passed: the pool does not read
            raise TimeoutError(f"the pool took no request for {self.timeout_s} s") from None

    def lookup(self, keys: list[bytes], page_bytes: int, lease: bool = True) -> LeaseGrant:
        """Longest committed prefix of ``keys``, leased so it cannot be evicted while read; a full hit from the
        directory where mapped (no round trip) while the socket says the pool is there (a gone pool's stays mapped)."""
        is_direct = lease and self._direct is not None and self._sock is not None
        is_direct = is_direct and not (self._poller.poll(0) and self.is_peer_closed())  # poll: ~1 us, no exception
        grant = self._direct.lookup(keys, page_bytes) if is_direct else None
        if grant is not None:
            return grant
        # a lookup the pool promotes from its remote tier is answered by its promote timeout: waited for
        promotes = lease and self.hello is not None
        wait_s = self.timeout_s + self.hello.lookup_wait_s if promotes else self.timeout_s
        reply = self._call(P.Lookup(keys=list(keys), page_bytes=page_bytes, lease=lease), wait_s)
        return LeaseGrant(lease_id=reply.lease_id, pages=reply.pages)

    def release(self, lease_ids: list[int], wait: bool = False) -> None:
        """Release leases; without ``wait`` no reply is awaited (the message still arrives in order)."""
        ids = [i for i in lease_ids if i]
        if self._direct is not None:
            ids = [i for i in ids if not self._direct.release(i)]
        if not ids:
            return
        if wait:
            self._call(P.Release(lease_ids=ids, reply=True))
            return
        with self._lock:
            if self._sock is None or fork_count() != self._owner:
                return  # the pool keeps them for the holder (its connection dropped, or is another process's)
            try:
                self._send(P.encode(P.Release(lease_ids=ids, reply=False)))
            except OSError:
                self._close_socket()

    def reserve(
        self,
        namespace: bytes,
        keys: list[bytes],
        page_bytes: int,
        first_depth: int = 0,
        *,
        token_ids=None,
        account: bytes = b"",
        parent_key: bytes = b"",
    ) -> ReservationGrant:
        """Pages for ``keys``; ``token_ids`` (the chunks' tokens, in order) lets the pool announce them in KV events.
        ``account`` (P.Reserve): whose quota the pages count against; empty: the namespace's. ``parent_key``: the
        key of the chunk before ``keys[0]`` in its chain (P.Reserve), for a run that does not start at chunk 0.

        The tokens travel only to a pool that publishes events, and only up to MAX_RESERVE_TOKEN_BYTES (a longer
        run is announced without them: invisible to an indexer that rehashes tokens, never wrong)."""
        wanted = token_ids is not None and self.hello is not None and self.hello.wants_token_ids
        tokens_le32 = np.asarray(token_ids, dtype="<u4").tobytes() if wanted else b""
        tokens_le32 = tokens_le32 if len(tokens_le32) <= P.MAX_RESERVE_TOKEN_BYTES else b""
        reserve = P.Reserve(
            namespace=namespace,
            keys=list(keys),
            page_bytes=page_bytes,
            first_depth=first_depth,
            tokens_le32=tokens_le32,
            account=account,
            parent_key=parent_key,
        )
        reply = self._call(reserve)
        return ReservationGrant(
            reservation_id=reply.reservation_id, grants=[tuple(g) for g in reply.grants], num_no_room=reply.num_no_room
        )

    def commit(self, reservation_id: int, checksums: list[int], checksum_kind: ChecksumKind = ChecksumKind.XXH3) -> int:
        """Make the reservation's pages visible, one checksum of ``checksum_kind`` per page (in grant order)."""
        return self._call(
            P.Commit(reservation_id=reservation_id, checksums=checksums, checksum_kind=checksum_kind)
        ).count

    def abort(self, reservation_id: int) -> int:
        return self._call(P.Abort(reservation_id=reservation_id)).count

    def drop(self, keys: list[bytes]) -> int:
        return self._call(P.Drop(keys=list(keys))).count

    def flush(self, namespace: bytes | None = None) -> int:
        return self._call(P.Flush(namespace=namespace)).count

    def stats(self) -> dict:
        return self._call(P.GetStats()).stats

    def check_integrity(self) -> int:
        """Raises PoolRequestError("integrity") if the daemon's index and allocator disagree."""
        return self._call(P.CheckIntegrity()).count

    def list_leases(self) -> list[P.LeaseInfo]:
        return self._call(P.ListLeases()).leases

    def list_namespaces(self) -> P.NamespacesReply:
        return self._call(P.ListNamespaces())

    def report_prefill(self, namespace: bytes, page_bytes: int, num_chunks: int, seconds: float) -> bool:
        """Tell the pool a cold prefill of ``num_chunks`` chunks took ``seconds``; True when a remote tier took it."""
        return bool(
            self._call(
                P.PrefillReport(namespace=namespace, page_bytes=page_bytes, num_chunks=num_chunks, seconds=seconds)
            ).count
        )

    # -- page access ---------------------------------------------------------------

    def page(self, offset: int, num_bytes: int) -> np.ndarray:
        """Zero-copy uint8 view of arena bytes [offset, offset + num_bytes)."""
        if self.arena is None:
            raise PoolUnavailable("the arena is not mapped (connect first)")
        if offset < 0 or num_bytes < 0 or offset + num_bytes > self.arena.size:
            raise IndexError(f"bytes [{offset}, {offset + num_bytes}) lie outside the {self.arena.size}-byte arena")
        view = self.arena[offset : offset + num_bytes]
        assert view.flags.c_contiguous
        return view

    def run(self, offset: int, page_bytes: int, num_pages: int) -> np.ndarray:
        """Zero-copy [num_pages, page_bytes] view of consecutive pages."""
        return self.page(offset, page_bytes * num_pages).reshape(num_pages, page_bytes)

    def read_checked(self, header: P.PageHeader) -> np.ndarray:
        """View of a leased page; verifies its checksum when the client was built to."""
        view = self.page(header.offset, header.page_bytes)
        if header.format_version != P.FORMAT_VERSION:
            raise ChecksumMismatch(f"page at {header.offset} has format {header.format_version}")
        if self.verify_checksums and not is_valid(view, header):
            raise ChecksumMismatch(f"page at offset {header.offset} does not match its checksum")
        return view


def _refusal_before_close(sock: socket.socket) -> P.ErrorReply | None:
    """The error a pool sent before it closed the connection (a refused uid), if one is waiting to be read."""
    try:
        data = sock.recv(1 << 16, socket.MSG_DONTWAIT)
        frames = P.split_frames(bytearray(data), 1 << 20)
        reply = P.decode_reply(frames[0]) if frames else None
    except (OSError, P.ProtocolError):
        return None
    return reply if isinstance(reply, P.ErrorReply) else None


def _run_hooks(hooks: list[Callable[[], None]]) -> None:
    """Run and forget every unmap hook (the list is emptied in place: close() then a finalizer run them once)."""
    while hooks:
        hooks.pop(0)()
