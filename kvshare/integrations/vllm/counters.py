"""The vLLM connector's counters (summed over steps and sides into vLLM's stats and /metrics, by stats) and the
wall-clock phases of one load, store or step (its debug timing line).

Plain Python (no torch, no vLLM), as the messages beside them (metadata).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, fields

from kvshare.integrations.vllm.metadata import LoadOutcome, LoadSpec

log = logging.getLogger("kvshare.integrations")


@dataclass
class ConnectorCounters:
    """Monotonic counters of one connector side; summed across sides and steps for /metrics."""

    lookups: int = 0  # pool lookups (one per request asked about, reuse of a lease excluded)
    hit_tokens: int = 0  # tokens vLLM was told the pool will supply
    loaded_tokens: int = 0  # tokens copied into vLLM's KV and verified
    async_loads: int = 0  # loads run beside vLLM's steps (the request parked, the others decoding)
    load_bytes: int = 0
    load_seconds: float = 0.0
    stored_chunks: int = 0  # pages committed to the pool
    stored_states: int = 0  # a hybrid model's GDN checkpoints committed to the pool
    loaded_states: int = 0  # a hybrid model's GDN checkpoints copied into vLLM's blocks by loads that completed
    store_bytes: int = 0
    store_seconds: float = 0.0
    skipped_stores: int = 0  # chunks the pool had no room for
    verified_pages: int = 0  # loaded pages whose checksum was checked (all, or the sampled share)
    checksum_failures: int = 0  # pages whose bytes did not match their commit checksum
    load_failures: int = 0  # loads stopped early (checksum, lease lost, pool gone): recomputed
    pool_errors: int = 0  # failed calls to the pool daemon
    expired_leases: int = 0  # leases released because vLLM never scheduled the request
    hints: int = 0  # the router's prefetch hints received with a valid tag (kvshare.router.hints)
    hints_refused: int = 0  # frames on the hint address refused (tag, age, size, form)
    prefetched_pages: int = 0  # pages copied ahead of their load on a hint
    prefetch_hits: int = 0  # pages a load took from a copy ahead instead of the pool
    prefetches_unused: int = 0  # copies ahead dropped after their bound with no load taking them

    def add(self, other: ConnectorCounters | dict) -> None:
        values = other if isinstance(other, dict) else asdict(other)
        for f in fields(self):
            if f.name in values:
                setattr(self, f.name, getattr(self, f.name) + values[f.name])

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def is_zero(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))

    def count_load(
        self, spec: LoadSpec, loaded_end: int, reason: str, times: PhaseTimes, bytes_per_token: int, threads: int
    ) -> LoadOutcome:
        """Count and log a finished load (``loaded_end``: where its trusted tokens end); its outcome."""
        num_loaded = loaded_end - spec.token_start
        self.loaded_tokens += num_loaded
        self.load_bytes += num_loaded * bytes_per_token
        self.load_seconds += times.total
        log.debug("kvshare timing: load %s tokens=%d threads=%d %s", spec.req_id, num_loaded, threads, times.line())
        if loaded_end == spec.token_end:
            if spec.state_page is not None:  # a hybrid's load: whole, its checkpoint with it
                self.loaded_states += 1
            return LoadOutcome(spec.req_id, spec.token_start, spec.token_end, loaded_end)
        self.load_failures += 1
        log.warning(
            "kvshare: load for request %s stopped at token %d of %d..%d: %s; vLLM recomputes the rest",
            spec.req_id,
            loaded_end,
            spec.token_start,
            spec.token_end,
            reason,
        )
        return LoadOutcome(spec.req_id, spec.token_start, spec.token_end, loaded_end, reason)

    def take(self) -> ConnectorCounters:
        """This interval's counts; resets them here."""
        taken = ConnectorCounters(**asdict(self))
        for f in fields(self):
            setattr(self, f.name, f.default)
        return taken


COUNTER_NAMES = tuple(f.name for f in fields(ConnectorCounters))


class PhaseTimes:
    """Wall-clock seconds per named phase of one operation, for the connector's timing log::

    times = PhaseTimes(); ...; times.mark("verify"); ...; times.mark("copy")
    times.line() -> "verify=12.1ms copy=30.2ms total=42.3ms thread_cpu=40.0ms"
    """

    def __init__(self, clock=time.perf_counter, cpu_clock=time.thread_time) -> None:
        self._clock, self._cpu_clock = clock, cpu_clock
        self._started = self._last = clock()
        self._cpu_started = self._cpu_last = cpu_clock()
        self._elsewhere = 0.0  # seconds added for work other threads did (add)
        self.seconds: dict[str, float] = {}

    def mark(self, phase: str) -> None:
        """Charge the time since the previous mark (or the start) to ``phase``."""
        now = self._clock()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last, self._cpu_last = now, self._cpu_clock()

    def add(self, phase: str, seconds: float) -> None:
        """Charge ``seconds`` another thread spent to ``phase`` (and to the total)."""
        self.seconds[phase] = self.seconds.get(phase, 0.0) + seconds
        self._elsewhere += seconds

    @property
    def total(self) -> float:
        return self._last - self._started + self._elsewhere

    @property
    def cpu(self) -> float:
        """CPU seconds of the calling thread up to the last mark: far below ``total`` means it waited
        (for the GIL, for cores other processes held, for OpenMP threads)."""
        return self._cpu_last - self._cpu_started

    def line(self) -> str:
        parts = [f"{name}={seconds * 1e3:.1f}ms" for name, seconds in self.seconds.items()]
        return " ".join(parts + [f"total={self.total * 1e3:.1f}ms", f"thread_cpu={self.cpu * 1e3:.1f}ms"])
