"""pool_aware's cost model: a request's expected time to first token on each replica, and the ranking (pure).

For a prompt of ``n`` tokens and each replica ``r``::

    T_r = queue wait on r + (pool tokens not on r's GPU) x KV bytes per token / load bandwidth
          + (n - tokens r or the pool holds) / prefill rate

``CostModel`` holds the terms' starting values (the flags); measured ones replace them per replica
(kvshare.router.calibration). ``CostModel(use_pool_term=False)`` (``kvshare route --no-pool-term``) is the GPU-only
variant: the pool's pages are left out of T_r, as a router that sees only the replicas' GPU caches would place.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshare.router.calibration import Rates

NEAR_TIE = 0.05  # T_r within this fraction of the least: a tie, broken in turn


@dataclass(frozen=True)
class CostModel:
    """The starting terms of T_r (measured ones replace them: kvshare.router.calibration); defaults: the Qwen3-8B
    shape (bf16 KV) on an H200 through the service."""

    kv_bytes_per_token: int = 147_456  # 36 layers x (K, V) x 8 heads x 128 x 2 bytes
    load_bytes_per_s: float = 20e9
    prefill_tokens_per_s: float = 20_000.0
    queue_s_per_request: float = 0.5  # a request's time on a replica after its first token (its decode)
    # False: the GPU-only variant (what llm-d's precise prefix scorer does): a replica is credited only with
    # what its own GPU holds; the pool's pages are invisible, so a prefix only the pool holds counts as prefill
    use_pool_term: bool = True

    def __post_init__(self) -> None:
        if min(self.kv_bytes_per_token, self.load_bytes_per_s, self.prefill_tokens_per_s) <= 0:
            raise ValueError("KV bytes per token, load bandwidth and prefill rate must be positive")
        if self.queue_s_per_request < 0:
            raise ValueError("the queue wait per request must be >= 0")

    def prior_rates(self) -> Rates:
        """These terms as per-token seconds: the calibration's starting values."""
        return Rates(
            overhead_s=0.0,
            prefill_s_per_token=1.0 / self.prefill_tokens_per_s,
            load_s_per_token=self.kv_bytes_per_token / self.load_bytes_per_s,
            service_s=self.queue_s_per_request,
            decode_s=self.queue_s_per_request,
        )


def expected_ttft(
    cost: CostModel, num_tokens: int, gpu_tokens: int, pool_tokens: int, num_in_flight: int, rates: Rates | None = None
) -> float:
    """T_r in seconds with the queue as ``num_in_flight`` requests of the mean service time each."""
    r = cost.prior_rates() if rates is None else rates
    return num_in_flight * r.service_s + expected_prefill(cost, num_tokens, gpu_tokens, pool_tokens, r)


def expected_prefill(
    cost: CostModel, num_tokens: int, gpu_tokens: int, pool_tokens: int, rates: Rates | None = None
) -> float:
    """T_r less the queue, in seconds: the load of what only the pool holds, the prefill of what nobody holds;
    by the replica's measured ``rates``, else the cost model's own."""
    r = cost.prior_rates() if rates is None else rates
    if not cost.use_pool_term:
        pool_tokens = 0
    load_tokens = max(0, pool_tokens - gpu_tokens)
    computed = num_tokens - max(gpu_tokens, pool_tokens)
    return r.overhead_s + load_tokens * r.load_s_per_token + computed * r.prefill_s_per_token


def rank(times: list[float], is_available: list[bool], rotation: int, near_tie: float = 0.0) -> list[int]:
    """Replica indices, available ones first, least T_r first; those within ``near_tie`` (a fraction) of the
    least available T_r count as tied; ties in turn from ``rotation``."""
    n = len(times)
    best = min((t for t, ok in zip(times, is_available) if ok), default=min(times, default=0.0))
    tied = [ok and t <= best * (1.0 + near_tie) for t, ok in zip(times, is_available)]

    def key(i: int) -> tuple:  # the tied in turn, then the rest by T_r
        return (not is_available[i], not tied[i], 0.0 if tied[i] else times[i], (i - rotation) % n)

    return sorted(range(n), key=key)
