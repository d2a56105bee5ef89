"""The router's configuration (``RouterConfig``): its replicas, policy, address, limits and keys, checked on
construction; ``kvshare route``'s flags map onto its fields."""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.router.policy import POLICIES
from kvshare.router.pool_aware import PoolAwareConfig
from kvshare.serve.tenancy import check_account_key


@dataclass(frozen=True)
class RouterConfig:
    replicas: tuple[str, ...]
    policy: str = "round_robin"
    host: str = "127.0.0.1"
    port: int = 8080
    health_interval_s: float = 1.0
    max_body_bytes: int = 16 << 20
    session_header: str = "X-Session-ID"
    session_ttl_s: float = 3600.0
    max_sessions: int = 100_000
    connect_timeout_s: float = 5.0
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    admin_key: str = ""  # /admin/ needs it (--admin-key-file, $KVSHARE_ADMIN_KEY); none: open only without API keys
    write_timeout_s: float = 30.0  # a client that takes longer to accept one write of a response is dropped
    # kernel send buffer towards a client (kvshare.serve.connection.limit_send_buffer)
    stream_buffer_bytes: int = 256 << 10
    instance_id: str = ""  # --instance-id: kvshare up's id of this process, reported by /health
    tenant_header: str = ""  # the replicas' --tenant-header: with the API key it seeds cache_aware's prefix memory
    expose_replica_header: bool = False  # X-KVShare-Replica on responses: says which replica holds a prefix
    pool_aware: PoolAwareConfig | None = None  # the pool's KV events, for --policy pool_aware
    account_key: str = ""  # --account-key-file: completions name their pool account for vLLM (router.accounts)
    engine: str = "builtin"  # --engine: what the replicas run; vllm: the router salts tenants' bodies (accounts)
    # --hint-address, one per replica in order ("" : that replica takes none): where a vLLM replica's connector
    # takes the router's prefetch hints (kvshare.router.hints), signed with account_key
    hint_addresses: tuple[str, ...] = ()
    model: str = ""  # --model: the replicas' model directory or preset, whose tokenizer encodes text prompts' hints

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("give at least one --replica URL")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
                raise ValueError(f"--replica {url}: give the replica's URL with its scheme, e.g. http://{url}")
        keys = (*self.api_keys, self.admin_key) if self.admin_key else self.api_keys
        if any(not key or key != key.strip() for key in keys):
            raise ValueError("an API key must be non-empty and carry no surrounding spaces")
        if self.write_timeout_s <= 0:
            raise ValueError(f"write_timeout_s must be positive, got {self.write_timeout_s}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.account_key:
            check_account_key(self.account_key)
        if self.engine not in ("builtin", "vllm"):
            raise ValueError(f"unknown engine {self.engine!r}; choose builtin or vllm")
        if self.hint_addresses:
            self._check_hints()
        if self.policy == "pool_aware" and self.pool_aware is None:
            raise ValueError("--policy pool_aware needs the pool's KV events: --kv-events ENDPOINT")

    def _check_hints(self) -> None:
        from kvshare.router.hints import parse_address

        if len(self.hint_addresses) != len(self.replicas):
            raise ValueError(
                f"give one --hint-address per --replica ({len(self.replicas)}), got {len(self.hint_addresses)}"
            )
        if self.engine != "vllm":
            raise ValueError("--hint-address is for vLLM replicas (--engine vllm)")
        if not self.account_key:
            raise ValueError("--hint-address needs the key hints are signed with: --account-key-file")
        for address in self.hint_addresses:
            if address:
                parse_address(address)
