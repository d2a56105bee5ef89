"""Configuration of the pool's remote tier (``kvshare pool --remote URL``); pure, no redis import.

URL forms::

    redis://[[user]:password@]HOST:PORT[/DB]      one Redis or Valkey server
    rediss://...                                   the same over TLS
    unix://[[user]:password@]/path/to/socket[?db=N]
    redis+cluster://[[user]:password@]HOST:PORT,HOST:PORT,...   a cluster (startup nodes)
    rediss+cluster://...                           a cluster over TLS

TLS checks the server against the system's CAs, or the file of ``?ssl_ca_certs=PATH``
(redis-py's name). The password may come from ``RemoteConfig.password``
(``--remote-password-file``, ``$KVSHARE_REMOTE_PASSWORD``) instead of the URL, which the
command line shows to every user of the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from urllib.parse import parse_qs, unquote, urlsplit

MiB = 1 << 20
MAX_PART_BYTES = 8 * MiB  # one value blocks a Redis server while it is read or written: keep each small
MIN_PART_BYTES = 4096
MIN_AUTH_KEY_BYTES = 16  # a page key shorter than a tag would be the weak point

_SCHEMES = {
    "redis": (False, False),
    "rediss": (False, True),
    "unix": (False, False),
    "redis+cluster": (True, False),
    "rediss+cluster": (True, True),
}


@dataclass(frozen=True)
class RemoteAddress:
    """Where the remote store is: a server URL for redis-py, or a cluster's startup nodes."""

    url: str  # as given (may hold a password: never log it, use ``display``)
    is_cluster: bool
    is_tls: bool
    nodes: tuple[tuple[str, int], ...]  # cluster startup nodes; empty for a single server
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # a cluster URL's, or RemoteConfig.password
    ca_file: str = ""  # ?ssl_ca_certs=PATH: the CAs TLS checks the server against (empty: the system's)

    @property
    def display(self) -> str:
        """The URL without its credentials, for logs."""
        parts = urlsplit(self.url)
        host = parts.netloc.rpartition("@")[2]
        return f"{parts.scheme}://{host}{parts.path}"


def parse_remote_url(url: str) -> RemoteAddress:
    """Check and split a ``--remote`` URL; raises ValueError with the accepted forms."""
    parts = urlsplit(url)
    if parts.scheme not in _SCHEMES:
        raise ValueError(
            f"unsupported remote URL {url!r}: use redis://HOST:PORT[/DB], rediss://..., unix:///PATH "
            "or redis+cluster://HOST:PORT,HOST:PORT,..."
        )
    is_cluster, is_tls = _SCHEMES[parts.scheme]
    ca_file = parse_qs(parts.query).get("ssl_ca_certs", [""])[0]
    if ca_file and not is_tls:
        raise ValueError(f"remote URL {url!r}: ssl_ca_certs needs TLS (rediss:// or rediss+cluster://)")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    if not is_cluster:
        if parts.scheme != "unix" and not hosts:
            raise ValueError(f"remote URL {url!r} names no host")
        if parts.scheme != "unix" and parts.path.strip("/") and not parts.path.strip("/").isdigit():
            raise ValueError(f"remote URL {url!r}: the path must be a database number, e.g. /0")
        return RemoteAddress(url, False, is_tls, (), ca_file=ca_file)
    if parts.path.strip("/") not in ("", "0"):
        raise ValueError(f"remote URL {url!r}: a cluster has only database 0")
    nodes = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"remote URL {url!r}: cluster nodes must be HOST:PORT, got {item!r}")
        nodes.append((host.strip("[]"), int(port)))
    return RemoteAddress(url, True, is_tls, tuple(nodes), unquote(username) or None, unquote(password) or None, ca_file)


@dataclass(frozen=True)
class RemoteConfig:
    """The remote tier's settings; each field is one ``--remote-*`` flag of ``kvshare pool``."""

    url: str
    prefix: str = "kvshare"  # namespace of every key this pool writes (pools that share pages share it)
    ttl_s: int = 86400  # expiry of written values, refreshed when read; 0: none (rely on maxmemory eviction)
    part_bytes: int = MAX_PART_BYTES  # a page travels as values of at most this many payload bytes
    timeout_s: float = 1.0  # connect and socket timeout of every remote operation
    write_queue_bytes: int = 1 << 30  # pages pinned for write-behind, at most (also at most 1/4 of the arena)
    num_writers: int = 2  # write-behind threads
    num_readers: int = 2  # promotion threads (fetch from the store, copy into the arena)
    promote_timeout_s: float = 5.0  # a promoting lookup is answered by then with what has arrived
    promote_batch_bytes: int = 64 * MiB  # pages fetched per round trip
    max_promotions: int = 4  # promoting lookups in flight; more are answered from the arena alone
    breaker_failures: int = 3  # consecutive failed operations that open the circuit breaker
    breaker_reset_s: float = 5.0  # how long it stays open before one trial
    # --remote-auth-key-file / $KVSHARE_REMOTE_AUTH_KEY: pages are tagged with it and read only with a valid tag
    # (format.check_page); empty: the store is trusted
    auth_key: bytes = field(default=b"", repr=False)
    allow_hosts: tuple[str, ...] = ()  # --remote-allow-host: cluster nodes besides the URL's hosts
    password: str = field(default="", repr=False)  # --remote-password-file, $KVSHARE_REMOTE_PASSWORD; else the URL's

    def __post_init__(self) -> None:
        if self.password and urlsplit(self.url).password:
            raise ValueError("the remote password is in the URL and given again (file or environment): give it once")
        _ = self.address  # parsing the URL validates it
        if not self.prefix or any(c in self.prefix for c in "{} \n"):
            raise ValueError(f"remote prefix must be non-empty without braces or spaces, got {self.prefix!r}")
        if self.ttl_s < 0:
            raise ValueError(f"remote TTL must be >= 0 seconds (0: none), got {self.ttl_s}")
        if not MIN_PART_BYTES <= self.part_bytes <= MAX_PART_BYTES:
            raise ValueError(
                f"remote part size must lie in {MIN_PART_BYTES}..{MAX_PART_BYTES} bytes, got {self.part_bytes}"
            )
        if self.auth_key and len(self.auth_key) < MIN_AUTH_KEY_BYTES:
            raise ValueError(
                f"the remote page key must have at least {MIN_AUTH_KEY_BYTES} bytes, got "
                f"{len(self.auth_key)} (e.g. head -c 32 /dev/urandom | base64 > FILE)"
            )
        for name in ("timeout_s", "promote_timeout_s", "breaker_reset_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RemoteConfig.{name} must be positive, got {getattr(self, name)}")
        for name in (
            "write_queue_bytes",
            "num_writers",
            "num_readers",
            "promote_batch_bytes",
            "max_promotions",
            "breaker_failures",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"RemoteConfig.{name} must be at least 1, got {getattr(self, name)}")

    @property
    def address(self) -> RemoteAddress:
        address = parse_remote_url(self.url)
        return replace(address, password=self.password) if self.password else address

    def check_reservation_ttl(self, reservation_ttl_s: float) -> None:
        """A promotion's fetch into reserved pages ends by its deadline (promote timeout + timeout): well inside
        the reservations' TTL, so a healthy fetch never outlives the TTL it is kept past."""
        if reservation_ttl_s < 2 * (self.timeout_s + self.promote_timeout_s):
            raise ValueError(
                f"--reservation-ttl {reservation_ttl_s} s is too short for the remote tier (timeout {self.timeout_s} "
                f"s, promote timeout {self.promote_timeout_s} s): make it at least 2x their sum"
            )

    def check_lease_ttl(self, lease_ttl_s: float) -> None:
        """Write-behind pins pages with leases: the store's timeouts must fit well inside their TTL."""
        if lease_ttl_s < 4 * (self.timeout_s + self.promote_timeout_s):
            raise ValueError(
                f"--lease-ttl {lease_ttl_s} s is too short for the remote tier (timeout {self.timeout_s} s, "
                f"promote timeout {self.promote_timeout_s} s): make it at least 4x their sum"
            )
