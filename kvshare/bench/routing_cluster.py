"""The routing workload's cluster: one pool publishing KV events, N replicas, and a router per policy.

Every router places over the same replicas, so the conditions of one run differ only in placement::

    pool (--kv-events, per-replica topics) <-- replicas 0..N-1 (--local-cache-size: a share of the working set)
        ^ events                                  ^ requests
    routers: round_robin (the cluster's own), alternate, sticky, cache_aware, pool_aware,
             pool_aware --no-pool-term (GPU-only), pool_aware on an endpoint nobody publishes on (events dropped)

A replica's local cache is what the GPU holds on a GPU replica: sized so the trace's working set is
``gpu_share`` times it, and the pool ``pool_share`` times the working set.

With ``engine="vllm"`` the replicas are vLLM with kvshare's connector, started as ``kvshare up --engine vllm``
starts them (kvshare.launch): that size is vLLM's KV cache (``--kv-cache-memory-bytes``, in the model's own
dtype, so the bytes per token are the ones the size was computed with), each replica publishes its own KV
events (vLLM's ``--kv-events-config``) and the pool_aware routers read them as the replicas' GPU prefix caches
(``--replica-kv-events``); the events-dropped router reads none, the pool's nor the replicas'. Every router
names the replica that served (``--expose-replica-header``): vLLM's streamed responses carry no provenance.
A router named ``<policy>+hints`` places as ``<policy>`` and tells each vLLM replica the prompt it sends there
(``--hint-address``: the replicas' hint sockets, which kvshare up wires); every other router sends none, the
round_robin one included (it then runs beside kvshare up's own, which would).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import urllib.request
from dataclasses import dataclass

from kvshare.bench import scrape
from kvshare.bench.routing_trace import HINTED
from kvshare.children import ChildSpec, start_child
from kvshare.credentials import write_new_secret
from kvshare.integrations.vllm.launch import has_flag
from kvshare.keys import DEFAULT_CHUNK_TOKENS as CHUNK_TOKENS
from kvshare.launch import Cluster, ClusterConfig, free_port_block, wait_http_ready
from kvshare.pool.spawn import kvshare_command, kvshare_env, stop_process

MiB = 1 << 20
POOL_COUNTERS = ("committed_pages", "evictions", "skipped_stores", "aborted_pages")  # the pool's, per replay
EVENTS_LIVE = "kvshare_router_kv_events_live"  # a pool_aware router trusts the pool's events
REPLICA_EVENTS_LIVE = "kvshare_router_replica_kv_events_live"  # ... and replica i's own (one sample each)
# what the vLLM replicas' KV size and its check depend on: set by the bench, refused in --replica-arg
VLLM_SIZED_FLAGS = ("--kv-cache-memory-bytes", "--dtype", "--kv-cache-dtype", "--max-model-len")


@dataclass(frozen=True)
class RoutingTarget:
    """What to start: the model and its replicas (bench routing --model ... --replicas ...)."""

    model: str
    device: str = "cpu"
    num_replicas: int = 2
    engine: str = "builtin"  # or "vllm" (kvshare up --engine vllm)
    vllm_python: str | None = None  # the vLLM environment's interpreter (None: kvshare.placement finds one)
    max_model_len: int | None = None  # vLLM: --max-model-len, the trace's longest request (None: vLLM's own)
    local_cache_bytes: int = 256 * MiB
    pool_bytes: int = 1024 * MiB
    kv_bytes_per_token: int = 0  # the pool_aware routers' --kv-bytes-per-token (0: their default)
    replica_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()  # every router (e.g. pool_aware's --prefill-rate, --load-bandwidth)
    log_level: str = "WARNING"

    def __post_init__(self) -> None:
        if self.num_replicas < 2:
            raise ValueError("placement policies need at least 2 replicas")
        if self.engine not in ("builtin", "vllm"):
            raise ValueError(f"unknown engine {self.engine!r}; choose builtin or vllm")
        if self.engine == "vllm":
            for flag in VLLM_SIZED_FLAGS:
                if has_flag(self.replica_args, flag):
                    raise ValueError(
                        f"--replica-arg {flag}: bench routing sizes vLLM's KV itself (its bytes from --gpu-share, "
                        "in the model's dtype; its longest sequence from the trace); change --gpu-share or the trace"
                    )
            # vLLM refuses to start with less KV than one sequence of --max-model-len
            num_kv_tokens = self.local_cache_bytes // max(1, self.kv_bytes_per_token)
            if self.max_model_len is not None and num_kv_tokens < self.max_model_len:
                raise ValueError(
                    f"a vLLM replica's KV cache ({num_kv_tokens} tokens: the working set over --gpu-share) cannot "
                    f"hold the trace's longest request ({self.max_model_len} tokens with the chat template's): "
                    "lower --gpu-share, or give the trace more sessions or shorter turns"
                )

    @property
    def is_vllm(self) -> bool:
        return self.engine == "vllm"


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
        self._replica_events_port: int | None = None  # vLLM replica i publishes its KV events on this + i
        self._account_key_file = os.path.join(self._tmp.name, "account.key")
        self._served_model = target.model  # the replicas' model id (/v1/models), read once they answer
        self.has_hints = any(name.endswith(HINTED) for name in self.router_names)
        if self.has_hints and not target.is_vllm:
            raise ValueError("POLICY/hints: prefetch hints are for vLLM replicas (--engine vllm)")

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

    def cluster_config(self, port: int, replica_events_port: int) -> ClusterConfig:
        """What ``kvshare up`` starts for this target: the pool publishing on every replica's topic, the replicas
        (their local cache, or vLLM's KV, sized by the target), the round_robin router on ``port``. vLLM replica i
        publishes its own KV events on ``replica_events_port`` + i."""
        t = self.target
        pool_args = (
            "--kv-events",
            self._events("events"),
            "--kv-events-replay",
            self._events("replay"),
            *(a for i in range(t.num_replicas) for a in ("--kv-events-topic", self._topic(i))),
        )
        if t.is_vllm:
            from kvshare.engine.presets import model_config_of

            sized = (f"--dtype={model_config_of(t.model).dtype}", f"--kv-cache-memory-bytes={t.local_cache_bytes}")
            sized += (f"--max-model-len={t.max_model_len}",) if t.max_model_len is not None else ()
        else:
            sized = ("--local-cache-size", _mib(t.local_cache_bytes))
        return ClusterConfig(
            num_replicas=t.num_replicas,
            model=t.model,
            engine=t.engine,
            device=t.device,
            pool_size=_mib(t.pool_bytes),
            pool_args=pool_args,
            policy="round_robin",
            port=port,
            log_level=t.log_level,
            replica_args=(*sized, *t.replica_args),
            router_args=(*self._engine_router_args(), *t.router_args),
            vllm_python=t.vllm_python,
            account_key_file=self._account_key_file if t.is_vllm else "",
            replica_kv_events_port=replica_events_port if t.is_vllm else None,
            hints=self.has_hints,  # the replicas take hints (and up's own router sends them: not used then)
            ready_timeout_s=600,
        )

    def start(self) -> None:
        t = self.target
        os.chmod(self._tmp.name, 0o700)
        port = free_port_block(1 + t.num_replicas + len(self.router_names))
        self._replica_events_port = free_port_block(t.num_replicas) if t.is_vllm else None
        if t.is_vllm:  # the key every router signs pool accounts with and the connectors check (kvshare up's)
            write_new_secret(self._account_key_file)
        cluster = Cluster(self.cluster_config(port, self._replica_events_port or 0))
        # the other routers start beside the pool and replicas (their ports are known): a router health-checks
        # its replicas until they answer, and a ZMQ subscriber may connect before the pool binds
        for k, name in enumerate(n for n in self.router_names if n != "round_robin" or self.has_hints):
            url = f"http://127.0.0.1:{port + 1 + t.num_replicas + k}"
            argv = (
                *kvshare_command(t.log_level),
                "route",
                "--port",
                url.rsplit(":", 1)[1],
                *(a for u in cluster.replica_urls for a in ("--replica", u)),
                *self.router_args(name),
                *(self._hint_args(cluster) if name.endswith(HINTED) else ()),
                *t.router_args,
            )
            child = start_child(ChildSpec(f"router-{name}", argv, kvshare_env(), url=url, takes_instance_id=True))
            self._routers[name] = (url, child)
        self._cluster = cluster
        cluster.start()
        for url, child in self._routers.values():
            wait_http_ready(url, child.proc, 300, f"the {child.spec.name} router", child.instance_id)
        self._warm_up()
        self._wait_events_live()

    def _send(self, replica: str, path: str, body: dict, timeout_s: float) -> None:
        data = json.dumps({"model": self._served_model, **body}).encode()
        request = urllib.request.Request(replica + path, data, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            resp.read()

    def _warm_up(self, timeout_s: float = 300.0) -> None:
        """Store a prompt through replica 0 (the pool then publishes) and, on vLLM replicas, pay each replica's
        first-request costs before the first replay: vLLM CPU skips its own warm-up when its KV size is given
        (eager mode), and a fresh replica's first request took 11-18 s on 2 cores where later ones took 0.1-0.2 s,
        which would count against whichever condition happened to run first. Built-in replicas warm up before
        they report healthy. vLLM replicas publish their own KV events from here on (each cached a block)."""
        with urllib.request.urlopen(self.replica_urls[0] + "/v1/models", timeout=30) as resp:
            self._served_model = json.load(resp)["data"][0]["id"]
        prompt = [10 + (i * 7919) % 200 for i in range(2 * CHUNK_TOKENS + 1)]  # ids every vocabulary has
        self._send(self.replica_urls[0], "/v1/completions", {"prompt": prompt, "max_tokens": 1}, timeout_s)
        if not self.target.is_vllm:
            return
        chat = {"messages": [{"role": "user", "content": "warm up " * 40}], "logprobs": True, "top_logprobs": 2}
        for replica in self.replica_urls:  # one by one: on CPU the first request's costs take every core
            self._send(replica, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "logprobs": 2}, timeout_s)
            self._send(replica, "/v1/chat/completions", {**chat, "max_tokens": 8, "stream": True}, timeout_s)

    def _wait_events_live(self, timeout_s: float = 120.0) -> None:
        """Wait until every pool_aware router that subscribes to the pool has taken its events (and, with vLLM
        replicas, each replica's own; ``_warm_up`` had them publish): a router that joined before the first batch
        falls back until one arrives, which would count against whichever condition happened to run first."""
        live = [name for name in self._routers if name.removesuffix(HINTED) in ("pool_aware", "pool_aware_gpu")]
        deadline = time.monotonic() + timeout_s
        wanted = [(EVENTS_LIVE, "the pool", 1)]
        if self.target.is_vllm:
            wanted.append((REPLICA_EVENTS_LIVE, "every replica", self.target.num_replicas))
        for name in live:
            for metric, whose, count in wanted:
                while scrape.metric(self.url(name), metric) != count:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the {name} router took no KV event from {whose} within {timeout_s:.0f} s")
                    time.sleep(0.2)

    def _engine_router_args(self) -> tuple[str, ...]:
        """What every router in front of vLLM replicas takes, as kvshare up gives its own: the engine (it signs
        each request's pool account with the key the connectors check) and the served replica's name."""
        if not self.target.is_vllm:
            return ()
        return ("--engine", "vllm", "--account-key-file", self._account_key_file, "--expose-replica-header")

    def _hint_args(self, cluster: Cluster) -> tuple[str, ...]:
        """A hinting router's: each replica's hint socket (kvshare up's) and the model whose tokenizer encodes
        text prompts (the same --model for pool_aware, which reads it too)."""
        addresses = [cluster.hint_address(i) for i in range(self.target.num_replicas)]
        return (*(a for address in addresses for a in ("--hint-address", address)), "--model", self.target.model)

    def router_args(self, name: str) -> tuple[str, ...]:
        """A router's arguments after its replicas (the target's --router-arg follow): its policy and, for
        pool_aware, the events it reads."""
        name = name.removesuffix(HINTED)
        engine = self._engine_router_args()
        if not name.startswith("pool_aware"):
            return ("--policy", name, *engine)
        t = self.target
        cost = ("--kv-bytes-per-token", str(t.kv_bytes_per_token)) if t.kv_bytes_per_token else ()
        if name == "pool_aware_dropped":  # subscribed where nothing is ever published: the events are lost
            return ("--policy", "pool_aware", "--kv-events", self._events("nobody"), "--model", t.model, *cost, *engine)
        replica_events = (
            (a for i in range(t.num_replicas) for a in ("--replica-kv-events", self.replica_events(i)))
            if self._replica_events_port is not None
            else ()
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
            t.model,
            *cost,
            *(("--no-pool-term",) if name == "pool_aware_gpu" else ()),
            *replica_events,
            *engine,
        )

    def replica_events(self, i: int) -> str:
        """Where vLLM replica i publishes its own KV events (kvshare up's --replica-kv-events-port + i)."""
        return f"tcp://127.0.0.1:{self._replica_events_port + i}"

    def url(self, router: str) -> str:
        if router == "round_robin" and not self.has_hints:
            return self._cluster.router_url
        return self._routers[router][0]

    @property
    def replica_urls(self) -> list[str]:
        return self._cluster.replica_urls

    def pool_counters(self) -> dict[str, int]:
        """The pool's counters now: pages committed, evicted, not granted for lack of room, aborted, and the KV
        event batches and events it published (a replay's row takes their change: what the pool did meanwhile)."""
        from kvshare.pool.client import PoolClient

        if self._cluster.pool_socket is None:
            return {}
        with PoolClient(self._cluster.pool_socket, name="bench-routing") as client:
            stats = client.stats()
        counters = {k: int(stats.get(k, 0)) for k in POOL_COUNTERS}
        counters |= {f"kv_events_{k}": int(v) for k, v in stats.get("kv_events", {}).items() if k != "replays"}
        return counters

    def replica_url(self, name: str | None) -> str | None:
        """The URL of the replica a response names (replicaN, or its URL as a router's X-KVShare-Replica says);
        None for one this cluster did not start."""
        for i, url in enumerate(self.replica_urls):
            if name in (f"replica{i}", url):
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
