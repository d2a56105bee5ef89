"""``kvshare up``: the pool, N replicas and the router as child processes, started and stopped together.

Children run in their own process group (a Ctrl-C reaches only ``up``, which then stops them in order: router,
replicas, pool) and get SIGTERM from the kernel if ``up`` itself dies (PR_SET_PDEATHSIG), so nothing is orphaned
(kvshare.children). The pool's arena is a memfd and its socket lives in a private temporary directory that is
removed on exit: no shared-memory segment or socket is left behind.

Before anything starts, the model, the ports and the pool's size are checked (kvshare.preflight); a child is ready
when what answers is that child (its /health reports the instance id it was started with). ``kvshare up`` then
supervises the children (kvshare.supervisor): ``restart`` starts one again from the same command.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from dataclasses import dataclass, field

from kvshare import memory_fit
from kvshare.children import Child, ChildSpec, health_answer, start_child, wait_http_ready
from kvshare.cluster_config import ClusterConfig, flag_value
from kvshare.paths import point_to_pool, unpoint_pool
from kvshare.placement import cpu_threads_env, find_vllm_python, gpu_memory_share, gpu_of_replica, starts_after
from kvshare.pool.client import PoolUnavailable
from kvshare.pool.spawn import kvshare_command, kvshare_env, stop_process, wait_for_pool


@dataclass
class Cluster:
    config: ClusterConfig
    pool_socket: str | None = None
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    children: dict[str, Child] = field(default_factory=dict)  # how each was started, its output
    _tmp: tempfile.TemporaryDirectory | None = None
    account_key_file: str = ""  # vLLM replicas: the file the router and the connectors read the account key from
    oom_kills_at_start: int | None = None  # the kernel's OOM kills before start() (kvshare.memory_fit.oom_kills)
    engine_settings: str = ""  # what the replicas' engine was set up with beyond the defaults (a hybrid model's)

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

    def start(self, progress=None) -> Cluster:
        cfg = self.config
        kv = kvshare_command(cfg.log_level)
        self.oom_kills_at_start = memory_fit.oom_kills()
        try:
            self._preflight()
            if cfg.pool_size is not None:
                self.pool_socket = os.path.join(self._run_dir(), "pool.sock")
                self._spawn(
                    ChildSpec(
                        "pool",
                        (*kv, "pool", "--size", str(cfg.pool_size), "--socket", self.pool_socket, *cfg.pool_args),
                        kvshare_env(),
                    )
                )
                self._wait_pool()
                # so kvshare pool-stats / pool-admin find it with no --socket
                point_to_pool(self.config.pool_name, self.pool_socket)
                _say(progress, "pool ready")
            elif cfg.pool_socket is not None:  # a running pool (checked in the preflight): used, never stopped
                self.pool_socket = cfg.pool_socket
            self.account_key_file = self._account_key_file()
            ready: set[int] = set()
            for i in range(cfg.num_replicas):
                for j in starts_after(cfg, i):
                    if j not in ready:
                        self._wait_http(f"replica{j}")
                        ready.add(j)
                        _say(progress, f"replica {j} ready at {cfg.replica_url(j)}")
                argv, env = self._replica_command(i, kv)
                self._spawn(
                    ChildSpec(
                        f"replica{i}",
                        tuple(argv),
                        env,
                        url=cfg.replica_url(i),
                        takes_instance_id=cfg.engine == "builtin",
                    )
                )
            for i, url in enumerate(self.replica_urls):
                if i not in ready:
                    self._wait_http(f"replica{i}")
                    _say(progress, f"replica {i} ready at {url}")
            self._spawn(
                ChildSpec(
                    "router",
                    tuple(self._router_command(kv)),
                    kvshare_env(),
                    url=self.router_url,
                    takes_instance_id=True,
                )
            )
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
        """Replica ``i``'s command line and environment."""
        if self.config.engine == "vllm":
            return self._vllm_replica_command(i)
        return self._builtin_replica_command(i, kv)

    def _builtin_replica_command(self, i: int, kv: list[str]) -> tuple[list[str], dict | None]:
        """``kvshare serve`` as one of the cluster's replicas: its tenants' keys, provenance, the cluster's token
        cache, KV events and a share of the CPU cores beside the others."""
        cfg = self.config
        device, visible = gpu_of_replica(cfg.device, i)
        args = [
            *serve_command(kv, cfg.model, device, cfg.host, cfg.port + 1 + i, f"replica{i}", self.pool_socket),
            *_auth_args(cfg),
            "--provenance",
            cfg.provenance,
            "--token-cache-dir",
            self._private_dir("token-cache"),
            *(["--model-revision", cfg.model_revision] if cfg.model_revision else []),
            *(
                ["--kv-events", f"tcp://*:{cfg.replica_kv_events_port + i}"]
                if cfg.replica_kv_events_port is not None
                else []
            ),
            *cfg.replica_args,
        ]
        return args, replica_env(kvshare_env(cpu_threads_env(cfg)), visible)

    def _account_key_file(self) -> str:
        """vLLM replicas with a pool: the account key's file ("": $KVSHARE_ACCOUNT_KEY, which every child inherits).
        Without either, a random key in this cluster's private directory (0600 in a 0700 directory, removed on
        stop), so the router's accounts are taken by the connectors with no flag; never on a command line."""
        from kvshare.credentials import write_new_secret
        from kvshare.serve.tenancy import ACCOUNT_KEY_ENV

        cfg = self.config
        if cfg.engine != "vllm" or self.pool_socket is None:
            return ""
        if cfg.account_key_file or os.environ.get(ACCOUNT_KEY_ENV):
            return cfg.account_key_file
        return write_new_secret(os.path.join(self._private_dir("secrets"), "account.key"))

    def hint_address(self, i: int) -> str:
        """Where replica ``i``'s connector takes the router's prefetch hints: a Unix socket in this cluster's
        private directory ("": the cluster sends none)."""
        from kvshare.serve.tenancy import ACCOUNT_KEY_ENV

        has_key = self.account_key_file or self.config.account_key_file or os.environ.get(ACCOUNT_KEY_ENV)
        if not (self.config.has_hints and has_key):
            return ""
        return os.path.join(self._private_dir("hints"), f"replica{i}.sock")

    def _router_command(self, kv: list[str]) -> list[str]:
        """The router in front of the replicas; it authenticates. With vLLM replicas it salts each tenant's
        requests itself and signs their pool accounts (kvshare.router.accounts), and tells each replica the
        prompts it sends there (prefetch hints; the model's tokenizer encodes text prompts for them)."""
        cfg = self.config
        engine = ["--engine", cfg.engine] if cfg.engine != "builtin" else []
        account = ["--account-key-file", self.account_key_file] if self.account_key_file else []
        hints = [self.hint_address(i) for i in range(cfg.num_replicas)]
        if any(hints):
            account += [*sum((["--hint-address", h] for h in hints), []), "--model", cfg.model]
        return [
            *kv,
            "route",
            "--policy",
            cfg.policy,
            "--host",
            cfg.host,
            "--port",
            str(cfg.port),
            *sum((["--replica", u] for u in self.replica_urls), []),
            *_auth_args(cfg),
            *engine,
            *account,
            *cfg.router_args,
        ]

    def _run_dir(self) -> str:
        """This cluster's private directory (0700), made once: every path handed out in it stays valid (a hint
        socket named before the start, to a router started beside the cluster, is the one its replica binds)."""
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvshare-up-")
            os.chmod(self._tmp.name, 0o700)
        return self._tmp.name

    def _private_dir(self, name: str) -> str:
        """A directory of this cluster's own, removed when it stops (with whatever its children left there)."""
        path = os.path.join(self._run_dir(), name)
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    def _served_name(self) -> str:
        """vLLM's rule, and `kvshare serve`'s: the model id is the --model argument as given (a path stays a path)."""
        return self.config.model

    def _vllm_replica_command(self, i: int) -> tuple[list[str], dict | None]:
        """Replica ``i`` as a vLLM server with kvshare's connector (kvshare.integrations.vllm.launch)."""
        from kvshare.integrations.vllm.launch import VllmServerConfig, hybrid_settings, vllm_server_command
        from kvshare.keys import DEFAULT_CHUNK_TOKENS

        cfg = self.config
        # prefill steps of one pool chunk: a replica that loads k chunks computes the rest in the same steps
        # (same shapes, same kernels) as the replica that computed the whole prompt, so a request served
        # alone gets the same logits bit for bit. With vLLM's default budget the full prompt is one step and
        # the tail over a loaded prefix another shape: vLLM CPU rounds them differently, 1e-2 in logprobs in
        # bf16 (what vLLM's "auto" runs a float32 preset in), 1e-5 in float32. --replica-arg overrides it.
        # On a GPU vLLM's defaults apply (its step budget, the model's context length, compiled graphs).
        device, visible = gpu_of_replica(cfg.device, i)
        on_gpu = device != "cpu"
        if device.startswith("cuda:"):  # vLLM takes its GPU from CUDA_VISIBLE_DEVICES, as cuda
            visible = device[len("cuda:") :]
        # a Gated DeltaNet hybrid: vLLM's block size for it as the chunk, steps of one block, align mode
        hybrid = hybrid_settings(self._vllm_model_dir(), "cuda" if on_gpu else "cpu")
        chunk_tokens = hybrid.chunk_tokens if hybrid is not None else DEFAULT_CHUNK_TOKENS
        if hybrid is not None:
            self.engine_settings = hybrid.describe()
        spec = vllm_server_command(
            VllmServerConfig(
                model=self._vllm_model_dir(),
                port=cfg.port + 1 + i,
                host=cfg.replica_host,
                pool_socket=self.pool_socket,
                python=cfg.vllm_python or find_vllm_python(),
                served_model_name=self._served_name(),
                replica=f"replica{i}",
                chunk_tokens=chunk_tokens,
                block_size=hybrid.block_size if hybrid is not None else 32,
                max_num_batched_tokens=chunk_tokens if hybrid is not None or not on_gpu else None,
                mamba_cache_mode=hybrid.mamba_cache_mode if hybrid is not None else None,
                extra_args=cfg.replica_args,
                tensor_parallel_size=cfg.tensor_parallel_size,
                device="cuda" if on_gpu else "cpu",
                max_model_len=None if on_gpu else 4096,
                gpu_memory_utilization=gpu_memory_share(cfg, i) if on_gpu else None,
                model_revision=cfg.model_revision,
                kv_events_port=None if cfg.replica_kv_events_port is None else cfg.replica_kv_events_port + i,
                tmp_dir=self._private_dir(f"replica{i}-tmp"),
                account_key_file=self.account_key_file,
                hint_address=self.hint_address(i),
            )
        )
        if visible is not None:
            spec.env["CUDA_VISIBLE_DEVICES"] = visible
        return spec.argv, spec.env

    def _vllm_model_dir(self) -> str:
        """vLLM loads directories: a preset name is written out once (kvshare make-model) into the temp dir."""
        model = self.config.model
        if os.path.isdir(model):
            return model
        from kvshare.engine.make_model import write_model_dir

        path = os.path.join(self._run_dir(), model)
        if not os.path.isdir(path):
            write_model_dir(model, path)
        return path

    def _preflight(self) -> None:
        """The model, the ports, the pool's size, the memory the replicas and the pool need (kvshare.preflight,
        kvshare.memory_fit) and vLLM's interpreter, before anything starts."""
        from kvshare import preflight
        from kvshare.errors import UserError
        from kvshare.keys import DEFAULT_CHUNK_TOKENS
        from kvshare.pool.allocator import default_extent_bytes
        from kvshare.units import parse_size

        cfg = self.config
        preflight.check_model(cfg.model)
        preflight.check_ports_free(cfg.host, {cfg.port: "the router"})
        preflight.check_ports_free(cfg.replica_host, {cfg.port + 1 + i: f"replica{i}" for i in range(cfg.num_replicas)})
        if cfg.pool_size is not None:
            try:
                size = parse_size(str(cfg.pool_size))
                extent_flag = flag_value(cfg.pool_args, "--extent-size")
                extent = parse_size(extent_flag) if extent_flag else default_extent_bytes(size)
                chunk_tokens = int(flag_value(cfg.replica_args, "--chunk-tokens") or DEFAULT_CHUNK_TOKENS)
            except ValueError as exc:
                raise UserError(str(exc)) from None
            preflight.check_pool_size(size, "--pool-size")
            if cfg.engine == "builtin":  # vLLM may run the KV in another dtype than the model's own
                layout = preflight.model_layout(cfg.model, chunk_tokens)
                preflight.check_pool_holds_a_page(
                    size, extent, layout, cfg.model, preflight.model_state_bytes(cfg.model)
                )
        if cfg.pool_socket is not None:
            try:
                wait_for_pool(cfg.pool_socket, timeout_s=0)
            except PoolUnavailable as exc:
                raise UserError(f"--pool {cfg.pool_socket}: no pool answers there ({exc})") from None
        memory_fit.check_cluster_fits(cfg, size if cfg.pool_size is not None else 0)
        if cfg.engine == "vllm":
            from kvshare.integrations.vllm.launch import check_vllm_python
            from kvshare.serve.tenancy import read_account_key

            try:
                read_account_key(cfg.account_key_file)
            except ValueError as exc:
                raise UserError(str(exc)) from None

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
            wait_http_ready(
                child.spec.url,
                child.proc,
                self.config.ready_timeout_s,
                name,
                child.instance_id,
                self.oom_kills_at_start,
            )
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}{self._needs(name)}{self._tail(name)}") from None

    def _needs(self, name: str) -> str:
        """For a built-in replica the OOM killer ended: what it was estimated to need."""
        cfg = self.config
        returncode = self.processes[name].returncode
        if (
            not name.startswith("replica")
            or cfg.engine != "builtin"
            or not memory_fit.oom_hint(returncode, self.oom_kills_at_start)
        ):
            return ""
        device = gpu_of_replica(cfg.device, int(name[len("replica") :]))[0]
        needs = memory_fit.replica_memory(cfg.model, cfg.replica_args, device)
        return f"; a replica of {cfg.model} needs about {needs.describe()}"

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
            if self.config.pool_size is not None:  # only the pointer to the pool this cluster started
                unpoint_pool(self.config.pool_name, self.pool_socket)
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> Cluster:
        return self.start() if not self.processes else self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_command(
    kv: list[str], model: str, device: str, host: str, port: int, name: str, pool_socket: str | None
) -> list[str]:
    """The start of every started built-in replica's ``kvshare serve`` command: its model, device, address, name
    and pool (None: off); what differs between starters (kvshare up, the sequential benchmark) follows it."""
    return [
        *kv,
        "serve",
        "--model",
        model,
        "--device",
        device,
        "--host",
        host,
        "--port",
        str(port),
        "--replica-name",
        name,
        "--pool",
        pool_socket or "off",
    ]


def replica_env(env: dict[str, str], visible: str | None) -> dict[str, str]:
    """``env`` showing a replica only its own GPU (kvshare.placement.gpu_of_replica; None: the inherited one)."""
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def _auth_args(cfg: ClusterConfig) -> list[str]:
    tenant = ["--tenant-header", cfg.tenant_header] if cfg.tenant_header else []
    return [arg for key in cfg.api_keys for arg in ("--api-key", key)] + tenant


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


def _say(progress, message: str) -> None:
    if progress is not None:
        progress(message)
