"""Start a whole cluster: the pool, N replicas and the router, and keep it up; Ctrl-C or SIGTERM stops all of them.

``--pool SOCKET`` uses a running pool instead of starting one (and leaves it running); ``--pool off`` runs none.

A child that dies is started again with backoff (docs/operations.md); ``up`` exits 1 when one
crash-loops (more than --max-restarts exits within --restart-window seconds), naming it, how it
exited and its last lines, and 2 when the cluster cannot start (a flag, a port in use, a model or a
pool size that cannot work, a child that exits before it is ready).
"""

from __future__ import annotations

import argparse
import os

from kvshare.commands import non_negative_int, tcp_port
from kvshare.commands.serve import add_kv_dtype_argument
from kvshare.router.policy import POLICIES
from kvshare.supervisor import RestartPolicy


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_replica_arguments(p)
    _add_pool_arguments(p)
    _add_policy_arguments(p)
    _add_address_arguments(p)
    _add_engine_arguments(p)
    _add_passthrough_arguments(p)
    _add_access_arguments(p)
    _add_restart_arguments(p)
    _add_kv_events_arguments(p)


def _add_replica_arguments(p: argparse.ArgumentParser) -> None:
    """What the replicas run: how many, which model and engine, on which devices."""
    p.add_argument("--replicas", type=int, default=2, help="replicas to start")
    p.add_argument("--model", default="tiny", help="a model directory or preset (default tiny)")
    p.add_argument(
        "--engine",
        choices=("builtin", "vllm"),
        default="builtin",
        help="what the replicas run: kvshare's engine or vLLM",
    )
    p.add_argument(
        "--model-revision",
        default="",
        metavar="REVISION",
        help="name the model's identity yourself (e.g. a hub commit) instead of hashing its weights' "
        "bytes; replicas with one revision share KV, so it must name exactly these weights "
        "(default: hash them)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda, cuda:N, or one per replica as a comma list, cycled (cuda:0,cuda:1: a GPU each)",
    )


def _add_pool_arguments(p: argparse.ArgumentParser) -> None:
    """The pool: one up starts, a running one, or none."""
    p.add_argument("--pool-size", default="4GiB", help="size of the pool this command starts")
    p.add_argument(
        "--pool",
        default=None,
        metavar="SOCKET|off",
        help="the socket of a running pool to use instead of starting one (it is left running), or off",
    )


def _add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """How the router places requests on replicas."""
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="the router's placement policy (README; default: cache_aware with --engine vllm, which measured best "
        "with vLLM replicas on the routing workload; round_robin with the built-in engine)",
    )
    p.add_argument(
        "--no-hints",
        dest="hints",
        action="store_false",
        help="--engine vllm: the router sends no prefetch hints (the replicas load when vLLM schedules a request)",
    )


def _add_address_arguments(p: argparse.ArgumentParser) -> None:
    """Where the router and the replicas listen, and the pool's name."""
    p.add_argument("--host", default="127.0.0.1", help="address the router and replicas listen on")
    p.add_argument("--port", type=tcp_port, default=8080, help="router port; replicas take the next N ports")
    p.add_argument("--name", default="", help="the pool's name for pool-stats / pool-admin --name (default: the port)")


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """How each replica's engine runs."""
    p.add_argument("--vllm-python", default=None, help="python of the virtual environment that holds vLLM")
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="--engine vllm: tensor parallel ranks per replica (pages hold every KV head, so replicas "
        "of any size share them; on CPU each rank gets its share of the cores)",
    )
    p.add_argument("--replica-arg", action="append", default=[], help="extra argument for every replica (repeatable)")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="replicas in the built-in engine's deterministic mode (serve --deterministic): reuse gives "
        "the same bits as recomputing",
    )
    add_kv_dtype_argument(p)
    p.add_argument(
        "--state-checkpoint-chunks",
        type=non_negative_int,
        default=None,
        metavar="M",
        help="built-in replicas of a hybrid model: keep its state every M chunks of a prompt (serve "
        "--state-checkpoint-chunks; default 64)",
    )


def _add_passthrough_arguments(p: argparse.ArgumentParser) -> None:
    """Extra arguments passed on to the pool and the router."""
    p.add_argument("--pool-arg", action="append", default=[], help="extra argument for the pool (repeatable)")
    p.add_argument("--router-arg", action="append", default=[], help="extra argument for the router (repeatable)")


def _add_access_arguments(p: argparse.ArgumentParser) -> None:
    """Who may use the cluster and what it tells them: keys, tenants, provenance."""
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="require this bearer token at the router and every built-in replica (repeatable; vLLM "
        "replicas listen on loopback behind the router, which salts each key's requests)",
    )
    p.add_argument(
        "--tenant-header", default="", help="header whose value salts the pool namespace per tenant (e.g. X-Tenant-ID)"
    )
    p.add_argument(
        "--account-key-file",
        default="",
        metavar="PATH",
        help="--engine vllm: file holding the key the router signs each request's pool account with and "
        "the replicas' connector checks (default: $KVSHARE_ACCOUNT_KEY, else a random key up writes "
        "into its private runtime directory)",
    )
    p.add_argument(
        "--admin-key-file",
        default="",
        metavar="PATH",
        help="file holding the key the router's /admin/ needs (default: $KVSHARE_ADMIN_KEY)",
    )
    p.add_argument(
        "--provenance",
        choices=("off", "own-tenant", "all"),
        default="all",
        help="built-in replicas' --provenance (default all: up is one user's cluster; a shared one "
        "should say own-tenant, with --api-key or --tenant-header)",
    )
    p.add_argument(
        "--expose-replica-header",
        action="store_true",
        help="the router adds X-KVShare-Replica to responses (it tells a client where a prefix lives)",
    )


def _add_restart_arguments(p: argparse.ArgumentParser) -> None:
    """When a child that keeps exiting stops up."""
    p.add_argument(
        "--max-restarts",
        type=int,
        default=RestartPolicy.max_restarts,
        help="restarts of one child allowed within --restart-window; one more exit stops up (default 5)",
    )
    p.add_argument(
        "--restart-window",
        type=float,
        default=RestartPolicy.window_s,
        metavar="SECONDS",
        help="the window of --max-restarts (default 60)",
    )


def _add_kv_events_arguments(p: argparse.ArgumentParser) -> None:
    """The pool's and the replicas' KV events, which --policy pool_aware reads."""
    p.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="the pool publishes KV events here (tcp://*:PORT or ipc://PATH), on every replica's topic "
        "kv@replicaN@MODEL; --policy pool_aware reads them",
    )
    p.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT", help="the pool's replay socket")
    p.add_argument(
        "--kv-events-pool-topic",
        action="store_true",
        help="one pool topic (kv@kvshare-pool@kvshare) instead of one per replica",
    )
    p.add_argument(
        "--replica-kv-events-port",
        type=int,
        default=None,
        metavar="PORT",
        help="replica i publishes its own (GPU) prefix cache's KV events on tcp://*:PORT+i (vLLM: "
        "--kv-events-config; built-in: serve --kv-events); --policy pool_aware reads them for the "
        "replicas' GPU prefix caches",
    )


def kv_events_args(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The pool's and the router's arguments for --kv-events (both empty without it)."""
    if not args.kv_events:
        if args.policy == "pool_aware":
            raise ValueError("--policy pool_aware reads the pool's KV events: add --kv-events tcp://*:PORT")
        return (), ()
    endpoints = [e for e in (args.kv_events, args.kv_events_replay) if e]
    if any(e.startswith("tcp://") and "*" not in e for e in endpoints) or args.pool == "off":
        raise ValueError("up's pool binds its KV events: give tcp://*:PORT or ipc://PATH, and a pool")
    model = os.path.basename(os.path.normpath(args.model))
    topics = () if args.kv_events_pool_topic else tuple(f"kv@replica{i}@{model}" for i in range(args.replicas))
    pool = (
        "--kv-events",
        args.kv_events,
        *(("--kv-events-replay", args.kv_events_replay) if args.kv_events_replay else ()),
        *(a for t in topics for a in ("--kv-events-topic", t)),
    )
    local = [e.replace("*", "127.0.0.1") for e in endpoints]  # the router connects where the pool binds
    router = (
        "--kv-events",
        local[0],
        "--kv-events-topic",
        topics[0] if topics else "kv@",
        "--model",
        args.model,
        *(("--kv-events-replay", local[1]) if len(local) > 1 else ()),
        *(
            a
            for i in range(args.replicas)
            if args.replica_kv_events_port is not None
            for a in ("--replica-kv-events", f"tcp://127.0.0.1:{args.replica_kv_events_port + i}")
        ),
    )
    return pool, router if args.policy == "pool_aware" else ()


def cluster_config(args: argparse.Namespace):
    """The ClusterConfig of up's flags (a UserError names a flag that cannot work)."""
    from kvshare.errors import UserError
    from kvshare.launch import ClusterConfig

    running_pool = args.pool if args.pool not in (None, "off") else None
    if running_pool is not None and args.kv_events:
        raise UserError("--kv-events: up binds the events of a pool it starts; a running pool publishes its own")
    if args.deterministic and args.engine != "builtin":
        raise UserError("--deterministic is a mode of the built-in engine; vLLM replicas do not have it")
    if args.kv_dtype != "auto" and args.engine != "builtin":
        raise UserError(
            "--kv-dtype sets the built-in engine's KV dtype; for vLLM replicas pass --replica-arg=--kv-cache-dtype=fp8"
        )
    replica_args = tuple(args.replica_arg) + (("--deterministic",) if args.deterministic else ())
    replica_args += ("--kv-dtype", args.kv_dtype) if args.kv_dtype != "auto" else ()
    if args.state_checkpoint_chunks is not None:
        if args.engine != "builtin":
            raise UserError("--state-checkpoint-chunks is the built-in engine's; vLLM replicas do not take it")
        replica_args += ("--state-checkpoint-chunks", str(args.state_checkpoint_chunks))
    router_args = tuple(args.router_arg) + (("--admin-key-file", args.admin_key_file) if args.admin_key_file else ())
    router_args += ("--expose-replica-header",) if args.expose_replica_header else ()
    try:
        pool_events, router_events = kv_events_args(args)
        return ClusterConfig(
            num_replicas=args.replicas,
            model=args.model,
            engine=args.engine,
            device=args.device,
            pool_size=None if args.pool is not None else args.pool_size,
            pool_socket=running_pool,
            policy=args.policy or ("cache_aware" if args.engine == "vllm" else "round_robin"),
            hints=args.hints,
            host=args.host,
            port=args.port,
            name=args.name,
            vllm_python=args.vllm_python,
            tensor_parallel_size=args.tensor_parallel_size,
            replica_args=replica_args,
            pool_args=tuple(args.pool_arg) + pool_events,
            router_args=router_args + router_events,
            api_keys=tuple(args.api_key),
            tenant_header=args.tenant_header,
            provenance=args.provenance,
            account_key_file=args.account_key_file,
            model_revision=args.model_revision,
            replica_kv_events_port=args.replica_kv_events_port,
        )
    except ValueError as exc:
        raise UserError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    import sys

    from rich.console import Console

    from kvshare.errors import UserError
    from kvshare.launch import Cluster
    from kvshare.supervisor import CrashLoop, StopSignals, Supervisor

    config = cluster_config(args)
    try:
        policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    console = Console()
    signals = StopSignals()
    signals.install()
    cluster = Cluster(config)
    supervisor = Supervisor(
        cluster,
        policy,
        ready_timeout_s=config.ready_timeout_s,
        say=lambda msg: console.print(msg, markup=False, highlight=False),
    )
    try:
        with console.status("starting the cluster...") as status:
            cluster.start(progress=lambda msg: status.update(msg))
        # started: a signal from here on is a stop (a client may see the router healthy before the line below)
        signals.is_supervising = True
        _print_cluster(console, cluster)
        while not signals.stop.wait(0.5):
            supervisor.poll()
    except CrashLoop as exc:
        print(f"kvshare up: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except (RuntimeError, TimeoutError) as exc:
        raise UserError(str(exc)) from None
    finally:
        if signals.stop.is_set():
            console.print(f"kvshare up: stopping the router, {_replicas(config)} and {_pool(config)}...")
        cluster.stop()
        if signals.stop.is_set():
            console.print("kvshare up: stopped")
    return 0


def _print_cluster(console, cluster) -> None:
    config = cluster.config
    console.print(f"[bold]kvshare up[/bold]: router {cluster.router_url} (policy {config.policy})")
    for i, url in enumerate(cluster.replica_urls):
        console.print(f"  replica{i}: {url}")
    if cluster.engine_settings:
        console.print(f"  vLLM: {cluster.engine_settings}", markup=False, highlight=False)
    if config.pool_socket is not None:
        console.print(f"  pool: {cluster.pool_socket} (running before up: pool-stats / pool-admin --socket)")
    elif cluster.pool_socket:
        console.print(f"  pool: {cluster.pool_socket} (pool-stats / pool-admin --name {config.pool_name})")
    else:
        console.print("  pool: off")
    console.print("Ctrl-C stops everything.")


def _replicas(config) -> str:
    return f"{config.num_replicas} replica" + ("s" if config.num_replicas != 1 else "")


def _pool(config) -> str:
    if config.pool_socket is not None:
        return f"not the pool at {config.pool_socket} (it was running before: it keeps running)"
    return "the pool" if config.pool_size is not None else "no pool"
