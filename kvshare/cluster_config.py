"""What ``kvshare up`` starts (``ClusterConfig``): how many replicas of which model on which engine and devices,
the pool, the router and their ports; checked on construction, before anything starts (kvshare.launch)."""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.placement import is_device_name


@dataclass(frozen=True)
class ClusterConfig:
    num_replicas: int = 2
    model: str = "tiny"
    engine: str = "builtin"  # or "vllm"
    device: str = "cpu"
    pool_size: str | None = "4GiB"  # None: start no pool (use pool_socket's, or none)
    pool_socket: str | None = None  # a running pool's socket, used and left running (with pool_size None)
    pool_args: tuple[str, ...] = ()
    policy: str = "round_robin"
    host: str = "127.0.0.1"
    port: int = 8080  # the router; replicas take port+1 .. port+N
    name: str = ""  # the pool's name for pool-stats / pool-admin --name (kvshare.paths); "": the port
    replica_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()  # required by the router and built-in replicas (vLLM's sit behind the router)
    tenant_header: str = ""  # replicas salt the pool namespace with this header's value (the router its prefix memory)
    account_key_file: str = ""  # vLLM replicas: the router's account key; "": $KVSHARE_ACCOUNT_KEY, else up's own
    provenance: str = "all"  # the replicas' --provenance: all for one user (demo, bench); own-tenant when shared
    model_revision: str = ""  # names the model's identity in every replica's namespace; "": its weights' bytes
    vllm_python: str | None = None
    tensor_parallel_size: int = 1  # vLLM replicas only: ranks per replica (--tensor-parallel-size)
    replica_kv_events_port: int | None = None  # replica i publishes its own KV events on this port + i
    # vLLM replicas with a pool: the router tells the replica it places a request on which prompt is coming, so its
    # connector copies the prompt's pages ahead (kvshare.router.hints); False: loads start when vLLM schedules
    hints: bool = True
    ready_timeout_s: float = 300.0
    log_level: str = "WARNING"

    @property
    def pool_name(self) -> str:
        return self.name or str(self.port)

    def __post_init__(self) -> None:
        from kvshare.paths import check_pool_name

        if self.num_replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if self.pool_socket is not None and self.pool_size is not None:
            raise ValueError("--pool SOCKET uses a running pool; --pool-size sizes one up starts: give one of them")
        check_pool_name(self.pool_name)
        if self.port + self.num_replicas > 65535:
            raise ValueError(f"--port {self.port}: the replicas take the next {self.num_replicas} ports, past 65535")
        if self.engine not in ("builtin", "vllm"):
            raise ValueError(f"unknown engine {self.engine!r}; choose builtin or vllm")
        if self.tensor_parallel_size != 1 and (self.engine != "vllm" or self.tensor_parallel_size < 1):
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size}: vLLM replicas only, at least 1")
        if self.account_key_file and self.engine != "vllm":
            raise ValueError("--account-key-file: vLLM replicas' pool accounts; built-in replicas derive their own")

        devices = self.device.split(",")
        if self.engine == "vllm" and len(devices) > 1 and "cpu" in devices:
            raise ValueError(f"--device {self.device}: vLLM replicas run all on CPU or all on GPUs, not mixed")
        if self.engine == "vllm" and self.tensor_parallel_size > 1 and self.device != "cpu" and len(devices) > 1:
            raise ValueError(
                "--tensor-parallel-size with vLLM on GPUs: give --device cuda (each replica's ranks "
                "take the GPUs CUDA_VISIBLE_DEVICES lists), not a list of one GPU per replica"
            )
        for device in devices:
            if not is_device_name(device):
                raise ValueError(
                    f"--device takes cpu, cuda, cuda:N or a comma list of them (one per replica, cycled), "
                    f"got {self.device!r}"
                )

    @property
    def has_hints(self) -> bool:
        """Whether the router sends the replicas prefetch hints: vLLM replicas of one rank with a pool."""
        has_pool = self.pool_size is not None or self.pool_socket is not None
        return self.hints and self.engine == "vllm" and has_pool and self.tensor_parallel_size == 1

    @property
    def replica_host(self) -> str:
        """Where replicas listen: vLLM replicas check no key of their own, so only the router reaches them."""
        return "127.0.0.1" if self.engine == "vllm" else self.host

    def replica_url(self, i: int) -> str:
        return f"http://{self.replica_host}:{self.port + 1 + i}"

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.port}"


def flag_value(args: tuple[str, ...], flag: str) -> str | None:
    """The value of ``flag`` in ``args`` (``--flag V`` or ``--flag=V``; the last one wins), None when absent."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value
