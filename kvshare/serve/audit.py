"""The audit while serving: a sample of requests served with reused KV is recomputed cold and compared.

A checksum proves that the bytes loaded are the bytes committed; it cannot prove
that the bytes committed were right (the study's writer checksummed a staging
buffer it had copied before the kernel filling it ran). Only the model's output
can: with ``--audit-rate R`` a replica offers each finished request that reused
KV (local cache or pool) to the auditor with probability R. When the engine
worker has no request waiting, it runs one pending audit (``run_one``):

    served     the request's first tokens, if it was greedy; otherwise a greedy
               replay with the same reuse options (the reused KV as it is now)
    cold       the same prompt, greedy, pool and local cache off (nothing reused or published)
    compare    kvshare.outputs: identical, or diverged at a near tie (top-2 gap
               below the threshold: tolerated, counted apart) -- anything else is a mismatch.

An engine in the deterministic mode is held to the exact rule: ids *and* logprobs equal at every
step, any difference a mismatch (nothing is tolerated), logged with its step and both runs' tokens
and logprobs. Per step it compares the chosen token's logprob and the top-k values, sorted, with k
the served request's own ``logprobs`` (the cold run asks for at least that many). Where the served
request asked for no logprobs (or sampled), the served ids are checked against the cold ones and a
greedy replay with the request's reuse options supplies the reused run's logprobs.

A mismatch is counted (``kvshare_audit_mismatches_total``), logged with the chunk
keys involved, and every full chunk of the prompt is dropped from the pool and the
local cache: the reused ones (one of them is wrong) and the ones computed on top of
them (they attended to it). The next request with that prefix recomputes. An audit
gives way to requests: when one arrives mid-decode the audit is put back and retried later.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvshare.outputs import DEFAULT_GAP_THRESHOLD, Comparison, compare_tokens, top2_gap

log = logging.getLogger("kvshare.audit")


@dataclass(frozen=True)
class AuditConfig:
    rate: float = 0.0  # share of requests served with reused KV that are audited; 0: off
    num_tokens: int = 8  # generated tokens compared
    gap_threshold: float = DEFAULT_GAP_THRESHOLD  # a divergence at a smaller top-2 gap is tolerated
    max_pending: int = 16  # audits waiting for idle time; more samples are skipped (counted)
    seed: int | None = None  # of the sampling

    def __post_init__(self) -> None:
        if not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"--audit-rate must lie in [0, 1], got {self.rate}")
        if self.num_tokens < 1 or self.max_pending < 1:
            raise ValueError("audit num_tokens and max_pending must be at least 1")
        if self.gap_threshold < 0:
            raise ValueError(f"the audit gap threshold must be >= 0, got {self.gap_threshold}")


@dataclass
class AuditSample:
    prompt_ids: Any  # list[int] or an int64 numpy array
    options: Any  # the request's engine RequestOptions (reuse switches, tenant)
    served_ids: list[int] | None  # the first tokens served, if the request was greedy
    served_events: list | None  # their engine TokenEvents, when they carry logprobs (the exact rule compares them)
    params: Any  # the request's engine SamplingParams: replays keep its logit_bias, penalties and stop tokens
    local_tokens: int
    pool_tokens: int


@dataclass
class AuditCounts:
    checks: int = 0
    mismatches: int = 0
    tolerated: int = 0  # diverged at a near tie
    skipped: int = 0  # sampled but not checked (queue full, or the replay reused nothing)
    interrupted: int = 0  # given way to a request, retried later
    errors: int = 0
    dropped_local: int = 0
    dropped_pool: int = 0


class _GaveWay(Exception):
    """A request arrived while the audit ran; the audit yields the engine."""


class Auditor:
    """Samples finished requests (any thread) and checks them one at a time in the engine worker's idle time."""

    def __init__(self, engine, config: AuditConfig, registry=None, is_busy: Callable[[], bool] = lambda: False) -> None:
        self.engine = engine
        self.config = config
        self.is_busy = is_busy
        self.counts = AuditCounts()
        self.last: Comparison | None = None
        self._rng = random.Random(config.seed)
        self._pending: deque[AuditSample] = deque()
        self._lock = threading.Lock()
        self._metrics = _AuditMetrics(registry) if registry is not None else None

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def offer(self, prompt_ids, params, options, provenance, token_ids, events=None) -> bool:
        """Maybe queue a finished request for audit; True when it was queued. ``events``: the request's
        TokenEvents (their logprobs, where it asked for them, spare the exact rule a replay)."""
        if provenance is None or not token_ids or provenance.local_tokens + provenance.pool_tokens == 0:
            return False
        with self._lock:
            if self._rng.random() >= self.config.rate:
                return False
            if len(self._pending) >= self.config.max_pending:
                self._count("skipped")
                return False
            served = [int(t) for t in token_ids[: self.config.num_tokens]] if params.temperature == 0 else None
            served_events = None
            if served is not None and events and params.logprobs is not None and events[0].logprob is not None:
                served_events = list(events[: len(served)])
            kept = list(prompt_ids) if isinstance(prompt_ids, list) else prompt_ids.copy()  # or a numpy array
            self._pending.append(
                AuditSample(
                    kept, options, served, served_events, params, provenance.local_tokens, provenance.pool_tokens
                )
            )
        self._show_pending()
        return True

    def run_one(self) -> bool:
        """Check one pending sample (engine worker thread, idle). False when none was pending."""
        with self._lock:
            if not self._pending:
                return False
            sample = self._pending.popleft()
        self._show_pending(running=1)
        try:
            self._check(sample)
        except _GaveWay:
            with self._lock:
                self._pending.appendleft(sample)
            self._count("interrupted")
        except Exception:
            log.exception("the audit of a %d-token prompt failed", len(sample.prompt_ids))
            self._count("errors")
        self._show_pending()
        return True

    # -- one check ---------------------------------------------------------------------------------

    def _check(self, sample: AuditSample) -> None:
        from kvshare.engine.engine import RequestOptions

        is_exact = getattr(self.engine, "grid", None) is not None  # the deterministic mode: reuse must be exact
        n = min(self.config.num_tokens, len(sample.served_ids)) if sample.served_ids else self.config.num_tokens
        k = (sample.params.logprobs or 0) if sample.served_events is not None else 2  # top-k the exact rule compares
        # greedy with the request's own logit rules (bias, penalties), which change what greedy picks
        greedy = replace(sample.params, max_tokens=n, temperature=0.0, seed=None, logprobs=max(2, k))
        served = sample.served_ids
        if served is None:  # a sampled request: replay it greedily with the same reuse
            served, served_events = self._replay(sample, greedy)
            if served is None:
                return
        else:
            served_events = sample.served_events
        cold_options = RequestOptions(use_pool=False, use_local_cache=False, tenant=sample.options.tenant)
        cold, events = self._generate(sample.prompt_ids, greedy, cold_options, keep_events=True)
        top = [list((e.top_logprobs or {}).values()) for e in events]
        if not is_exact:
            result = compare_tokens(cold, served[:n], top, self.config.gap_threshold)
        else:
            cold_steps = [_step_logprobs(e, k) for e in events]
            result = compare_tokens(cold, served[:n], cold_steps, is_exact=True)  # the served ids first
            if result.is_identical and served_events is None:  # no served logprobs: a replay's, with the same reuse
                replayed, served_events = self._replay(sample, greedy)
                if replayed is None:
                    return
                served = replayed
            if result.is_identical:
                result = compare_tokens(
                    cold,
                    served[:n],
                    cold_steps,
                    is_exact=True,
                    candidate_top_logprobs=[_step_logprobs(e, k) for e in served_events],
                )
            if result.divergence_step is not None:  # the gap of the cold run's own top values
                step = result.divergence_step
                result = replace(result, gap=top2_gap(top[step]) if step < len(top) else None)
        self.last = result
        self._count("checks")
        if result.is_identical:
            return
        if result.is_tolerated:
            self._count("tolerated")
            log.info("audit: reused KV diverged at a near tie (%s); not a mismatch", result.describe())
            return
        self._mismatch(sample, result)

    def _replay(self, sample: AuditSample, greedy) -> tuple[list[int] | None, list | None]:
        """(ids, events) of a greedy replay with the request's reuse options; (None, None), counted skipped,
        when the replay reused nothing (the KV is gone: nothing left to audit)."""
        ids, events = self._generate(sample.prompt_ids, greedy, sample.options, keep_events=True)
        provenance = events[0].provenance
        if provenance.local_tokens + provenance.pool_tokens == 0:
            self._count("skipped")
            return None, None
        sample.local_tokens, sample.pool_tokens = provenance.local_tokens, provenance.pool_tokens
        return ids, events

    def _mismatch(self, sample: AuditSample, result: Comparison) -> None:
        keys = self.engine.prompt_chunk_keys(sample.prompt_ids, sample.options.tenant)
        c = self.engine.layout.chunk_tokens
        num_local, num_pool = sample.local_tokens // c, sample.pool_tokens // c
        hexes = [k.hex()[:16] for k in keys]
        dropped_local, dropped_pool = self.engine.drop_chunks(keys)
        self._count("mismatches")
        self._count("dropped_local", dropped_local)
        self._count("dropped_pool", dropped_pool)
        log.error(
            "audit MISMATCH: a %d-token prompt served with reused KV differs from its cold recompute (%s). "
            "Reused chunks: local %s, pool %s; computed on top of them: %s. Dropped %d chunks from the local cache "
            "and %d from the pool; the next request with this prefix recomputes.",
            len(sample.prompt_ids),
            result.describe(),
            hexes[:num_local],
            hexes[num_local : num_local + num_pool],
            hexes[num_local + num_pool :],
            dropped_local,
            dropped_pool,
        )

    def _generate(self, prompt_ids, params, options, keep_events: bool = False):
        """(token ids, provenance) or (token ids, events); gives way (raises _GaveWay) when a request waits."""
        events = []
        stream = self.engine.generate(prompt_ids, params, options)
        try:
            for event in stream:
                events.append(event)
                if self.is_busy() and event.finish_reason is None:
                    raise _GaveWay()
        finally:
            stream.close()
        ids = [e.token_id for e in events]
        return (ids, events) if keep_events else (ids, events[0].provenance)

    def _show_pending(self, running: int = 0) -> None:
        if self._metrics is not None:
            self._metrics.pending.set(len(self._pending) + running)

    def _count(self, name: str, n: int = 1) -> None:
        setattr(self.counts, name, getattr(self.counts, name) + n)
        if self._metrics is not None and n:
            self._metrics.inc(name, n)


def _step_logprobs(event, k: int) -> list[float]:
    """What the exact rule compares at one step: the chosen token's logprob, then the top-k values sorted
    (a run asked for more than k reports the same k largest first; sorting makes the order of ties moot)."""
    top = sorted((event.top_logprobs or {}).values(), reverse=True)[:k]
    return [float("nan") if event.logprob is None else float(event.logprob), *map(float, top)]


class _AuditMetrics:
    """Prometheus counters of the audit, on the replica's registry (kvshare_audit_*_total)."""

    HELP = {
        "checks": "Requests with reused KV recomputed cold and compared",
        "mismatches": "Audited requests whose output differed from the cold recompute",
        "tolerated": "Audited requests that diverged only at a near tie (top-2 logprob gap below the threshold)",
        "skipped": "Sampled requests not audited (queue full, or nothing reused on replay)",
        "interrupted": "Audits that gave way to a request and were retried",
        "errors": "Audits that failed with an error",
        "dropped_local": "Chunks dropped from the local cache after a mismatch",
        "dropped_pool": "Chunks dropped from the pool after a mismatch",
    }

    def __init__(self, registry) -> None:
        from prometheus_client import Counter, Gauge

        self._counters = {
            name: Counter(f"kvshare_audit_{name}", text, registry=registry) for name, text in self.HELP.items()
        }
        self.pending = Gauge(
            "kvshare_audit_pending", "Sampled requests waiting to be audited (or being audited)", registry=registry
        )

    def inc(self, name: str, n: int) -> None:
        self._counters[name].inc(n)
