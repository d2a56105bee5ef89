"""Run the router: a streaming reverse proxy over replicas with a placement policy."""

from __future__ import annotations

import argparse

from kvshare.commands import tcp_port
from kvshare.router.cost_model import CostModel
from kvshare.router.policy import POLICIES
from kvshare.router.pool_aware import PoolAwareConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replica", action="append", required=True, help="replica base URL (repeat for each)")
    p.add_argument("--policy", choices=POLICIES, default="round_robin", help="how a request picks its replica (README)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=tcp_port, default=8080, help="port to listen on")
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks")
    _add_session_arguments(p)
    _add_access_arguments(p)
    p.add_argument(
        "--engine",
        choices=("builtin", "vllm"),
        default="builtin",
        help="what the replicas run. vllm: with --api-key or --tenant-header the router sets each "
        "request's cache_salt to its tenant's (the client's cache_salt splits only its own share), "
        "since vLLM replicas see no tenant; built-in replicas salt themselves; --policy pool_aware asks a "
        "vLLM stream for its usage chunk, to measure the replica, and takes it out of what a client that did "
        "not ask gets, and counts a replica's queue as the prefill ahead (vLLM batches decodes). Default builtin",
    )
    _add_response_arguments(p)
    p.add_argument("--instance-id", default="", help="an id /health reports (kvshare up checks it is its child)")
    _add_hint_arguments(p)
    _add_pool_aware_arguments(p)


def _add_session_arguments(p: argparse.ArgumentParser) -> None:
    """How a session is named and how long its placement is remembered."""
    p.add_argument(
        "--session-header", default="X-Session-ID", help="header naming a session (else the body's user field)"
    )
    p.add_argument(
        "--session-ttl",
        type=float,
        default=3600.0,
        help="seconds a session's placement is remembered after its last turn",
    )


def _add_access_arguments(p: argparse.ArgumentParser) -> None:
    """Who may use the router and its /admin/, and how tenants' pool accounts are named and signed."""
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this bearer token on /v1/, /tokenize and /detokenize (repeatable); it is passed on to replicas",
    )
    p.add_argument(
        "--admin-key-file",
        default="",
        metavar="PATH",
        help="file holding the key /admin/ needs (default: $KVSHARE_ADMIN_KEY; API keys are not enough; "
        "with API keys and no admin key, /admin/ is refused)",
    )
    p.add_argument("--admin-key", default="", help="the admin key itself (visible in ps: prefer --admin-key-file)")
    p.add_argument(
        "--tenant-header",
        default="",
        help="the replicas' --tenant-header: cache_aware remembers prefixes per tenant, as the pool does",
    )
    p.add_argument(
        "--account-key-file",
        default="",
        metavar="PATH",
        help="vLLM replicas: file holding the key (default: $KVSHARE_ACCOUNT_KEY) the router signs each "
        "completion's pool account with (the API key, else the tenant header), written into "
        "kv_transfer_params; the replicas' connector takes the same key. Default: none, and vLLM "
        "replicas charge every request to one shared account",
    )


def _add_response_arguments(p: argparse.ArgumentParser) -> None:
    """What the router adds to responses, and how long it waits on a slow client."""
    p.add_argument(
        "--expose-replica-header",
        action="store_true",
        help="add X-KVShare-Replica (the replica that served) to responses: it tells a client where a "
        "prefix lives, so it is off by default",
    )
    p.add_argument(
        "--write-timeout",
        type=float,
        default=30.0,
        help="seconds a client may take to accept one write of a response before it is dropped",
    )


def _add_hint_arguments(p: argparse.ArgumentParser) -> None:
    """Prefetch hints to vLLM replicas (kvshare.router.prefetch_hints)."""
    p.add_argument(
        "--hint-address",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="vLLM replicas: where a replica's connector takes prefetch hints (its hint_address: a Unix socket's "
        "path or HOST:PORT), one per --replica in order ('' for a replica without). The router tells a replica "
        "the prompt it places there as it sends it, so the replica copies the prompt's pool pages towards the "
        "GPU while vLLM reads the request. Signed with the --account-key-file key. Text prompts need --model",
    )


def _add_pool_aware_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of --policy pool_aware (kvshare.router.pool_aware.PoolAwareConfig and CostModel)."""
    g = p.add_argument_group("pool_aware (place by expected TTFT from the pool's KV events)")
    _add_kv_events_arguments(g)
    g.add_argument(
        "--model",
        default=None,
        help="the replicas' model directory or preset: its tokenizer gives pool_aware its token ids, and "
        "--hint-address the ids of text prompts",
    )
    g.add_argument(
        "--replica-kv-events",
        action="append",
        default=[],
        metavar="ENDPOINT",
        help="a replica's own KV events (vLLM's --kv-events-config endpoint), one per --replica in order: "
        "its GPU prefix cache from them instead of what the router sent it",
    )
    _add_cost_model_arguments(g)


def _add_kv_events_arguments(g: argparse._ArgumentGroup) -> None:
    """Where the pool's KV events come from, and when they are too old or too quiet to place by."""
    g.add_argument("--kv-events", default=None, metavar="ENDPOINT", help="the pool's KV events, tcp://HOST:PORT")
    g.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT", help="the pool's replay socket")
    g.add_argument("--kv-events-topic", default="kv@", help="topic (prefix) to subscribe to; one replica's topic")
    g.add_argument("--kv-events-positional", action="store_true", help="events encoded as arrays (vLLM < 0.26)")
    g.add_argument(
        "--kv-events-max-lag",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="batches older than this on arrival: round robin until they are fresh again",
    )
    g.add_argument(
        "--kv-events-max-silence",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="no batch this long after prompts the pool did not hold: round robin until one comes",
    )


def _add_cost_model_arguments(g: argparse._ArgumentGroup) -> None:
    """The cost model's figures until measured, and whether a replica is credited with the pool's pages."""
    cost = CostModel()
    g.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=cost.kv_bytes_per_token,
        help="the model's KV bytes per token (kvshare plan prints it), for the expected time of a pool load",
    )
    g.add_argument(
        "--load-bandwidth",
        type=float,
        default=cost.load_bytes_per_s / 1e9,
        metavar="GB/S",
        help="pool -> replica load bandwidth, until measured (each replica's is then fitted from the "
        "responses the router relays: kvshare_router_pool_aware_load_seconds_per_token)",
    )
    g.add_argument(
        "--prefill-rate",
        type=float,
        default=cost.prefill_tokens_per_s,
        metavar="TOKENS/S",
        help="prompt tokens a replica computes per second, until measured (then fitted per replica: "
        "kvshare_router_pool_aware_prefill_seconds_per_token)",
    )
    g.add_argument(
        "--queue-seconds",
        type=float,
        default=cost.queue_s_per_request,
        help="a request's time on a replica after its first token (its decode), until measured; each request "
        "in flight ahead adds its expected prefill and this to the queue wait (then measured per replica: "
        "kvshare_router_pool_aware_decode_seconds)",
    )
    g.add_argument(
        "--no-pool-term",
        dest="use_pool_term",
        action="store_false",
        help="the GPU-only variant: credit a replica only with what its GPU holds, never the pool's pages "
        "(what a router that cannot see the pool does; a baseline for the pool term)",
    )


def _pool_aware_config(args: argparse.Namespace):
    if args.policy != "pool_aware" and not args.kv_events:
        return None
    if not args.kv_events or not args.model:
        raise ValueError("--policy pool_aware needs --kv-events ENDPOINT (the pool's) and --model (the replicas')")
    return PoolAwareConfig(
        endpoint=args.kv_events,
        model=args.model,
        replay_endpoint=args.kv_events_replay,
        topic=args.kv_events_topic,
        encoding="positional" if args.kv_events_positional else "map",
        cost=CostModel(
            kv_bytes_per_token=args.kv_bytes_per_token,
            load_bytes_per_s=args.load_bandwidth * 1e9,
            prefill_tokens_per_s=args.prefill_rate,
            queue_s_per_request=args.queue_seconds,
            use_pool_term=args.use_pool_term,
        ),
        max_lag_s=args.kv_events_max_lag,
        max_silence_s=args.kv_events_max_silence,
        replica_endpoints=tuple(args.replica_kv_events),
    )


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from kvshare.credentials import read_secret
    from kvshare.errors import UserError
    from kvshare.heap import freeze_startup_heap
    from kvshare.preflight import check_ports_free
    from kvshare.router.config import RouterConfig
    from kvshare.router.server import RouterServer
    from kvshare.serve.tenancy import read_account_key

    try:
        admin_key = read_secret("admin key", args.admin_key_file, "KVSHARE_ADMIN_KEY", args.admin_key)
        account_key = read_account_key(args.account_key_file)
        config = RouterConfig(
            replicas=tuple(args.replica),
            policy=args.policy,
            host=args.host,
            port=args.port,
            health_interval_s=args.health_interval,
            session_header=args.session_header,
            session_ttl_s=args.session_ttl,
            api_keys=tuple(args.api_key),
            write_timeout_s=args.write_timeout,
            instance_id=args.instance_id,
            admin_key=admin_key,
            tenant_header=args.tenant_header,
            expose_replica_header=args.expose_replica_header,
            pool_aware=_pool_aware_config(args),
            account_key=account_key,
            engine=args.engine,
            hint_addresses=tuple(args.hint_address),
            model=args.model or "",
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None
    check_ports_free(config.host, {config.port: "the router"})
    server = RouterServer(config)
    ready = f"kvshare router ready: http://{config.host}:{config.port} policy={config.policy}"
    freeze_startup_heap()  # the collector never walks the startup heap again (kvshare.heap)
    try:
        web.run_app(
            server.app(), host=config.host, port=config.port, print=lambda _: print(ready, flush=True), access_log=None
        )
    except OSError as exc:  # the port was taken after the check
        raise UserError(f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}") from None
    return 0
