"""What a request to the built-in engine carries in (``RequestOptions``) and what comes out of it: a
``TokenEvent`` per token, each naming the request's ``Provenance`` (where each prompt token's KV came from)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvshare.engine.timeline import Timeline
from kvshare.errors import RequestCancelled


@dataclass(frozen=True)
class RequestOptions:
    use_pool: bool = True  # the request extension {"kvshare": {"use_pool": false}}
    use_local_cache: bool = True
    tenant: str = ""  # salts local cache and pool keys: identity + cache_salt (kvshare.serve.tenancy.namespace_salt)
    account: str | None = None  # the identity alone, whatever cache_salt: pays the pool quota; None: ``tenant``
    timeline: Timeline | None = None  # {"kvshare": {"timeline": true}}: the steps of this request are timed
    # asked before each layer of the prefill: True gives the request up there (RequestCancelled), so a client
    # that left, or a replica that stops, does not hold the engine for the rest of a long prefill
    is_cancelled: Callable[[], bool] | None = None


@dataclass
class Provenance:
    """Where each prompt token's KV came from."""

    local_tokens: int
    pool_tokens: int
    computed_tokens: int
    is_deterministic: bool = False  # prefilled on the deterministic mode's grid (kvshare.engine.grid)
    pool_kv_bytes: int = 0  # bytes of the KV pages loaded from the pool
    pool_state_bytes: int = 0  # a hybrid model: bytes of the state checkpoint loaded from the pool (0: none)


@dataclass
class TokenEvent:
    token_id: int
    logprob: float | None
    top_logprobs: dict[int, float] | None
    finish_reason: str | None  # None until the last event: "stop" | "length"
    provenance: Provenance  # the same object in every event of a request


def cancellable(before_layer: Callable[[int], None], is_cancelled: Callable[[], bool]) -> Callable[[int], None]:
    """``before_layer`` that first gives the request up when ``is_cancelled()``: the prefill's ``finally`` then
    waits for the load's copies and releases its lease, and nothing of the prompt is published."""

    def hook(layer: int) -> None:
        if is_cancelled():
            raise RequestCancelled(f"the request was cancelled before layer {layer} of its prefill")
        before_layer(layer)

    return hook
