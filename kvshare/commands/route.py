"""Run the router: a streaming reverse proxy over replicas with a placement policy."""

from __future__ import annotations

import argparse

from kvshare.commands import tcp_port
from kvshare.router.policy import POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", required=True, help="replica base URL (repeat for each)")
    p.add_argument("--policy", choices=POLICIES, default="round_robin")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=tcp_port, default=8080)
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    p.add_argument("--session-header", default="X-Session-ID")
    p.add_argument("--session-ttl", type=float, default=3600.0)
    p.add_argument("--api-key", action="append", default=[],
                   help="require this bearer token on /v1/ and /admin/ (repeatable); it is passed on to replicas")
    p.add_argument("--write-timeout", type=float, default=30.0,
                   help="seconds a client may take to accept one write of a response before it is dropped")
    p.add_argument("--instance-id", default="", help="an id /health reports (kvshare up checks it is its child)")


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvshare.errors import UserError
    from kvshare.heap import freeze_startup_heap
    from kvshare.preflight import check_ports_free
    from kvshare.router.proxy import RouterConfig, RouterServer

    try:
        config = RouterConfig(replicas=tuple(args.replica), policy=args.policy, host=args.host, port=args.port,
                              health_interval_s=args.health_interval, session_header=args.session_header,
                              session_ttl_s=args.session_ttl, api_keys=tuple(args.api_key),
                              write_timeout_s=args.write_timeout, instance_id=args.instance_id)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    check_ports_free(config.host, {config.port: "the router"})
    server = RouterServer(config)
    ready = f"kvshare router ready: http://{config.host}:{config.port} policy={config.policy}"
    freeze_startup_heap()  # the collector never walks the startup heap again (kvshare.heap)
    try:
        web.run_app(server.app(), host=config.host, port=config.port, print=lambda _: print(ready, flush=True),
                    access_log=None)
    except OSError as exc:  # the port was taken after the check
        raise UserError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    return 0
