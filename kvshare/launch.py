"""``kvshare up``: the pool, N replicas and the router as child processes, started and stopped together.

Children run in their own process group (a Ctrl-C reaches only ``up``, which then
stops them in order: router, replicas, pool) and get SIGTERM from the kernel if
``up`` itself dies (PR_SET_PDEATHSIG), so nothing is orphaned (kvshare.children).
The pool's arena is a memfd and its socket lives in a private temporary directory
that is removed on exit: no shared-memory segment or socket is left behind.

Before anything starts, the model, the ports and the pool's size are checked
(kvshare.preflight); a child is ready when what answers is that child (its /health
reports the instance id it was started with). ``kvshare up`` then supervises the
children (kvshare.supervisor): ``restart`` starts one again from the same command.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from kvshare.children import Child, ChildSpec, describe_exit, start_child
from kvshare.pool.client import PoolUnavailable
from kvshare.pool.spawn import kvshare_command, kvshare_env, stop_process, wait_for_pool


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
    tensor_parallel_size: int = 1  # vLLM replicas only: ranks per replica (--tensor-parallel-size)
    ready_timeout_s: float = 300.0
    log_level: str = "WARNING"

    def __post_init__(self) -> None:
        if self.num_replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if self.engine not in ("builtin", "vllm"):
            raise ValueError(f"unknown engine {self.engine!r}; choose builtin or vllm")
        if self.tensor_parallel_size != 1 and (self.engine != "vllm" or self.tensor_parallel_size < 1):
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: vLLM replicas only, at least 1")
        if self.engine == "vllm" and (self.api_keys or self.tenant_header):
            raise ValueError("--api-key and --tenant-header apply to built-in replicas; for vLLM pass its own "
                             "--api-key with --replica-arg (tenants: the request's cache_salt)")

        devices = self.device.split(",")
        if self.engine == "vllm" and len(devices) > 1 and "cpu" in devices:
            raise ValueError(f"--device {self.device}: vLLM replicas run all on CPU or all on GPUs, not mixed")
        if self.engine == "vllm" and self.tensor_parallel_size > 1 and self.device != "cpu" and len(devices) > 1:
            raise ValueError("--tensor-parallel-size with vLLM on GPUs: give --device cuda (each replica's ranks "
                             "take the GPUs CUDA_VISIBLE_DEVICES lists), not a list of one GPU per replica")
        for device in devices:
            if not (device == "cpu" or device == "cuda" or (device.startswith("cuda:") and device[5:].isdigit())):
                raise ValueError(f"--device takes cpu, cuda, cuda:N or a comma list of them (one per replica, cycled), "
                                 f"got {self.device!r}")

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
    children: dict[str, Child] = field(default_factory=dict)  # how each was started, its output
    _tmp: tempfile.TemporaryDirectory | None = None

    @property
    def router_url(self) -> str:
        return self.config.router_url

    @property
    def replica_urls(self) -> list[str]:
        return [self.config.replica_url(i) for i in range(self.config.num_replicas)]

    def _spawn(self, spec: ChildSpec) -> subprocess.Popen:
        child = start_child(spec, is_verbose=self.config.log_level in ("DEBUG", "INFO"))
        self.children[spec.name] = child
        self.processes[spec.name] = child.proc
        return child.proc

    def start(self, progress=None) -> "Cluster":
        cfg = self.config
        kv = kvshare_command(cfg.log_level)
        try:
            self._preflight()
            if cfg.pool_size is not None:
                self._tmp = tempfile.TemporaryDirectory(prefix="kvshare-up-")
                os.chmod(self._tmp.name, 0o700)
                self.pool_socket = os.path.join(self._tmp.name, "pool.sock")
                self._spawn(ChildSpec("pool", (*kv, "pool", "--size", str(cfg.pool_size), "--socket",
                                               self.pool_socket, *cfg.pool_args), kvshare_env()))
                self._wait_pool()
                _point_to_pool(self.pool_socket)  # so kvshare pool-stats / pool-admin find it with no --socket
                _say(progress, "pool ready")
            ready: set[int] = set()
            for i in range(cfg.num_replicas):
                for j in starts_after(cfg, i):
                    if j not in ready:
                        self._wait_http(f"replica{j}")
                        ready.add(j)
                        _say(progress, f"replica {j} ready at {cfg.replica_url(j)}")
                argv, env = self._replica_command(i, kv)
                self._spawn(ChildSpec(f"replica{i}", tuple(argv), env, url=cfg.replica_url(i),
                                      takes_instance_id=cfg.engine == "builtin"))
            for i, url in enumerate(self.replica_urls):
                if i not in ready:
                    self._wait_http(f"replica{i}")
                    _say(progress, f"replica {i} ready at {url}")
            self._spawn(ChildSpec("router", (*kv, "route", "--policy", cfg.policy, "--host", cfg.host,
                                             "--port", str(cfg.port),
                                             *sum((["--replica", u] for u in self.replica_urls), []),
                                             *_key_args(cfg.api_keys), *cfg.router_args),
                                  kvshare_env(), url=self.router_url, takes_instance_id=True))
            self._wait_http("router")
            _say(progress, f"router ready at {self.router_url}")
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, name: str) -> None:
        """Start child ``name`` again from the command it was first started with (a fresh instance id)."""
        self._spawn(self.children[name].spec)

    def is_ready(self, name: str) -> bool:
        """One quick look: does child ``name`` answer now (the pool its socket, the others /health as themselves)?"""
        child = self.children[name]
        if child.spec.url is None:
            try:
                wait_for_pool(self.pool_socket, timeout_s=0)
            except PoolUnavailable:
                return False
            return True
        return health_answer(child.spec.url, child.instance_id, timeout_s=1.0) == "ready"

    def output_lines(self, name: str) -> list[str]:
        """The last lines child ``name`` wrote to stderr (waiting briefly for the rest when it exited)."""
        child = self.children.get(name)
        return child.output.lines() if child is not None else []

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
            # On a GPU vLLM's defaults apply (its step budget, the model's context length, compiled graphs).
            device, visible = gpu_of_replica(cfg.device, i)
            on_gpu = device != "cpu"
            if device.startswith("cuda:"):  # vLLM takes its GPU from CUDA_VISIBLE_DEVICES, as cuda
                visible = device[len("cuda:"):]
            spec = vllm_server_command(VllmServerConfig(
                model=self._vllm_model_dir(), port=port, host=cfg.host, pool_socket=self.pool_socket,
                python=cfg.vllm_python or find_vllm_python(), served_model_name=self._served_name(),
                replica=f"replica{i}", chunk_tokens=DEFAULT_CHUNK_TOKENS,
                max_num_batched_tokens=None if on_gpu else DEFAULT_CHUNK_TOKENS, extra_args=cfg.replica_args,
                tensor_parallel_size=cfg.tensor_parallel_size, device="cuda" if on_gpu else "cpu",
                max_model_len=None if on_gpu else 4096,
                gpu_memory_utilization=gpu_memory_share(cfg, i) if on_gpu else None,
            ))
            if visible is not None:
                spec.env["CUDA_VISIBLE_DEVICES"] = visible
            return spec.argv, spec.env
        device, visible = gpu_of_replica(cfg.device, i)
        args = [*kv, "serve", "--model", cfg.model, "--device", device, "--host", cfg.host, "--port", str(port),
                     "--replica-name", f"replica{i}", "--pool", self.pool_socket or "off", *_key_args(cfg.api_keys),
                     *(["--tenant-header", cfg.tenant_header] if cfg.tenant_header else []), *cfg.replica_args]
        env = kvshare_env(_cpu_threads_env(cfg))
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        return args, env

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
        """The model, the ports, the pool's size (kvshare.preflight) and vLLM's interpreter, before anything starts."""
        from kvshare import preflight
        from kvshare.errors import UserError
        from kvshare.keys import DEFAULT_CHUNK_TOKENS
        from kvshare.pool.allocator import default_extent_bytes
        from kvshare.units import parse_size

        cfg = self.config
        preflight.check_model(cfg.model)
        preflight.check_ports_free(cfg.host, {cfg.port: "the router", **{
            cfg.port + 1 + i: f"replica{i}" for i in range(cfg.num_replicas)}})
        if cfg.pool_size is not None:
            try:
                size = parse_size(str(cfg.pool_size))
                extent_flag = _flag_value(cfg.pool_args, "--extent-size")
                extent = parse_size(extent_flag) if extent_flag else default_extent_bytes(size)
                chunk_tokens = int(_flag_value(cfg.replica_args, "--chunk-tokens") or DEFAULT_CHUNK_TOKENS)
            except ValueError as exc:
                raise UserError(str(exc)) from None
            preflight.check_pool_size(size, "--pool-size")
            if cfg.engine == "builtin":  # vLLM may run the KV in another dtype than the model's own
                layout = preflight.model_layout(cfg.model, chunk_tokens)
                preflight.check_pool_holds_a_page(size, extent, layout, cfg.model)
        if cfg.engine == "vllm":
            from kvshare.integrations.vllm.launch import check_vllm_python

            problem = check_vllm_python(cfg.vllm_python or find_vllm_python())
            if problem:
                raise RuntimeError(problem + " (name the vLLM environment's interpreter with --vllm-python)")

    def _wait_pool(self) -> None:
        try:
            wait_for_pool(self.pool_socket, proc=self.processes["pool"])
        except PoolUnavailable as exc:
            raise RuntimeError(f"the pool did not start: {exc}{self._tail('pool')}") from None

    def _wait_http(self, name: str) -> None:
        child = self.children[name]
        try:
            wait_http_ready(child.spec.url, child.proc, self.config.ready_timeout_s, name, child.instance_id)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}{self._tail(name)}") from None

    def _tail(self, name: str) -> str:
        lines = self.output_lines(name) if self.processes[name].poll() is not None else []
        return "; its last lines:\n" + "\n".join(f"  {line}" for line in lines) if lines else ""

    def stop(self) -> None:
        """Router, then replicas, then the pool; SIGKILL whatever does not stop in time."""
        order = ["router"] + [n for n in self.processes if n.startswith("replica")] + ["pool"]
        for name in order:
            proc = self.processes.pop(name, None)
            self.children.pop(name, None)
            if proc is not None:
                stop_process(proc, timeout_s=15)
        if self._tmp is not None:
            _unpoint_pool(self.pool_socket)
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "Cluster":
        return self.start() if not self.processes else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _point_to_pool(socket_path: str) -> None:
    from kvshare.paths import up_pool_pointer

    tmp = up_pool_pointer() + f".{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(socket_path)
    os.replace(tmp, up_pool_pointer())  # the last up started wins


def _unpoint_pool(socket_path: str | None) -> None:
    """Remove the pointer if it still names this cluster's pool (another up may have replaced it)."""
    from kvshare.paths import up_pool_pointer

    try:
        with open(up_pool_pointer()) as f:
            if f.read().strip() == socket_path:
                os.unlink(up_pool_pointer())
    except OSError:
        pass


def gpu_of_replica(devices: str, index: int) -> tuple[str, str | None]:
    """Replica ``index``'s ``--device`` out of ``kvshare up --device``, and its CUDA_VISIBLE_DEVICES (None: as
    inherited). One device is every replica's; a comma list is cycled over them (``cuda:0,cuda:1``: a GPU
    each, as the study's two replicas ran), and then a replica sees only its own GPU, as ``cuda`` (so that
    its threads, streams and the pool's registration all use that one, as a vLLM replica's would)."""
    names = devices.split(",")
    device = names[index % len(names)]
    if len(names) > 1 and device.startswith("cuda:"):
        return "cuda", device[len("cuda:"):]
    return device, None


VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of a GPU for one replica


def gpu_memory_share(cfg: ClusterConfig, index: int) -> float | None:
    """--gpu-memory-utilization of vLLM replica ``index``: vLLM's 0.9 split evenly between the replicas that
    share its GPU (two on one GPU: 0.45 each); None (vLLM's default) when it has a GPU to itself or when
    --replica-arg sets the flag."""
    if any(arg.split("=")[0] == "--gpu-memory-utilization" for arg in cfg.replica_args):
        return None
    mine = gpu_of_replica(cfg.device, index)
    sharing = sum(gpu_of_replica(cfg.device, j) == mine for j in range(cfg.num_replicas))
    return None if sharing == 1 else round(VLLM_GPU_MEMORY_UTILIZATION / sharing, 3)


def starts_after(cfg: ClusterConfig, index: int) -> list[int]:
    """The replicas that must be ready before replica ``index`` starts: for vLLM on a GPU, the earlier ones on
    its GPU. vLLM sizes its KV cache from the memory it sees taken while it profiles, so a neighbour loading its
    weights at the same time shrinks it (two 8B-shape replicas started together on one H200 at 0.45 each: the
    second got 1.54 GiB of KV and refused to start). With --kv-cache-memory-bytes vLLM does not size it so."""
    if cfg.engine != "vllm" or cfg.device == "cpu":
        return []
    if any(arg.split("=")[0] == "--kv-cache-memory-bytes" for arg in cfg.replica_args):
        return []
    mine = gpu_of_replica(cfg.device, index)
    return [j for j in range(index) if gpu_of_replica(cfg.device, j) == mine]


def find_vllm_python() -> str:
    """The interpreter that runs vLLM when --vllm-python is not given: this one when it can import vLLM
    (installed here, or on PYTHONPATH), else the one named by the ``vllm`` command on PATH, else this one
    (the preflight then says what is missing)."""
    import importlib.util
    import shutil

    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    script = shutil.which("vllm")
    if script is not None:
        try:
            with open(script, "rb") as f:
                first = f.readline().decode(errors="replace").strip()
        except OSError:
            first = ""
        if first.startswith("#!") and os.path.isfile(first[2:].split()[0]):
            return first[2:].split()[0]
    return sys.executable


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


def health_answer(url: str, instance_id: str | None, timeout_s: float = 2.0) -> str:
    """``ready`` when ``url``/health answers 200 (as ``instance_id``, when given); ``other`` when another
    server answers in its place; ``no`` otherwise."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as resp:
            if resp.status != 200:
                return "no"
            if instance_id is None:
                return "ready"
            body = json.loads(resp.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return "no"
    return "ready" if isinstance(body, dict) and body.get("instance_id") == instance_id else "other"


def wait_http_ready(url: str, proc: subprocess.Popen | None, timeout_s: float, name: str = "the server",
                    instance_id: str | None = None) -> None:
    """Poll ``url``/health until it answers 200 (as ``instance_id``, when given: the process just started, not
    another that holds the port); raise if ``proc`` exits first or time runs out."""
    deadline = time.monotonic() + timeout_s
    other = ""
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{name} at {url} exited ({describe_exit(proc.returncode)}) before it was ready{other}")
        answer = health_answer(url, instance_id)
        if answer == "ready":
            return
        if answer == "other":
            other = f"; another server answers at {url} (not the {name} just started): its port is taken"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} at {url} was not ready within {timeout_s} s{other}")
        time.sleep(0.2)


def free_port_block(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port p such that p .. p+count-1 are all free now (a router and its replicas).

    Drawn below the kernel's ephemeral range when there is room: a port there can be taken by any
    outgoing connection between this check and the child's bind.
    """
    import contextlib
    import random
    import socket

    low, high = 20000, 60000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
        if ephemeral_low - low > 1000 + count:
            high = ephemeral_low
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(low, high - count)
        try:
            with contextlib.ExitStack() as stack:
                for port in range(base, base + count):
                    stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind((host, port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"found no block of {count} free ports")


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last one wins), None when absent."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def _say(progress, message: str) -> None:
    if progress is not None:
        progress(message)
