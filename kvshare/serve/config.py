"""A replica's server configuration (``ServeConfig``): its address, names, limits, keys and what it shows,
checked on construction; ``kvshare serve``'s flags map onto its fields."""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.serve.audit import AuditConfig
from kvshare.serve.responses import PROVENANCE


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    replica_name: str = "replica"
    served_model_names: tuple[str, ...] = ()  # empty: the engine's --model argument as given (vLLM's rule)
    max_body_bytes: int = 16 << 20
    max_requests: int = 64  # queued + running; more get 429
    max_prompt_tokens: int | None = None  # default: the model's context
    max_tokens_limit: int | None = None  # default: the room the context leaves (as vLLM)
    default_chat_max_tokens: int = 1024
    api_keys: tuple[str, ...] = ()  # empty: no authentication (/v1/ and /admin/ need a key when set)
    tenant_header: str = ""  # e.g. "X-Tenant-ID": its value salts the pool namespace (kvshare.serve.tenancy)
    write_timeout_s: float = 30.0  # a client that takes longer to accept one write of a stream is dropped
    stream_buffer_bytes: int = 256 << 10  # kernel send buffer of a stream (bounds what a stalled client holds)
    audit: AuditConfig = AuditConfig()  # --audit-rate: recompute a sample of reused requests cold (serve/audit.py)
    instance_id: str = ""  # --instance-id: kvshare up's id of this process, reported by /health
    warmup: bool = False  # run the warm-up (kvshare.engine.warmup) before reporting healthy; serve: on (--no-warmup)
    provenance: str = "own-tenant"  # --provenance: to whom the "kvshare" object and cached_tokens are shown
    max_tokenize_bytes: int = 1 << 20  # a /tokenize or /detokenize body larger than this gets 413

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0 or self.max_requests <= 0:
            raise ValueError("limits must be positive")
        if self.max_tokens_limit is not None and self.max_tokens_limit <= 0:
            raise ValueError("--max-tokens-limit must be positive")
        if self.write_timeout_s <= 0 or self.stream_buffer_bytes <= 0:
            raise ValueError("write_timeout_s and stream_buffer_bytes must be positive")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ValueError("an API key must be non-empty and carry no surrounding spaces")
        if self.provenance not in PROVENANCE:
            raise ValueError(f"--provenance {self.provenance}: choose one of {', '.join(PROVENANCE)}")
        if self.max_tokenize_bytes <= 0:
            raise ValueError("max_tokenize_bytes must be positive")
