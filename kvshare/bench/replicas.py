"""The replicas an experiment talks to: fixed URLs, or replicas this process starts one after the other.

- ``FixedReplicas``: servers that are already up (a kvshare cluster, vLLM servers, or a
  ``kvshare.launch.Cluster`` the harness started); replica i is ``urls[i]``.
- ``SequentialReplicas``: one pool and replicas started one at a time against it. Asking
  for replica B stops replica A first. This is how two replicas of a model that fits the
  GPU only once are compared: prime on A, stop it, start B, measure; B never saw the
  prompt, exactly as a request that moves to another replica.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

from kvshare.launch import gpu_of_replica, replica_env, serve_command


class FixedReplicas:
    def __init__(self, urls: list[str], warm: bool = True, use_extension: bool = True) -> None:
        if not urls:
            raise ValueError("give at least one replica URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.warm = warm  # warm each replica up before its first use (kvshare.bench.warmup)
        self.use_extension = use_extension
        self._warmed: set[int] = set()

    @property
    def num_replicas(self) -> int:
        return len(self.urls)

    def activate(self, index: int) -> str:
        """The URL of replica ``index`` (it is already up)."""
        if not 0 <= index < len(self.urls):
            raise ValueError(f"replica {index} asked for, but only {len(self.urls)} replica URLs were given")
        if self.warm and index not in self._warmed:
            from kvshare.bench.warmup import warm_up

            warm_up(self.urls[index], self.use_extension)
            self._warmed.add(index)
        return self.urls[index]

    def describe(self) -> dict:
        return {"mode": "fixed", "replicas": self.urls}

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SequentialConfig:
    model: str
    device: str = "cpu"
    num_replicas: int = 2
    pool_size: str = "4GiB"
    pool_args: tuple[str, ...] = ()
    replica_args: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8180  # replica i listens on port + i
    ready_timeout_s: float = 600.0
    log_dir: str | None = None  # replica and pool output goes to files here (default: discarded)
    warm: bool = True  # warm each started replica up before it is measured (kvshare.bench.warmup)

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be at least 1")


@dataclass
class SequentialReplicas:
    config: SequentialConfig
    active: int | None = None
    start_seconds: list[float] = field(default_factory=list)  # how long each replica start took
    _pool: subprocess.Popen | None = None
    _replica: subprocess.Popen | None = None
    _tmp: tempfile.TemporaryDirectory | None = None

    @property
    def num_replicas(self) -> int:
        return self.config.num_replicas

    def start(self) -> SequentialReplicas:
        from kvshare.pool.spawn import start_pool

        self._tmp = tempfile.TemporaryDirectory(prefix="kvshare-bench-")
        os.chmod(self._tmp.name, 0o700)
        self.socket_path = os.path.join(self._tmp.name, "pool.sock")
        log = self._log("pool")
        try:
            self._pool = start_pool(
                self.socket_path,
                self.config.pool_size,
                self.config.pool_args,
                "WARNING",
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        finally:
            _close(log)
        return self

    def _log(self, name: str):
        if self.config.log_dir is None:
            return subprocess.DEVNULL
        os.makedirs(self.config.log_dir, exist_ok=True)
        return open(os.path.join(self.config.log_dir, f"{name}.log"), "ab")

    @property
    def served_name(self) -> str:
        """The model name the replicas will serve (`kvshare serve`'s default: --model as given), known without
        starting one."""
        return self.config.model

    def url_of(self, index: int) -> str:
        return f"http://{self.config.host}:{self.config.port + index}"

    def activate(self, index: int) -> str:
        """Replica ``index`` running (stopping whichever other one runs); its URL."""
        if not 0 <= index < self.config.num_replicas:
            raise ValueError(f"replica {index} asked for, but there are {self.config.num_replicas}")
        if self._pool is None:
            raise RuntimeError("start() the pool before activating replicas")
        if self.active == index:
            return self.url_of(index)
        self._stop_replica()
        cfg = self.config
        started = time.perf_counter()
        from kvshare.pool.spawn import kvshare_command, kvshare_env

        # kvshare up's replica command (kvshare.launch.serve_command) with what a replica measured alone needs:
        # every prompt's provenance, which the benchmark reads; no CPU share, tenants or shared token cache,
        # since one replica runs at a time
        device, visible = gpu_of_replica(cfg.device, index)
        kv = kvshare_command("WARNING")
        cmd = [
            *serve_command(kv, cfg.model, device, cfg.host, cfg.port + index, f"replica{index}", self.socket_path),
            "--provenance",
            "all",
            *cfg.replica_args,
        ]
        env = replica_env(kvshare_env(), visible)
        log = self._log(f"replica{index}")
        try:
            self._replica = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        finally:
            _close(log)  # the child holds its own copy of the descriptor
        self._wait_ready(self.url_of(index))
        if cfg.warm:
            from kvshare.bench.warmup import warm_up

            warm_up(self.url_of(index))
        self.active = index
        self.start_seconds.append(time.perf_counter() - started)  # start-up and warm-up
        return self.url_of(index)

    def _wait_ready(self, url: str) -> None:
        from kvshare.launch import wait_http_ready

        wait_http_ready(
            url, self._replica, self.config.ready_timeout_s, f"the replica (log: {self.config.log_dir or 'its output'})"
        )

    def _stop_replica(self) -> None:
        from kvshare.pool.spawn import stop_process

        if self._replica is not None:
            stop_process(self._replica, timeout_s=60)
            self._replica = None
        self.active = None

    def describe(self) -> dict:
        return {
            "mode": "sequential",
            "model": self.config.model,
            "device": self.config.device,
            "replicas": [self.url_of(i) for i in range(self.num_replicas)],
            "pool_size": self.config.pool_size,
            "replica_args": list(self.config.replica_args),
            "replica_start_s": [round(s, 2) for s in self.start_seconds],
        }

    def close(self) -> None:
        from kvshare.pool.spawn import stop_process

        self._stop_replica()
        if self._pool is not None:
            stop_process(self._pool, timeout_s=30)
            self._pool = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def _close(log) -> None:
    if log is not subprocess.DEVNULL:
        log.close()
