"""Who holds the pool's leases and reservations: a holder outlives the connections it speaks through.

A client names itself with a random token in its hello; the pool keys holds by
(uid, token), so a client that reconnects after a timeout or a protocol error
finds the holds it took before. A holder's holds end only when

- it says so (``Goodbye``, or a release / commit / abort of each hold): its copies have ended,
- its process is gone (pid from SO_PEERCRED, checked with the process's start time so a
  reused pid is not taken for it), seen at disconnect or on the daemon's tick,
- or their TTL passes (index.py: lease_ttl_s, reservation_ttl_s).

A peer whose pid SO_PEERCRED cannot name (0: its process is not in the pool's pid
namespace, as when the pool runs in a container and its clients outside it) is
known by a pidfd instead (SO_PEERPIDFD, Linux >= 6.5), which says when it exits; two
such connections are of one process only when their pidfds name it (pidfds with
inodes of their own, Linux >= 6.9). Where the kernel cannot tell, such a peer is
never known gone (its holds stay until it says so or their TTL passes) and a token
never joins two of its connections (a forked child's inherited token must not end
its parent's holds): a reconnect's holds are its own, the earlier ones wait for
their TTL.

A connection that closes while its process lives leaves the holder *orphaned*:
its holds stay, because a copy the process enqueued may still touch their pages.
Pure bookkeeping on the daemon's loop thread; the only I/O is reading /proc.
"""

from __future__ import annotations

import functools
import os
import select
from dataclasses import dataclass, field

TOKEN_BYTES = 16


@dataclass(frozen=True)
class Process:
    """A peer process: pid (0: not in the pool's pid namespace) and start time (clock ticks since boot; None when
    /proc could not tell); for a pid-0 peer, a pidfd where the kernel gave one, and its inode where that names it."""

    pid: int
    start_ticks: int | None
    pidfd: int = -1
    pidfd_ino: int = 0

    @classmethod
    def of(cls, pid: int, pidfd: int | None = None) -> Process:
        """The peer ``pid`` (and ``pidfd``, which the Process then owns) at connection time."""
        if pid > 0:
            if pidfd is not None:
                os.close(pidfd)  # /proc names it
            return cls(pid, process_start_ticks(pid))
        if pidfd is None:
            return cls(0, None)
        return cls(0, None, pidfd, pidfd_inode(pidfd))

    def is_gone(self) -> bool:
        """True only when the process has certainly exited (or its pid now names another process).

        A pid-0 peer without a pidfd (a kernel before SO_PEERPIDFD) is never gone: whether its copies have
        ended cannot be known, so its holds wait for a Goodbye or their TTL (fail safe: a page under a copy
        is never handed to another writer).
        """
        if self.pid <= 0:
            return self.pidfd >= 0 and has_exited(self.pidfd)
        now = process_start_ticks(self.pid)
        if now is None:  # no such process, or a zombie; or no /proc to ask: then it cannot be known gone
            return os.path.exists("/proc/self/stat")
        return self.start_ticks is not None and now != self.start_ticks

    def is_same(self, other: Process) -> bool:
        """Whether two connections' peers are one process; for pid-0 peers only when their pidfds say so."""
        if self.pid > 0 or other.pid > 0:
            return self.pid == other.pid and self.start_ticks == other.start_ticks
        return self.pidfd_ino != 0 and self.pidfd_ino == other.pidfd_ino

    def close(self) -> None:
        """Close the pidfd (once the connection or holder that owned this Process is gone)."""
        if self.pidfd >= 0:
            os.close(self.pidfd)


def has_exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (a pidfd polls readable from then on)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


@functools.cache
def _anon_inode_dev() -> int:
    with select.epoll() as epoll:
        return os.fstat(epoll.fileno()).st_dev


def pidfd_inode(pidfd: int) -> int:
    """The inode that names the process of ``pidfd`` where pidfds have their own (pidfs, Linux >= 6.9); 0 where
    every pidfd shares the one anonymous inode."""
    stat = os.fstat(pidfd)
    return 0 if stat.st_dev == _anon_inode_dev() else stat.st_ino


def process_start_ticks(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat; None when the process does not exist or is a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # the command name may hold spaces and parentheses
    if fields[0] in (b"Z", b"X"):  # exited, waiting to be reaped: its copies have ended
        return None
    return int(fields[19])


@dataclass(eq=False)
class Holder:
    holder_id: int  # the id the index knows its holds by (the first connection's client id)
    uid: int
    token: bytes
    process: Process
    name: str = ""
    connections: set[int] = field(default_factory=set)


class Holders:
    """Connections -> holders, and the orphaned holders whose process may still copy."""

    def __init__(self) -> None:
        self._by_key: dict[tuple[int, bytes], Holder] = {}
        self._by_client: dict[int, Holder] = {}
        self._by_id: dict[int, Holder] = {}
        self._peers: dict[int, tuple[int, Process]] = {}  # client id -> (uid, process), from accept

    def connect(self, client_id: int, pid: int = 0, uid: int = 0, pidfd: int | None = None) -> None:
        """A connection from process ``pid`` of ``uid``; ``pidfd`` (owned from now on) names a pid-0 peer."""
        self._peers[client_id] = (uid, Process.of(pid, pidfd))

    def attach(self, client_id: int, token: bytes, name: str) -> Holder:
        """The holder ``client_id`` speaks for (after its hello): the one of the same uid, token and process, or a
        new one (a token is never shared between processes: a forked child's inherited token names nothing)."""
        uid, process = self._peers.pop(client_id)
        holder = self._by_key.get((uid, token)) if token else None
        if holder is None or not holder.process.is_same(process):
            holder = Holder(client_id, uid, token or client_id.to_bytes(8, "little"), process, name)
            self._by_key[(uid, holder.token)] = holder
            self._by_id[holder.holder_id] = holder
        else:
            process.close()  # the holder's own names the process
        holder.connections.add(client_id)
        self._by_client[client_id] = holder
        return holder

    def holder_id(self, client_id: int) -> int:
        """The id the index keys this connection's holds by (the client id until hello)."""
        holder = self._by_client.get(client_id)
        return holder.holder_id if holder is not None else client_id

    def name(self, holder_id: int) -> str:
        holder = self._by_id.get(holder_id)
        return holder.name if holder is not None else ""

    def detach(self, client_id: int) -> Holder | None:
        """A connection closed: the holder it spoke for (None before hello), with the connection removed."""
        _uid, process = self._peers.pop(client_id, (0, None))
        if process is not None:  # it never said hello
            process.close()
        holder = self._by_client.pop(client_id, None)
        if holder is not None:
            holder.connections.discard(client_id)
        return holder

    def ids(self) -> set[int]:
        """The ids of every holder known (connected or orphaned)."""
        return set(self._by_id)

    def orphans(self) -> list[Holder]:
        return [h for h in self._by_id.values() if not h.connections]

    def forget(self, holder: Holder) -> None:
        """The holder's holds have ended and no connection speaks for it."""
        if holder.connections:
            return
        self._by_id.pop(holder.holder_id, None)
        if self._by_key.get((holder.uid, holder.token)) is holder:
            del self._by_key[(holder.uid, holder.token)]
        holder.process.close()
