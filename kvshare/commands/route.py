"""Run the router: a streaming reverse proxy over replicas with a placement policy."""

from __future__ import annotations

import argparse

from kvshare.router.policy import POLICIES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", required=True, help="replica base URL (repeat for each)")
    p.add_argument("--policy", choices=POLICIES, default="round_robin")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    p.add_argument("--session-header", default="X-Session-ID")
    p.add_argument("--session-ttl", type=float, default=3600.0)
    p.add_argument("--api-key", action="append", default=[],
                   help="require this bearer token on /v1/, /tokenize and /detokenize (repeatable); it is passed on "
                        "to replicas")
    p.add_argument("--admin-key-file", default="", metavar="PATH",
                   help="file holding the key /admin/ needs (default: $KVSHARE_ADMIN_KEY; API keys are not enough; "
                        "with API keys and no admin key, /admin/ is refused)")
    p.add_argument("--admin-key", default="", help="the admin key itself (visible in ps: prefer --admin-key-file)")
    p.add_argument("--tenant-header", default="",
                   help="the replicas' --tenant-header: cache_aware remembers prefixes per tenant, as the pool does")
    p.add_argument("--expose-replica-header", action="store_true",
                   help="add X-KVShare-Replica (the replica that served) to responses: it tells a client where a "
                        "prefix lives, so it is off by default")
    p.add_argument("--write-timeout", type=float, default=30.0,
                   help="seconds a client may take to accept one write of a response before it is dropped")
    p.add_argument("--instance-id", default="", help="an id /health reports (kvshare up checks it is its child)")


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvshare.errors import UserError
    from kvshare.heap import freeze_startup_heap
    from kvshare.preflight import check_ports_free
    from kvshare.router.proxy import RouterConfig, RouterServer

    from kvshare.credentials import read_secret

    try:
        admin_key = read_secret("admin key", args.admin_key_file, "KVSHARE_ADMIN_KEY", args.admin_key)
        config = RouterConfig(replicas=tuple(args.replica), policy=args.policy, host=args.host, port=args.port,
                              health_interval_s=args.health_interval, session_header=args.session_header,
                              session_ttl_s=args.session_ttl, api_keys=tuple(args.api_key),
                              write_timeout_s=args.write_timeout, instance_id=args.instance_id, admin_key=admin_key,
                              tenant_header=args.tenant_header, expose_replica_header=args.expose_replica_header)
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
