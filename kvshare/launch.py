"""``kvshare up``: the pool, N replicas and the router as child processes, started and stopped together.

Children run in their own process group (a Ctrl-C reaches only ``up``, which then
stops them in order: router, replicas, pool) and get SIGTERM from the kernel if
``up`` itself dies (PR_SET_PDEATHSIG), so nothing is orphaned. The pool's arena is
a memfd and its socket lives in a private temporary directory that is removed on
exit: no shared-memory segment or socket is left behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from kvshare.pool.spawn import stop_process, wait_for_pool

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


@dataclass(frozen=True)
class ClusterConfig:
    num_replicas: int = 2
    model: str = "tiny"
    engine: str = "builtin"  # or "vllm"
    device: str = "cpu"
    pool_size: str | None = "4GiB"  # None: run without a pool
    pool_args: tuple[str, ...] = ()
    policy: str = "round_robin"
    host: str = "127.0.0.1"
    port: int = 8080  # the router; replicas take port+1 .. port+N
    replica_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()  # required by the router and every replica (Authorization: Bearer KEY)
    tenant_header: str = ""  # replicas salt the pool namespace with this header's value
    vllm_python: str | None = None
    ready_timeout_s: float = 300.0
    log_level: str = "WARNING"

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if self.engine not in ("builtin", "vllm"):
            raise ValueError(f"unknown engine {self.engine!r}; choose builtin or vllm")
        if self.engine == "vllm" and (self.api_keys or self.tenant_header):
            raise ValueError("--api-key and --tenant-header apply to built-in replicas; for vLLM pass its own "
                             "--api-key with --replica-arg (tenants: the request's cache_salt)")

    def replica_url(self, i: int) -> str:
        return f"http://{self.host}:{self.port + 1 + i}"

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass
class Cluster:
    config: ClusterConfig
    pool_socket: str | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory | None = None

    @property
    def router_url(self) -> str:
        return self.config.router_url

    @property
    def replica_urls(self) -> list[str]:
        return [self.config.replica_url(i) for i in range(self.config.num_replicas)]

    def _spawn(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        out = None if self.config.log_level in ("DEBUG", "INFO") else subprocess.DEVNULL
        proc = subprocess.Popen(args, stdout=out, start_new_session=True, preexec_fn=_die_with_parent, env=env)
        self.processes[name] = proc
        return proc

    def start(self, progress=None) -> "Cluster":
        cfg = self.config
        kv = [sys.executable, "-m", "kvshare", "--log-level", cfg.log_level]
        try:
            self._preflight()
            if cfg.pool_size is not None:
                self._tmp = tempfile.TemporaryDirectory(prefix="kvshare-up-")
                os.chmod(self._tmp.name, 0o700)
                self.pool_socket = os.path.join(self._tmp.name, "pool.sock")
                proc = self._spawn("pool", kv + ["pool", "--size", cfg.pool_size, "--socket", self.pool_socket,
                                                 *cfg.pool_args])
                wait_for_pool(self.pool_socket, proc=proc)
                _say(progress, "pool ready")
            for i in range(cfg.num_replicas):
                self._spawn(f"replica{i}", *self._replica_command(i, kv))
            for i, url in enumerate(self.replica_urls):
                self._wait_http(f"replica{i}", url)
                _say(progress, f"replica {i} ready at {url}")
            self._spawn("router", kv + ["route", "--policy", cfg.policy, "--host", cfg.host, "--port", str(cfg.port),
                                        *sum((["--replica", u] for u in self.replica_urls), []),
                                        *_key_args(cfg.api_keys), *cfg.router_args])
            self._wait_http("router", self.router_url)
            _say(progress, f"router ready at {self.router_url}")
        except BaseException:
            self.stop()
            raise
        return self

    def _replica_command(self, i: int, kv: list[str]) -> tuple[list[str], dict | None]:
        cfg = self.config
        port = cfg.port + 1 + i
        if cfg.engine == "vllm":
            from kvshare.integrations.vllm.launch import VllmServerConfig, vllm_server_command
            from kvshare.keys import DEFAULT_CHUNK_TOKENS

            # prefill steps of one pool chunk: a replica that loads k chunks computes the rest in the same steps
            # (same shapes, same kernels) as the replica that computed the whole prompt, so a request served
            # alone gets the same logits bit for bit. With vLLM's default budget the full prompt is one step and
            # the tail over a loaded prefix another shape: vLLM CPU rounds them differently, 1e-2 in logprobs in
            # bf16 (what vLLM's "auto" runs a float32 preset in), 1e-5 in float32. --replica-arg overrides it.
            spec = vllm_server_command(VllmServerConfig(
                model=self._vllm_model_dir(), port=port, host=cfg.host, pool_socket=self.pool_socket,
                python=cfg.vllm_python or sys.executable, served_model_name=self._served_name(),
                replica=f"replica{i}", chunk_tokens=DEFAULT_CHUNK_TOKENS,
                max_num_batched_tokens=DEFAULT_CHUNK_TOKENS, extra_args=cfg.replica_args,
            ))
            return spec.argv, spec.env
        args = kv + ["serve", "--model", cfg.model, "--device", cfg.device, "--host", cfg.host, "--port", str(port),
                     "--replica-name", f"replica{i}", "--pool", self.pool_socket or "off", *_key_args(cfg.api_keys),
                     *(["--tenant-header", cfg.tenant_header] if cfg.tenant_header else []), *cfg.replica_args]
        return args, _cpu_threads_env(cfg)

    def _served_name(self) -> str:
        """vLLM's rule, and `kvshare serve`'s: the model id is the --model argument as given (a path stays a path)."""
        return self.config.model

    def _vllm_model_dir(self) -> str:
        """vLLM loads directories: a preset name is written out once (kvshare make-model) into the temp dir."""
        model = self.config.model
        if os.path.isdir(model):
            return model
        from kvshare.engine.make_model import write_model_dir

        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvshare-up-")
        path = os.path.join(self._tmp.name, model)
        if not os.path.isdir(path):
            write_model_dir(model, path)
        return path

    def _preflight(self) -> None:
        if self.config.engine == "vllm":
            from kvshare.integrations.vllm.launch import check_vllm_python

            problem = check_vllm_python(self.config.vllm_python or sys.executable)
            if problem:
                raise RuntimeError(problem + " (name the vLLM environment's interpreter with --vllm-python)")

    def _wait_http(self, name: str, url: str) -> None:
        wait_http_ready(url, self.processes[name], self.config.ready_timeout_s, name)

    def stop(self) -> None:
        """Router, then replicas, then the pool; SIGKILL whatever does not stop in time."""
        order = ["router"] + [n for n in self.processes if n.startswith("replica")] + ["pool"]
        for name in order:
            proc = self.processes.pop(name, None)
            if proc is not None:
                stop_process(proc, timeout_s=15)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Cluster":
        return self.start() if not self.processes else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _cpu_threads_env(cfg: ClusterConfig) -> dict | None:
    """On CPU, split the cores between the replicas (unless OMP_NUM_THREADS is set).

    Each replica's torch would otherwise run one thread per core; with N replicas on the same cores
    the threads of one parallel region wait on descheduled siblings: on a busy 2-core machine a
    200-token prefill took 4.4 s with 2 threads per replica and 0.12 s with 1.
    """
    if cfg.device != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return dict(os.environ, OMP_NUM_THREADS=str(max(1, cores // cfg.num_replicas)))


def _key_args(api_keys: tuple[str, ...]) -> list[str]:
    return [arg for key in api_keys for arg in ("--api-key", key)]


def wait_http_ready(url: str, proc: subprocess.Popen | None, timeout_s: float, name: str = "the server") -> None:
    """Poll ``url``/health until it answers 200; raise if ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} at {url} exited with code {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} at {url} was not ready within {timeout_s} s")
        time.sleep(0.2)


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port p such that p .. p+count-1 are all free now (a router and its replicas)."""
    import contextlib
    import random
    import socket

    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20000, 60000 - count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind((host, port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"found no block of {count} free ports")


def _say(progress, message: str) -> None:
    if progress is not None:
        progress(message)
