"""The routing workload's cluster: one pool publishing KV events, N replicas, and a router per policy.

Every router places over the same replicas, so the conditions of one run differ only in placement::

    pool (--kv-events, per-replica topics) <-- replicas 0..N-1 (--local-cache-size: a share of the working set)
        ^ events                                  ^ requests
    routers: round_robin (the cluster's own), alternate, sticky, cache_aware, pool_aware,
             pool_aware --no-pool-term (GPU-only), pool_aware on an endpoint nobody publishes on (events dropped)

A replica's local cache is what the GPU holds on a GPU replica: sized so the trace's working set is
``gpu_share`` times it, and the pool ``pool_share`` times the working set.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from kvshare.children import ChildSpec, start_child
from kvshare.keys import DEFAULT_CHUNK_TOKENS as CHUNK_TOKENS
from kvshare.launch import Cluster, ClusterConfig, free_port_block, wait_http_ready
from kvshare.pool.spawn import kvshare_command, kvshare_env, stop_process

MiB = 1 << 20


@dataclass(frozen=True)
class RoutingTarget:
    """What to start: the model and its replicas (bench routing --model ... --replicas ...)."""

    model: str
    device: str = "cpu"
    num_replicas: int = 2
    local_cache_bytes: int = 256 * MiB
    pool_bytes: int = 1024 * MiB
    kv_bytes_per_token: int = 0  # the pool_aware routers' --kv-bytes-per-token (0: their default)
    replica_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()  # every router (e.g. pool_aware's --prefill-rate, --load-bandwidth)
    log_level: str = "WARNING"

    def __post_init__(self) -> None:
        if self.num_replicas < 2:
            raise ValueError("placement policies need at least 2 replicas")


def _metric(url: str, name: str) -> float | None:
    """One sample of a router's /metrics (None: not there)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        found = re.search(rf"^{name} (\S+)$", resp.read().decode(), re.M)
    return float(found.group(1)) if found else None


def _mib(num_bytes: int) -> str:
    return f"{max(1, -(-num_bytes // MiB))}MiB"


class RoutingCluster:
    """Started with ``with RoutingCluster(target, routers) as cluster:``; ``url(router)`` is where to send."""

    def __init__(self, target: RoutingTarget, routers: tuple[str, ...]) -> None:
        self.target = target
        self.router_names = tuple(dict.fromkeys(routers))
        self._tmp = tempfile.TemporaryDirectory(prefix="kvshare-routing-")
        self._cluster: Cluster | None = None
        self._routers: dict[str, tuple[str, object]] = {}  # name -> (URL, Child)

    def __enter__(self) -> RoutingCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _events(self, name: str) -> str:
        return f"ipc://{os.path.join(self._tmp.name, name)}"

    def _topic(self, i: int) -> str:
        return f"kv@replica{i}@{os.path.basename(os.path.normpath(self.target.model))}"

    def start(self) -> None:
        t = self.target
        os.chmod(self._tmp.name, 0o700)
        port = free_port_block(1 + t.num_replicas + len(self.router_names))
        pool_args = (
            "--kv-events",
            self._events("events"),
            "--kv-events-replay",
            self._events("replay"),
            *(a for i in range(t.num_replicas) for a in ("--kv-events-topic", self._topic(i))),
        )
        cluster = Cluster(
            ClusterConfig(
                num_replicas=t.num_replicas,
                model=t.model,
                device=t.device,
                pool_size=_mib(t.pool_bytes),
                pool_args=pool_args,
                policy="round_robin",
                port=port,
                log_level=t.log_level,
                replica_args=("--local-cache-size", _mib(t.local_cache_bytes), *t.replica_args),
                router_args=t.router_args,
                ready_timeout_s=600,
            )
        )
        # the other routers start beside the pool and replicas (their ports are known): a router health-checks
        # its replicas until they answer, and a ZMQ subscriber may connect before the pool binds
        for k, name in enumerate(n for n in self.router_names if n != "round_robin"):
            url = f"http://127.0.0.1:{port + 1 + t.num_replicas + k}"
            argv = (
                *kvshare_command(t.log_level),
                "route",
                "--port",
                url.rsplit(":", 1)[1],
                *(a for u in cluster.replica_urls for a in ("--replica", u)),
                *self._router_args(name),
                *t.router_args,
            )
            child = start_child(ChildSpec(f"router-{name}", argv, kvshare_env(), url=url, takes_instance_id=True))
            self._routers[name] = (url, child)
        self._cluster = cluster
        cluster.start()
        for url, child in self._routers.values():
            wait_http_ready(url, child.proc, 300, f"the {child.spec.name} router", child.instance_id)
        self._wait_events_live()

    def _wait_events_live(self, timeout_s: float = 120.0) -> None:
        """Have the pool publish (one prompt stored through replica 0) and wait until every pool_aware router
        that subscribes to it has taken its events: a router that joined before the pool's first batch falls
        back until one arrives, which would count against whichever condition happened to run first."""
        live = [name for name in self._routers if name in ("pool_aware", "pool_aware_gpu")]
        if not live:
            return
        replica = self._cluster.replica_urls[0]
        with urllib.request.urlopen(replica + "/v1/models", timeout=30) as resp:
            model = json.load(resp)["data"][0]["id"]
        prompt = [10 + (i * 7919) % 200 for i in range(2 * CHUNK_TOKENS + 1)]  # ids every vocabulary has
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1}).encode()
        request = urllib.request.Request(replica + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()
        deadline = time.monotonic() + timeout_s
        for name in live:
            while _metric(self.url(name), "kvshare_router_kv_events_live") != 1.0:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {name} router took no KV event from the pool within {timeout_s:.0f} s")
                time.sleep(0.2)

    def _router_args(self, name: str) -> tuple[str, ...]:
        if not name.startswith("pool_aware"):
            return ("--policy", name)
        cost = ("--kv-bytes-per-token", str(self.target.kv_bytes_per_token)) if self.target.kv_bytes_per_token else ()
        if name == "pool_aware_dropped":  # subscribed where nothing is ever published: the events are lost
            return (
                "--policy",
                "pool_aware",
                "--kv-events",
                self._events("nobody"),
                "--model",
                self.target.model,
                *cost,
            )
        return (
            "--policy",
            "pool_aware",
            "--kv-events",
            self._events("events"),
            "--kv-events-replay",
            self._events("replay"),
            "--kv-events-topic",
            self._topic(0),
            "--model",
            self.target.model,
            *cost,
            *(("--no-pool-term",) if name == "pool_aware_gpu" else ()),
        )

    def url(self, router: str) -> str:
        if router == "round_robin":
            return self._cluster.router_url
        return self._routers[router][0]

    @property
    def replica_urls(self) -> list[str]:
        return self._cluster.replica_urls

    def replica_url(self, name: str | None) -> str | None:
        """The URL of the replica a response names (replicaN); None for a name this cluster did not start."""
        for i, url in enumerate(self.replica_urls):
            if name == f"replica{i}":
                return url
        return None

    def stop(self) -> None:
        for _, child in self._routers.values():
            stop_process(child.proc, timeout_s=10)
        self._routers.clear()
        if self._cluster is not None:
            self._cluster.stop()
            self._cluster = None
        self._tmp.cleanup()
