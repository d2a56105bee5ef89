"""The remote store's client: reads through reader.StoreReader, everything else through redis-py.

The only module that imports redis. The data path's reads (``get``, ``read``: pipelined
GETs whose values land where the caller says, e.g. in arena pages) go through the
minimal RESP reader, which ran at 2-3x redis-py's rate here; writes, existence
checks, expiry, deletes and pings through redis-py (one server or a cluster). Every
call is one pipeline (one round trip per node), bounded by the configured timeout,
and raises RemoteStoreError on any failure; the caller counts it and tells the
circuit breaker. Thread-safe: both clients keep connection pools.
"""

from __future__ import annotations

import importlib.util
import threading

from kvshare.pool.remote.config import RemoteAddress
from kvshare.pool.remote.reader import PlaceAt, ReadError, StoreReader


class RemoteStoreError(Exception):
    """A remote operation failed: store unreachable, too slow, or it refused the command."""


class RemoteStore:
    def __init__(self, address: RemoteAddress, timeout_s: float, allowed_hosts: tuple[str, ...] = ()) -> None:
        """``allowed_hosts``: cluster nodes besides the URL's that the cluster may send reads and writes to."""
        if importlib.util.find_spec("redis") is None:  # fail at start, not in the first write
            raise RuntimeError("the remote tier needs the redis client: pip install 'kvshare[remote]'")
        self.address = address
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._redis = None  # built on first use: a cluster client contacts the nodes when it is built
        self._reader = StoreReader(address, timeout_s, allowed_hosts)  # connects on first use

    # -- operations ------------------------------------------------------------------

    def get(
        self, keys: list[str], ttl_s: int, max_value_bytes: int, deadline: float | None = None
    ) -> list[bytearray | None]:
        """Values of ``keys`` (None where absent; a longer one fails the call); with ``ttl_s`` their expiry is
        refreshed (GETEX). All in by ``deadline`` (monotonic), else RemoteStoreError."""
        try:
            return self._reader.get(keys, ttl_s, max_value_bytes, deadline)
        except ReadError as exc:
            raise RemoteStoreError(str(exc)) from None

    def read(
        self,
        keys: list[str],
        ttl_s: int,
        head_bytes: int,
        place: PlaceAt,
        max_value_bytes: int,
        deadline: float | None = None,
    ) -> list[int | None]:
        """GET ``keys``, each at most ``max_value_bytes`` (a longer one fails the call); ``place(i, first head_bytes
        of value i, rest length)`` says where the rest goes.

        Returns each value's length (None: absent). When it returns or raises, no byte is
        written anywhere any more; none is received after ``deadline`` (monotonic: RemoteStoreError).
        """
        try:
            return self._reader.read(keys, ttl_s, head_bytes, place, max_value_bytes, deadline)
        except ReadError as exc:
            raise RemoteStoreError(str(exc)) from None

    def count_existing(self, groups: list[list[str]]) -> list[int]:
        """For each group of keys (one page's parts, one hash slot), how many exist."""
        return self._pipeline(lambda p: [p.exists(*keys) for keys in groups])

    def put(self, keys: list[str], values: list[bytes], ttl_s: int = 0) -> None:
        self._pipeline(lambda p: [p.set(k, v, ex=ttl_s or None) for k, v in zip(keys, values)])

    def expire(self, keys: list[str], ttl_s: int) -> None:
        self._pipeline(lambda p: [p.expire(k, ttl_s) for k in keys])

    def delete(self, keys: list[str]) -> None:
        self._pipeline(lambda p: [p.delete(k) for k in keys])

    def ping(self) -> None:
        self._call(lambda r: r.ping())

    def close(self) -> None:
        with self._lock:
            client, self._redis = self._redis, None
        self._reader.close()
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a client of a dead store may fail; nothing is lost
                pass

    # -- plumbing --------------------------------------------------------------------

    def _pipeline(self, add_commands) -> list:
        def run(client):
            pipe = client.pipeline(transaction=False) if not self.address.is_cluster else client.pipeline()
            add_commands(pipe)
            return pipe.execute()

        return self._call(run)

    def _call(self, operation):
        from redis.exceptions import RedisClusterException, RedisError

        try:
            return operation(self._client())
        except (RedisError, RedisClusterException, OSError) as exc:
            raise RemoteStoreError(f"{self.address.display}: {type(exc).__name__}: {exc}") from None

    def _client(self):
        with self._lock:
            if self._redis is None:
                self._redis = self._connect()
            return self._redis

    def _connect(self):
        import redis
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.retry import Retry

        # One immediate retry, on a broken connection only, replaces a pooled connection that died with a
        # restarted store. A timeout is not retried, and redis-py's default (three retries with backoff)
        # would hold a thread for seconds: the circuit breaker decides when to try again.
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError, ConnectionResetError, BrokenPipeError))
        common = dict(
            socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s, retry=retry, decode_responses=False
        )
        a = self.address
        if not a.is_cluster:  # the URL's own ssl_ca_certs reaches redis-py; a password given apart from it too
            return redis.Redis.from_url(a.url, **common, **({"password": a.password} if a.password else {}))
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(
            startup_nodes=[ClusterNode(h, p) for h, p in a.nodes],
            username=a.username,
            password=a.password,
            ssl=a.is_tls,
            ssl_ca_certs=a.ca_file or None,
            address_remap=self._checked_node,
            **common,
        )

    def _checked_node(self, address: tuple[str, int]) -> tuple[str, int]:
        """redis-py's hook on every node it is about to use: writes go only where reads may (reader.check_node)."""
        from redis.exceptions import RedisClusterException

        try:
            self._reader.check_node(*address)
        except ValueError as exc:
            raise RedisClusterException(str(exc)) from None
        return address
