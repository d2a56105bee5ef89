"""Run the pool daemon: one shared-memory arena, its index and eviction, on a Unix socket."""

from __future__ import annotations

import argparse

from kvshare.units import parse_size


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", "--pool-size", dest="size", type=parse_size, required=True,
                   help="arena size, e.g. 16GiB (up to the host's memory)")
    p.add_argument("--socket", default=None, help="Unix socket path (default: a private per-user directory)")
    p.add_argument("--extent-size", type=parse_size, default="256MiB",
                   help="allocation and CUDA registration unit; must hold the largest page (default 256MiB)")
    p.add_argument("--hugepages", action="store_true", help="back the arena with reserved 2 MiB hugepages")
    p.add_argument("--prefault", action="store_true", help="fault in every page at start")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-host", default="127.0.0.1")
    p.add_argument("--socket-mode", type=lambda s: int(s, 8), default=0o600,
                   help="socket file mode, octal (default 0600: owner only)")
    p.add_argument("--allow-uid", type=int, action="append", default=[],
                   help="uid allowed to connect (repeatable; default: the daemon's own uid)")
    p.add_argument("--high-watermark", type=float, default=0.95)
    p.add_argument("--low-watermark", type=float, default=0.90)
    p.add_argument("--lease-ttl", type=float, default=300.0, help="seconds before an unreleased lease expires")
    p.add_argument("--max-message-bytes", type=parse_size, default="1MiB")


def config_from_args(args: argparse.Namespace):
    from kvshare.paths import default_pool_socket
    from kvshare.pool.daemon import PoolConfig
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
            high_watermark=args.high_watermark, low_watermark=args.low_watermark, lease_ttl_s=args.lease_ttl
        ),
    )


def run(args: argparse.Namespace) -> int:
    import signal

    from kvshare.errors import UserError
    from kvshare.pool.arena import ArenaError
    from kvshare.pool.daemon import PoolServer

    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    server = PoolServer(config)
    try:
        server.start()
    except (ArenaError, FileExistsError, OSError) as exc:
        raise UserError(str(exc)) from None
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    if args.metrics_port is not None:
        from kvshare.pool.metrics import serve_metrics

        serve_metrics(lambda: server.stats_snapshot, args.metrics_port, args.metrics_host)
    print(f"kvshare pool ready: socket={config.socket_path} size={config.size_bytes}", flush=True)
    server.serve()
    return 0
