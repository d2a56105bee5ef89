"""Settings of the vLLM connector (``kv_connector_extra_config``) and per-request options.

Pure: parsing and validation only. The connector is configured with::

    --kv-transfer-config '{"kv_connector": "KVShareConnector",
                           "kv_connector_module_path": "kvshare.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"pool_socket": "/run/kvshare/pool.sock"}}'

and a request opts out of the pool with ``"kv_transfer_params": {"kvshare": {"use_pool": false}}``.
The router names the request's account there too (``account``, ``account_tag``: kvshare.serve.tenancy).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from kvshare.keys import DEFAULT_CHUNK_TOKENS
from kvshare.layout import KVLayout
from kvshare.paths import default_pool_socket

if TYPE_CHECKING:
    from kvshare.transfer.base import TransferConfig

CUDA_COPY_METHODS = ("memcpy2d", "torch")
# when a load runs beside vLLM's steps (vLLM parks the request until get_finished names it) instead of inside
# the step that computes the request's suffix: "auto" when other requests are running on the replica (a load
# never stops their decoding), else in the step (it overlaps the request's own suffix compute)
ASYNC_LOADS = ("auto", "always", "never")  # kvshare.transfer.base.COPY_METHODS (imported lazily: it imports torch)

PARAMS_KEY = "kvshare"  # our entry in kv_transfer_params, in and out


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything ``kv_connector_extra_config`` may set; unknown keys are refused by name."""

    pool_socket: str = ""  # "" -> kvshare's default socket (kvshare.paths.default_pool_socket)
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # tokens per pool page; a multiple of vLLM's block size
    # share of loaded pages whose checksum is checked before their bytes are used, each page chosen at
    # random. 1.0 (every page), as `kvshare serve --verify-rate` defaults to: a page that is not checked
    # could serve wrong KV. Lower it to trade that guarantee for load time (the checksums were about a
    # third of a load's time on the 2-core CI machine; docs/vllm.md).
    verify_fraction: float = 1.0
    copy_threads: int = 2  # threads that copy between pages and vLLM's KV on CPU (1: vLLM's worker thread only)
    # on CPU, copy a load layer by layer on a helper thread while the forward runs, each attention layer
    # waiting for its own layer (kvshare.integrations.vllm.cpu_overlap). Off by default: it needs a core
    # outside vLLM's OpenMP team; on the 2-core machine the helper took one of the team's cores and the
    # forward, which waits for its slowest thread, ran 4x slower (docs/vllm.md)
    overlap_load: bool = False
    async_loads: str = "auto"  # ASYNC_LOADS
    # on a GPU: how pages move to and from the GPU staging buffers. "memcpy2d": one cudaMemcpy2DAsync per
    # layer group and run of pages (needs cuda-bindings); "torch": one copy per page and layer group. No fallback
    cuda_copy_method: str = "memcpy2d"
    cuda_staging_mib: int = 128  # on a GPU: each of the 4 staging buffers (2 for loads, 2 for stores)
    lease_ttl_s: float = 60.0  # a lease vLLM has not scheduled within this is released
    # longest wait for one pool reply before the pool counts as down; a lookup the pool may promote from its
    # remote tier is waited for that much longer (the pool's promote timeout: HelloReply.lookup_wait_s)
    pool_timeout_s: float = 2.0
    pool_retry_s: float = 5.0  # after a failure, how long to serve without the pool before trying again
    # the model's identity named by the user (e.g. a hub commit) instead of a hash of the weights' bytes;
    # replicas with one revision share KV, so it must name exactly these weights. "": hash them (default)
    model_revision: str = ""
    replica: str = ""  # name reported in each response's provenance
    store: bool = True  # put computed chunks into the pool
    load: bool = True  # take chunks from the pool
    allow_untested_vllm: bool = False  # run on a vLLM minor the connector was not tested with (compat)
    # file holding the key the router signs accounts with (kvshare.serve.tenancy.account_tag); "": the variable
    # $KVSHARE_ACCOUNT_KEY, else none: every request is charged to the namespace's shared account
    account_key_file: str = ""
    # where this replica takes the router's prefetch hints (kvshare.router.hints): a Unix socket's absolute path
    # or HOST:PORT; "": none. Hints are signed with the account key above, which must then be set
    hint_address: str = ""
    # the buffer that copies ahead on hints land in (gpu_prefetch, cpu_prefetch); on a GPU outside vLLM's KV budget
    # as the staging buffers are, and at most half the memory vLLM left free. 2 GiB: what ~40 ms of host-to-GPU
    # copy fills on an H100/H200, about vLLM's own time from a request's arrival to its scheduling; a longer run
    # copies its first layers. 0: no copies ahead
    prefetch_mib: int = 2048
    hint_ttl_s: float = 10.0  # a copy ahead that no load took within this is dropped
    # a hybrid model: besides each prompt's last chunks, keep the GDN state every this many chunks (0: only there),
    # as the built-in engine's state_checkpoint_chunks (a checkpoint of Qwen3.5-27B is ~147 MiB)
    state_checkpoint_chunks: int = 64

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        for name in ("lease_ttl_s", "pool_timeout_s", "pool_retry_s", "hint_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0.0 <= self.verify_fraction <= 1.0:
            raise ValueError(f"verify_fraction must lie in [0, 1], got {self.verify_fraction}")
        if self.copy_threads < 1:
            raise ValueError(f"copy_threads must be >= 1, got {self.copy_threads}")
        if self.cuda_copy_method not in CUDA_COPY_METHODS:
            raise ValueError(f"cuda_copy_method must be one of {CUDA_COPY_METHODS}, got {self.cuda_copy_method!r}")
        if self.state_checkpoint_chunks < 0:
            raise ValueError(f"state_checkpoint_chunks must be >= 0, got {self.state_checkpoint_chunks}")
        if self.prefetch_mib < 0:
            raise ValueError(f"prefetch_mib must be >= 0 (0: no copies ahead), got {self.prefetch_mib}")
        if self.hint_address:
            from kvshare.router.hints import parse_address

            parse_address(self.hint_address)
        if self.async_loads not in ASYNC_LOADS:
            raise ValueError(f"async_loads must be one of {ASYNC_LOADS}, got {self.async_loads!r}")
        if self.cuda_staging_mib < 2:
            raise ValueError(f"cuda_staging_mib must be >= 2 (one 2 MiB row), got {self.cuda_staging_mib}")

    @property
    def gpu_transfer(self) -> TransferConfig:
        """The GPU path's copy settings (kvshare.transfer.pipeline, through kvshare.integrations.vllm.gpu)."""
        from kvshare.transfer.base import TransferConfig

        return TransferConfig(copy_method=self.cuda_copy_method, staging_bytes=self.cuda_staging_mib << 20)

    @property
    def socket_path(self) -> str:
        return self.pool_socket or default_pool_socket()

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        for old, hint in _RENAMED.items():
            if old in extra:
                raise ValueError(f"kv_connector_extra_config.{old} is gone: {hint}")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(
                f"unknown kvshare connector settings {unknown} in kv_connector_extra_config; known: {sorted(known)}"
            )
        values = {}
        for name, value in extra.items():
            kind = type(known[name].default)
            if kind is bool and not isinstance(value, bool):
                raise ValueError(f"kv_connector_extra_config.{name} must be true or false, got {value!r}")
            try:
                values[name] = kind(value)
            except (TypeError, ValueError):
                raise ValueError(
                    f"kv_connector_extra_config.{name} must be of type {kind.__name__}, got {value!r}"
                ) from None
        return cls(**values)

    def check_block_size(self, block_size: int) -> None:
        if block_size <= 0 or self.chunk_tokens % block_size:
            raise ValueError(
                f"kvshare chunk_tokens ({self.chunk_tokens}) must be a multiple of vLLM's block size ({block_size}); "
                "set kv_connector_extra_config.chunk_tokens or --block-size accordingly"
            )


_RENAMED = {
    "verify_checksums": "set verify_fraction (1.0 checks every page, 0 none; default 1.0)",
    "model_id": "a name no longer enters the key namespace (the weights' bytes do); to name the model's "
    "identity yourself set model_revision",
}


@dataclass(frozen=True)
class TransferParams:
    """A vLLM request's ``kv_transfer_params["kvshare"]``; anything unrecognised leaves the defaults.

    (The built-in engine's per-request options are ``kvshare.engine.engine.RequestOptions``.)
    """

    use_pool: bool = True
    # whose pool quota the request's pages count against (kvshare.serve.tenancy): the router's ``account``,
    # taken only with a valid ``account_tag`` under the replica's account key; None: the shared account
    account: str | None = None
    is_account_refused: bool = False  # an account was named without a valid tag (or the replica has no key)

    @classmethod
    def from_params(cls, params: Any, account_key: str = "") -> TransferParams:
        """``account_key`` ("" : none configured, so no account is taken) checks the router's account tag."""
        from kvshare.serve.tenancy import is_account_tag_valid

        if not isinstance(params, dict):
            return cls()
        ours = params.get(PARAMS_KEY)
        if not isinstance(ours, dict):
            return cls()
        use_pool = ours.get("use_pool", True)
        account, tag = ours.get("account"), ours.get("account_tag")
        is_signed = (
            isinstance(account, str) and isinstance(tag, str) and is_account_tag_valid(account_key, account, tag)
        )
        return cls(
            use_pool=use_pool if isinstance(use_pool, bool) else True,
            account=account if is_signed else None,
            is_account_refused=account is not None and not is_signed,
        )


def kv_layout_of(vllm_config: Any, chunk_tokens: int) -> KVLayout:
    """The pool page layout of the model vLLM serves: every KV head (whatever the tensor parallel size),
    in the KV cache's dtype (the model's, or fp8 with ``--kv-cache-dtype fp8``)."""
    from kvshare.integrations.vllm.guards import kv_dtype_of

    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if getattr(cache, "calculate_kv_scales", False):
        raise ValueError(
            "kvshare cannot share fp8 KV whose scales vLLM computes per replica (calculate_kv_scales); "
            "use scales from the checkpoint (or 1.0)"
        )
    return KVLayout(
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_dim=model.get_head_size(),
        dtype=kv_dtype_of(cache.cache_dtype, str(model.dtype).replace("torch.", "")),
        chunk_tokens=chunk_tokens,
    )


def check_supported(vllm_config: Any) -> None:
    """Refuse, by name, set-ups the connector does not handle yet."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "kvshare's vLLM connector supports pipeline_parallel_size 1 only for now "
            f"(got {parallel.pipeline_parallel_size}); use tensor parallelism or several replicas sharing one pool"
        )


def provenance(
    replica: str, num_prompt_tokens: int, local_tokens: int, pool_tokens: int, namespace: bytes = b""
) -> dict[str, Any]:
    """Where a request's prompt tokens came from, as returned in kv_transfer_params["kvshare"], and the pool
    namespace its keys are in (hex; ``kvshare pool-admin flush --replica URL --tenant T`` reads it)."""
    local_tokens = max(min(local_tokens, num_prompt_tokens), 0)
    pool_tokens = max(min(pool_tokens, num_prompt_tokens - local_tokens), 0)
    origin = {
        "replica": replica,
        "local_tokens": local_tokens,
        "pool_tokens": pool_tokens,
        "computed_tokens": num_prompt_tokens - local_tokens - pool_tokens,
    }
    return {**origin, "namespace": namespace.hex()} if namespace else origin
