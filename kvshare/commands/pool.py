"""Run the pool daemon: one shared-memory arena, its index and eviction, on a Unix socket."""

from __future__ import annotations

import argparse

from kvshare.commands import tcp_port
from kvshare.units import parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_arena_arguments(p)
    _add_access_arguments(p)
    _add_limit_arguments(p)
    _add_remote_arguments(p)
    _add_event_arguments(p)


def _add_arena_arguments(p: argparse.ArgumentParser) -> None:
    """The arena (size, extents, hugepages, direct lookups) and the socket clients reach it on."""
    p.add_argument(
        "--size",
        "--pool-size",
        dest="size",
        type=parse_size,
        required=True,
        help="arena size, e.g. 16GiB (up to the host's memory)",
    )
    p.add_argument("--socket", default=None, help="Unix socket path (default: a private per-user directory)")
    p.add_argument(
        "--extent-size",
        type=parse_size,
        default=None,
        help="allocation and CUDA registration unit; must hold the largest page (default: 1GiB for a "
        "pool of 16GiB or more, down to 256MiB for smaller pools, keeping at least 16 extents)",
    )
    p.add_argument(
        "--hugepages",
        nargs="?",
        const="on",
        default="auto",
        choices=("auto", "on", "off"),
        help="back the arena with reserved 2 MiB hugepages: auto (default) when enough are free, "
        "on (also plain --hugepages) or an error, off never; docs/operations.md, 'Hugepages'",
    )
    p.add_argument("--prefault", action="store_true", help="fault in every page at start")
    p.add_argument(
        "--direct-lookups",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="offer clients that ask for it (the engines' pool links) a read-only directory of committed pages and a "
        "hold table of their own, so a fully committed chain is leased with no round trip (x86-64 Linux with "
        "membarrier; elsewhere every lookup takes the round trip). Default: on",
    )


def _add_access_arguments(p: argparse.ArgumentParser) -> None:
    """Who may reach the pool: its metrics port and its socket's permissions."""
    p.add_argument("--metrics-port", type=tcp_port, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address the metrics port listens on")
    p.add_argument(
        "--socket-mode",
        type=lambda s: int(s, 8),
        default=0o600,
        help="socket file mode, octal (default 0600: owner only)",
    )
    p.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        default=[],
        help="uid allowed to connect (repeatable; default: the daemon's own uid)",
    )


def _add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """When the pool evicts and expires, and what one message or account may take."""
    p.add_argument(
        "--high-watermark", type=float, default=0.95, help="eviction starts when this share of the pool is used"
    )
    p.add_argument("--low-watermark", type=float, default=0.90, help="eviction stops at this share of the pool used")
    p.add_argument("--lease-ttl", type=float, default=300.0, help="seconds before an unreleased lease expires")
    p.add_argument(
        "--reservation-ttl",
        type=float,
        default=600.0,
        help="seconds before a reservation never committed nor aborted is aborted (longer than any copy)",
    )
    p.add_argument(
        "--max-message-bytes",
        type=parse_size,
        default="1MiB",
        help="largest control message a client may send (larger: that connection is closed)",
    )
    p.add_argument(
        "--namespace-quota",
        type=parse_size,
        default=None,
        metavar="SIZE",
        help="bytes one account (a tenant identity, whatever cache_salt it sends; else one namespace) "
        "may hold; over it a store evicts that account's own least recently used chunks, then "
        "stores fewer (default: no quota)",
    )


def _add_event_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the KV events (kvshare.pool.event_publisher.KVEventsConfig; docs/operations.md, KV events)."""
    g = p.add_argument_group("KV events (what the pool holds, in vLLM's wire format, for llm-d, Dynamo, pool_aware)")
    g.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="publish commits and evictions on a ZMQ PUB socket, e.g. tcp://*:5557",
    )
    g.add_argument(
        "--kv-events-replay",
        default=None,
        metavar="ENDPOINT",
        help="answer replay requests (start sequence -> buffered batches) on a ROUTER socket here",
    )
    g.add_argument(
        "--kv-events-topic",
        action="append",
        default=[],
        metavar="TOPIC",
        help="publish every batch on this topic, e.g. kv@<replica>@<model> (repeatable; "
        "default: one pool topic, kv@kvshare-pool@kvshare)",
    )
    g.add_argument(
        "--kv-events-positional", action="store_true", help="encode events as arrays (vLLM before 0.26) instead of maps"
    )
    g.add_argument(
        "--kv-events-bytes-hashes",
        action="store_true",
        help="block hashes as the chunk keys' 16 bytes instead of 64-bit ints (vLLM's default)",
    )
    g.add_argument(
        "--kv-events-block-size",
        type=int,
        default=256,
        help="tokens per page, announced for pages whose writer sent no token ids",
    )


def _events_config_from_args(args: argparse.Namespace):
    if not args.kv_events:
        return None
    from kvshare.pool.event_publisher import POOL_TOPIC, KVEventsConfig

    return KVEventsConfig(
        endpoint=args.kv_events,
        replay_endpoint=args.kv_events_replay,
        topics=tuple(args.kv_events_topic) or (POOL_TOPIC,),
        encoding="positional" if args.kv_events_positional else "map",
        hash_kind="bytes" if args.kv_events_bytes_hashes else "int",
        block_size=args.kv_events_block_size,
    )


def _add_remote_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of the remote tier (kvshare.pool.remote.config.RemoteConfig, one flag per field; docs/remote.md)."""
    g = p.add_argument_group("remote tier (share pages with pools on other hosts through Redis/Valkey)")
    _add_remote_store_arguments(g)
    _add_remote_transfer_arguments(g)
    _add_remote_breaker_arguments(g)
    _add_remote_trust_arguments(g)


def _add_remote_store_arguments(g: argparse._ArgumentGroup) -> None:
    """Which store the tier uses, under which keys, and how pages travel to it."""
    g.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="redis://HOST:PORT[/DB], rediss://..., unix:///PATH or redis+cluster://HOST:PORT,HOST:PORT,...",
    )
    g.add_argument("--remote-prefix", default="kvshare", help="key prefix shared by the pools that share pages")
    g.add_argument(
        "--remote-ttl",
        type=int,
        default=86400,
        help="seconds a written page lives in the store, refreshed when read (0: no expiry)",
    )
    g.add_argument(
        "--remote-part-size",
        type=parse_size,
        default="8MiB",
        help="a page travels as values of at most this size (4KiB..8MiB)",
    )
    g.add_argument("--remote-timeout", type=float, default=1.0, help="connect and socket timeout, seconds")


def _add_remote_transfer_arguments(g: argparse._ArgumentGroup) -> None:
    """How many pages move at once, in which threads, and how long a lookup waits for them."""
    g.add_argument(
        "--remote-write-queue",
        type=parse_size,
        default="1GiB",
        help="pages pinned for write-behind, at most (and at most a quarter of the arena)",
    )
    g.add_argument("--remote-writers", type=int, default=2, help="write-behind threads")
    g.add_argument("--remote-readers", type=int, default=2, help="promotion threads")
    g.add_argument(
        "--remote-promote-timeout",
        type=float,
        default=5.0,
        help="a lookup that goes on to the store is answered by then with what has arrived",
    )
    g.add_argument("--remote-promote-batch", type=parse_size, default="64MiB", help="pages fetched per round trip")
    g.add_argument("--remote-max-promotions", type=int, default=4, help="promoting lookups under way at once")


def _add_remote_breaker_arguments(g: argparse._ArgumentGroup) -> None:
    """When failed store operations stop the tier, and for how long."""
    g.add_argument(
        "--remote-breaker-failures",
        type=int,
        default=3,
        help="consecutive failed store operations that open the circuit breaker",
    )
    g.add_argument(
        "--remote-breaker-reset",
        type=float,
        default=5.0,
        help="seconds the breaker stays open before it lets one operation try",
    )


def _add_remote_trust_arguments(g: argparse._ArgumentGroup) -> None:
    """Which hosts, password and page key the tier trusts."""
    g.add_argument(
        "--remote-allow-host",
        action="append",
        default=[],
        metavar="HOST",
        help="a cluster node's host besides those of the URL (repeatable): slot maps and redirects to any "
        "other host are refused",
    )
    g.add_argument(
        "--remote-password-file",
        default="",
        metavar="PATH",
        help="file holding the store's password (ACL user: in the URL, redis://USER@HOST:PORT; default: "
        "$KVSHARE_REMOTE_PASSWORD), so that it is not on the command line",
    )
    g.add_argument(
        "--remote-auth-key-file",
        default="",
        metavar="PATH",
        help="file holding the page key (at least 16 bytes; default: $KVSHARE_REMOTE_AUTH_KEY): pages are "
        "tagged with it, and pages without a valid tag are treated as absent. Pools that share "
        "pages share the key (default: none, the store is trusted)",
    )


def _remote_config_from_args(args: argparse.Namespace):
    if not args.remote:
        return None
    from kvshare.credentials import read_secret
    from kvshare.pool.remote.config import RemoteConfig

    auth_key = read_secret("remote page key", args.remote_auth_key_file, "KVSHARE_REMOTE_AUTH_KEY").encode()
    password = read_secret("remote password", args.remote_password_file, "KVSHARE_REMOTE_PASSWORD")
    return RemoteConfig(
        url=args.remote,
        prefix=args.remote_prefix,
        ttl_s=args.remote_ttl,
        part_bytes=args.remote_part_size,
        timeout_s=args.remote_timeout,
        write_queue_bytes=args.remote_write_queue,
        num_writers=args.remote_writers,
        num_readers=args.remote_readers,
        promote_timeout_s=args.remote_promote_timeout,
        promote_batch_bytes=args.remote_promote_batch,
        max_promotions=args.remote_max_promotions,
        breaker_failures=args.remote_breaker_failures,
        breaker_reset_s=args.remote_breaker_reset,
        auth_key=auth_key,
        allow_hosts=tuple(args.remote_allow_host),
        password=password,
    )


def config_from_args(args: argparse.Namespace):
    from kvshare.paths import default_pool_socket
    from kvshare.pool.config import PoolConfig
    from kvshare.pool.index import IndexConfig

    return PoolConfig(
        socket_path=args.socket or default_pool_socket(),
        size_bytes=args.size,
        extent_bytes=args.extent_size,
        hugepages=args.hugepages,
        prefault=args.prefault,
        socket_mode=args.socket_mode,
        allowed_uids=tuple(args.allow_uid),
        max_message_bytes=args.max_message_bytes,
        index=IndexConfig(
            high_watermark=args.high_watermark,
            low_watermark=args.low_watermark,
            lease_ttl_s=args.lease_ttl,
            reservation_ttl_s=args.reservation_ttl,
            namespace_quota_bytes=args.namespace_quota or 0,
        ),
        remote=_remote_config_from_args(args),
        kv_events=_events_config_from_args(args),
        direct_lookups=args.direct_lookups,
    )


def run(args: argparse.Namespace) -> int:
    import signal

    from kvshare.errors import UserError
    from kvshare.pool.arena import HUGEPAGE_BYTES, ArenaError
    from kvshare.pool.daemon import PoolServer
    from kvshare.preflight import check_pool_size, check_socket_dir
    from kvshare.units import format_bytes

    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    check_pool_size(config.size_bytes)
    check_socket_dir(config.socket_path)
    server = PoolServer(config)
    try:
        server.start()
    except (ArenaError, FileExistsError, OSError, RuntimeError) as exc:  # RuntimeError: no redis client
        raise UserError(str(exc)) from None
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    if args.metrics_port is not None:
        from kvshare.pool.metrics import serve_metrics

        serve_metrics(lambda: server.stats_snapshot, args.metrics_port, args.metrics_host)
    remote = f" remote={config.remote.address.display}" if config.remote else ""
    pages = server.handlers.arena_page_bytes
    is_small = config.size_bytes < 1 << 30  # a page table's cost shows on GPU loads of GiBs, not on a small pool
    hint = (
        ""
        if pages >= HUGEPAGE_BYTES or config.hugepages == "off" or is_small
        else (
            f" (too few free hugepages: `sysctl vm.nr_hugepages={-(-config.size_bytes // HUGEPAGE_BYTES)}` puts the "
            f"arena on 2 MiB pages; docs/operations.md, Hugepages)"
        )
    )
    print(
        f"kvshare pool ready: socket={config.socket_path} size={config.size_bytes} "
        f"page={format_bytes(pages)}{remote}{hint}",
        flush=True,
    )
    server.serve()
    return 0
