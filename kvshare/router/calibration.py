"""pool_aware's cost terms measured from the responses the router relays (pure).

For each response the router knows when it sent the request, when the first byte of a stream's body came (a
replica writes a stream's headers at once and its first data chunk with the first token), when the response
ended, and how many prompt tokens the replica computed and how many it loaded from the pool: from the final
chunk's ``kvshare`` object (built-in replicas; a vLLM replica's unstreamed body, in ``kv_transfer_params``),
else from the usage a vLLM stream ends with, split by ``split_cached`` (kvshare.router.placement;
kvshare.router.vllm_usage asks for it where the client did not). kvshare.router.response_timing reads them from
each response as it is relayed. Per replica::

    service start = max(sent, end of the last response that replica finished before this one's first byte)
    prefill_s     = first byte - service start      (exact for a replica that serves one request at a time)
    service_s     = end - service start

A replica that batches (vLLM; ``is_batching``) starts every request's service when it is sent, and its first
byte waits for the prefill of every other request in prefill there: a sample whose prefill overlapped another's
(``BacklogEntry.is_shared``, kvshare.router.backlog) is not fitted. Fitted, such samples made the rates a measure of the
contention: on two vLLM replicas of one H100 (the routing workload at 2 sessions/s) prefill fell to its floor on
three replicas of four and a pool load came out 7-73x slower than the prior's PCIe rate; the requests that ran
alone there (a fifth to a third of them) fit 19-30k computed tokens/s in every condition with the pool on.

A windowed least squares fits ``prefill_s ~ overhead + computed x prefill s/token + pool x load s/token``,
pulled toward the flags' values (the prior) with the weight of a fraction of a sample, so a term the window
cannot tell (no request loaded from the pool yet) stays at its flag's value; samples far from the first fit (a
pause, a request that waited inside a batching engine) are trimmed before the final one. The queue term of T_r
of a request in flight ahead is its expected prefill by these rates plus the replica's decode time: the
exponentially weighted mean of a stream's end - first byte (for a response that is not a stream, its service
less its fitted prefill); kvshare.router.backlog sums them. Requests in flight the backlog does not know count
the mean service time each. Until ``min_samples`` samples the flags' values are used as they are.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, replace

import numpy as np

log = logging.getLogger("kvshare.router.pool_aware")
CHANGE_LOGGED = 1.5  # a term that moved by this factor since it was last logged is logged again


@dataclass(frozen=True)
class Rates:
    """One replica's terms of T_r, in seconds."""

    overhead_s: float  # per request: the hop, parsing, the first decode step
    prefill_s_per_token: float  # per prompt token the replica computes
    load_s_per_token: float  # per prompt token it loads from the pool
    service_s: float  # a request's whole time on the replica (what a request in flight of unknown work costs)
    num_samples: int = 0  # prefill samples in the window behind these values (0: the flags' values)
    decode_s: float = 0.0  # a request's time on the replica after its first token
    num_measured: int = 0  # prefill samples in the window, fitted or not yet (below min_samples)


@dataclass(frozen=True)
class CalibrationConfig:
    window: int = 64  # the newest prefill samples fitted per replica
    min_samples: int = 8  # below this, the flags' values
    prior_samples: float = 0.1  # the flags' values weigh as much as this many samples: they decide only a term
    # the window cannot tell (a column of zeros), never bias one it can
    trim: float = 4.0  # samples whose residual exceeds this many median absolute residuals are dropped
    service_weight: float = 0.2  # exponential weight of the newest service time

    def __post_init__(self) -> None:
        if self.window < self.min_samples or self.min_samples < 3:
            raise ValueError("the calibration window must hold at least min_samples >= 3 samples")
        if self.prior_samples <= 0 or self.trim <= 0 or not 0 < self.service_weight <= 1:
            raise ValueError("prior_samples and trim must be positive, service_weight in (0, 1]")


class ReplicaRates:
    """The fit for one replica: add samples, read ``rates``."""

    def __init__(self, prior: Rates, config: CalibrationConfig = CalibrationConfig()) -> None:
        self.prior = prior
        self.config = config
        self._samples: deque[tuple[int, int, float]] = deque(maxlen=config.window)  # (computed, pool, prefill_s)
        self._fit = prior
        self._service_s = prior.service_s
        self._num_service = 0
        self._decode_s = prior.decode_s
        self._num_decode = 0

    @property
    def rates(self) -> Rates:
        enough = self.config.min_samples
        service_s = self._service_s if self._num_service >= enough else self.prior.service_s
        decode_s = self._decode_s if self._num_decode >= enough else self.prior.decode_s
        return replace(self._fit, service_s=service_s, decode_s=decode_s, num_measured=len(self._samples))

    @property
    def samples(self) -> list[tuple[int, int, float]]:
        """The window: (computed tokens, pool tokens, prefill seconds), oldest first."""
        return list(self._samples)

    def add_prefill(self, computed_tokens: int, pool_tokens: int, prefill_s: float) -> None:
        if prefill_s < 0 or computed_tokens < 0 or pool_tokens < 0:
            return
        self._samples.append((computed_tokens, pool_tokens, prefill_s))
        if len(self._samples) >= self.config.min_samples:
            self._fit = self._refit()

    def add_service(self, service_s: float) -> None:
        if service_s < 0:
            return
        w = self.config.service_weight if self._num_service else 1.0
        self._service_s += w * (service_s - self._service_s)
        self._num_service += 1

    def add_decode(self, decode_s: float) -> None:
        decode_s = max(0.0, decode_s)
        w = self.config.service_weight if self._num_decode else 1.0
        self._decode_s += w * (decode_s - self._decode_s)
        self._num_decode += 1

    def _refit(self) -> Rates:
        data = np.array(self._samples, dtype=np.float64)  # [n, (computed, pool, prefill_s)]
        x = np.column_stack([np.ones(len(data)), data[:, 0], data[:, 1]])  # [n, 3]
        y = data[:, 2]
        p = self.prior
        theta0 = np.array([p.overhead_s, p.prefill_s_per_token, p.load_s_per_token])
        theta = _ridge(x, y, theta0, self.config.prior_samples)
        residual = np.abs(y - x @ theta)
        kept = residual <= self.config.trim * max(float(np.median(residual)), 1e-9)
        if 3 <= kept.sum() < len(y):
            theta = _ridge(x[kept], y[kept], theta0, self.config.prior_samples)
        # a term never falls to 0 (or below) on collinear data: T_r would call that work free
        floor = theta0 * 1e-3
        overhead, prefill, load = (max(float(t), float(f)) for t, f in zip(theta, floor))
        return Rates(overhead, prefill, load, p.service_s, len(y), p.decode_s)


def _ridge(x: np.ndarray, y: np.ndarray, theta0: np.ndarray, prior_samples: float) -> np.ndarray:
    """Least squares pulled toward ``theta0``: each coefficient's prior weighs ``prior_samples`` samples of its
    column's mean square, so a column of zeros leaves its coefficient at the prior."""
    weight = prior_samples * np.maximum((x * x).mean(axis=0), 1e-12)
    a = x.T @ x + np.diag(weight)
    return np.linalg.solve(a, x.T @ y + weight * theta0)


class Calibration:
    """Every replica's fit, and when each replica last finished a response (where the next one's service began)."""

    def __init__(
        self,
        prior: Rates,
        num_replicas: int,
        config: CalibrationConfig = CalibrationConfig(),
        names: list[str] | None = None,
        is_batching: bool = False,
    ) -> None:
        self.is_batching = is_batching
        self.replicas = [ReplicaRates(prior, config) for _ in range(num_replicas)]
        self.names = names or [str(i) for i in range(num_replicas)]
        self._last_end_s = [float("-inf")] * num_replicas
        self._logged = [prior] * num_replicas

    def rates(self, i: int) -> Rates:
        return self.replicas[i].rates

    def observe(
        self,
        i: int,
        sent_s: float,
        first_byte_s: float | None,
        end_s: float,
        computed_tokens: int | None,
        pool_tokens: int | None,
        is_prefill_shared: bool = False,
    ) -> None:
        """One relayed response; ``first_byte_s`` None for one that is not a stream, token counts None where the
        replica withheld its provenance (then only its service time counts); ``is_prefill_shared``: its prefill
        overlapped another's on the replica (not fitted where the replicas batch)."""
        last_end_s = self._last_end_s[i]
        if self.is_batching or (first_byte_s is not None and last_end_s > first_byte_s):
            last_end_s = sent_s  # another response ended during this one's prefill: a batching engine; no wait known
        start_s = max(sent_s, last_end_s)
        fit = self.replicas[i]
        has_counts = computed_tokens is not None and pool_tokens is not None
        if first_byte_s is not None and has_counts and not (self.is_batching and is_prefill_shared):
            fit.add_prefill(computed_tokens, pool_tokens, first_byte_s - start_s)
        if first_byte_s is not None:
            fit.add_decode(end_s - first_byte_s)
        elif has_counts:
            r = fit.rates
            prefill_s = r.overhead_s + computed_tokens * r.prefill_s_per_token + pool_tokens * r.load_s_per_token
            fit.add_decode(end_s - start_s - prefill_s)
        fit.add_service(end_s - start_s)
        self._last_end_s[i] = max(self._last_end_s[i], end_s)
        self._log_if_moved(i)

    def _log_if_moved(self, i: int) -> None:
        now, then = self.rates(i), self._logged[i]
        pairs = (
            (now.prefill_s_per_token, then.prefill_s_per_token),
            (now.load_s_per_token, then.load_s_per_token),
            (now.service_s, then.service_s),
            (now.decode_s, then.decode_s),
        )
        if any(max(a, b) > CHANGE_LOGGED * min(a, b) for a, b in pairs if min(a, b) > 0):
            log.info(
                "pool_aware: replica %s measured prefill %.0f tokens/s, pool load %.0f tokens/s, service %.3f s, "
                "decode %.3f s, overhead %.3f s (%d samples)",
                self.names[i],
                1 / now.prefill_s_per_token,
                1 / now.load_s_per_token,
                now.service_s,
                now.decode_s,
                now.overhead_s,
                now.num_samples,
            )
            self._logged[i] = now
