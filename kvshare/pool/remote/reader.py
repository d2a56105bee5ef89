"""The data path's reads from the store: pipelined GETs over pooled RESP connections, spread over cluster nodes.

::

    read(keys, place)   keys --(hash slot, cluster only)--> one pipeline per node
                        node pipelines run at once, each on a connection of its own
                        (threads: the socket reads release the GIL), replies in key order per node

A connection is taken from its node's pool for one pipeline and put back after
it; one that fails is closed. A pooled connection that turns out broken (the
store restarted) is replaced and the pipeline sent once more; a timeout is not
retried. A cluster's slot map comes from CLUSTER SLOTS and is read again after
a MOVED reply (that pipeline is then sent once more). A map that names a node
outside the configured ones (the URL's hosts and ``allowed_hosts``, by name or
address) is refused: a store that lies must not send reads, and the pages they
fill, to a host of its choosing. Every failure surfaces as ReadError; the caller
counts it and tells the circuit breaker.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from kvshare.pool.remote.config import RemoteAddress
from kvshare.pool.remote.resp import MAX_REPLY_BYTES, Endpoint, ReplyTooLong, RespConnection, RespError, server_endpoint

log = logging.getLogger("kvshare.pool.remote")

NUM_SLOTS = 16384
# place(key index, head, rest length) -> where the rest of that key's value goes (None: drop it)
PlaceAt = Callable[[int, bytes, int], "memoryview | None"]


class ReadError(Exception):
    """A read failed: the store is unreachable, too slow, or answered with an error."""


class _Moved(Exception):
    pass


class _Refused(ValueError):
    """The cluster named a node that is not among the configured ones."""


def _names_and_addresses(hosts: list[str]) -> set[str]:
    """``hosts`` and the addresses they resolve to (a name that does not resolve stands for itself only)."""
    found = set(hosts)
    for host in hosts:
        try:
            found.update(info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM))
        except (OSError, UnicodeError):
            pass
    return found


def crc16(data: bytes) -> int:
    """CRC-16/XMODEM, the cluster's key hash."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        crc &= 0xFFFF
    return crc


def key_slot(key: str) -> int:
    """The cluster slot of a key: of its hash tag ``{...}`` when it has a non-empty one."""
    data = key.encode()
    start = data.find(b"{")
    if start >= 0:
        end = data.find(b"}", start + 1)
        if end > start + 1:
            data = data[start + 1 : end]
    return crc16(data) % NUM_SLOTS


class StoreReader:
    """Pipelined GETs against one server or a cluster; thread-safe."""

    def __init__(self, address: RemoteAddress, timeout_s: float, allowed_hosts: tuple[str, ...] = ()) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.allowed_hosts = allowed_hosts  # cluster nodes besides the URL's (RemoteConfig.allow_hosts)
        self._allowed: set[str] | None = None  # their names and addresses; resolved on first use
        self._lock = threading.Lock()
        self._idle: dict[Endpoint, list[RespConnection]] = {}
        self._is_closed = False
        if address.is_cluster:
            self._seeds = [
                Endpoint(h, p, "", address.is_tls, address.username, address.password, 0, address.ca_file)
                for h, p in address.nodes
            ]
            self._slots: list[Endpoint] | None = None  # slot -> primary; read on first use
        else:
            self._server = server_endpoint(address)
        self._fanout: ThreadPoolExecutor | None = None  # reads of one call on several nodes at once

    def read(
        self,
        keys: list[str],
        ttl_s: int,
        head_bytes: int,
        place: PlaceAt,
        max_value_bytes: int,
        deadline: float | None = None,
    ) -> list[int | None]:
        """GET (GETEX with ``ttl_s``) every key, each at most ``max_value_bytes``; its length, or None where absent.

        Raises ReadError (a value over the bound too: the store is lying or holds what this reader cannot use; a
        reply not in by ``deadline``, monotonic, too: no byte is received after it)."""
        if not keys:
            return []
        lengths: list[int | None] = [None] * len(keys)
        for attempt in range(2):
            try:
                groups = self._by_node(list(range(len(keys))), keys, deadline)
                if len(groups) == 1:
                    [(endpoint, indices)] = groups.items()
                    self._read_node(
                        endpoint, indices, keys, ttl_s, head_bytes, place, lengths, max_value_bytes, deadline
                    )
                else:
                    pool = self._fanout_pool()
                    args = (keys, ttl_s, head_bytes, place, lengths, max_value_bytes, deadline)
                    futures = [pool.submit(self._read_node, e, ix, *args) for e, ix in groups.items()]
                    # every node's read ends before this returns: none may write into a page after it
                    errors = [f.exception() for f in futures]
                    for error in errors:
                        if error is not None:
                            raise error
                return lengths
            except _Moved:
                with self._lock:
                    self._slots = None  # the cluster changed: read the slot map again, send once more
                if attempt:
                    raise ReadError(f"{self.address.display}: keys kept moving between cluster nodes") from None
            except (OSError, EOFError, RespError, ValueError) as exc:
                if isinstance(exc, (ReplyTooLong, _Refused)):
                    log.warning("remote store %s: %s; nothing of that read is used", self.address.display, exc)
                raise ReadError(f"{self.address.display}: {type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")

    def get(
        self, keys: list[str], ttl_s: int = 0, max_value_bytes: int = MAX_REPLY_BYTES, deadline: float | None = None
    ) -> list[bytearray | None]:
        """Whole values of at most ``max_value_bytes`` (a fresh buffer each, received straight into it), None where
        absent; all in by ``deadline`` (monotonic), else ReadError."""
        values: list[bytearray | None] = [None] * len(keys)

        def into_new_buffer(i: int, head: bytes, rest: int) -> memoryview:
            values[i] = value = bytearray(len(head) + rest)
            value[: len(head)] = head
            return memoryview(value)[len(head) :]

        self.read(keys, ttl_s, 4096, into_new_buffer, max_value_bytes, deadline)
        return values

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            idle, self._idle = self._idle, {}
            fanout, self._fanout = self._fanout, None
        for connections in idle.values():
            for c in connections:
                c.close()
        if fanout is not None:
            fanout.shutdown(wait=False)

    # -- one node ---------------------------------------------------------------------

    def _read_node(
        self,
        endpoint: Endpoint,
        indices: list[int],
        keys: list[str],
        ttl_s: int,
        head_bytes: int,
        place: PlaceAt,
        lengths: list,
        max_value_bytes: int,
        deadline: float | None,
    ) -> None:
        commands = [("GETEX", keys[i], "EX", ttl_s) if ttl_s else ("GET", keys[i]) for i in indices]
        connection, is_reused = self._take(endpoint, deadline)
        try:
            try:
                connection.send(commands)
            except (BrokenPipeError, ConnectionResetError):
                if not is_reused:
                    raise
                connection.close()  # a pooled connection that died with a restarted store: once more, fresh
                connection, is_reused = self._connect(endpoint, deadline), False
                connection.send(commands)
            connection.receive_until(deadline)
            moved = None
            for i in indices:
                reply = connection.read_bulk_into(
                    head_bytes, lambda head, rest, i=i: place(i, head, rest), max_value_bytes
                )
                if isinstance(reply, RespError):
                    if str(reply).startswith(("MOVED", "ASK")):
                        moved = reply  # read the other replies, so the connection stays usable
                        continue
                    raise reply
                lengths[i] = reply
        except BaseException:
            connection.close()
            raise
        connection.receive_until(None)
        self._give_back(endpoint, connection)
        if moved is not None:
            raise _Moved(str(moved))

    def _take(self, endpoint: Endpoint, deadline: float | None) -> tuple[RespConnection, bool]:
        with self._lock:
            idle = self._idle.get(endpoint)
            if idle:
                return idle.pop(), True
        return self._connect(endpoint, deadline), False

    def _connect(self, endpoint: Endpoint, deadline: float | None = None) -> RespConnection:
        return RespConnection(endpoint, self.timeout_s, deadline)

    def _give_back(self, endpoint: Endpoint, connection: RespConnection) -> None:
        with self._lock:
            if not self._is_closed:
                self._idle.setdefault(endpoint, []).append(connection)
                return
        connection.close()

    def _fanout_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._fanout is None:
                self._fanout = ThreadPoolExecutor(8, thread_name_prefix="kvshare-remote-node")
            return self._fanout

    # -- cluster routing ----------------------------------------------------------------

    def _by_node(self, indices: list[int], keys: list[str], deadline: float | None) -> dict[Endpoint, list[int]]:
        if not self.address.is_cluster:
            return {self._server: indices}
        slots = self._slot_map(deadline)
        groups: dict[Endpoint, list[int]] = {}
        for i in indices:
            groups.setdefault(slots[key_slot(keys[i])], []).append(i)
        return groups

    def _slot_map(self, deadline: float | None) -> list[Endpoint]:
        with self._lock:
            if self._slots is not None:
                return self._slots
        error: BaseException | None = None
        for seed in self._seeds:  # any reachable node knows the whole map
            try:
                connection = self._connect(seed, deadline)
                try:
                    [reply] = connection.execute([("CLUSTER", "SLOTS")])
                finally:
                    connection.close()
                if isinstance(reply, RespError):
                    raise reply
                slots = self._parse_slots(reply, seed)
                for endpoint in set(slots):
                    self.check_node(endpoint.host, endpoint.port)
                break
            except _Refused:
                raise
            except (OSError, EOFError, RespError, ValueError) as exc:
                error = exc
        else:
            raise ReadError(f"{self.address.display}: no cluster node gave its slot map: {error}")
        with self._lock:
            self._slots = slots
        return slots

    def check_node(self, host: str, port: int) -> None:
        """Raise (_Refused, a ValueError) unless ``host`` is one of the configured nodes' hosts, by name or address."""
        with self._lock:
            if self._allowed is None:
                self._allowed = _names_and_addresses([h for h, _ in self.address.nodes] + list(self.allowed_hosts))
            allowed = self._allowed
        if host not in allowed and not (_names_and_addresses([host]) & allowed):
            raise _Refused(
                f"the cluster names node {host}:{port}, which is not among the configured nodes: add it "
                "to the URL or to --remote-allow-host if it is yours"
            )

    @staticmethod
    def _parse_slots(reply: list, seed: Endpoint) -> list[Endpoint]:
        slots: list[Endpoint | None] = [None] * NUM_SLOTS
        for first, last, primary, *_replicas in reply:
            host = primary[0].decode() or seed.host  # an empty host: the node we asked
            endpoint = replace(seed, host=host, port=int(primary[1]))
            slots[first : last + 1] = [endpoint] * (last + 1 - first)
        if any(e is None for e in slots):
            raise ValueError("the cluster does not cover every slot")
        return slots  # type: ignore[return-value]
