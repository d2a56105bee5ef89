"""Cost-aware promotion: fetch from the store only what arrives sooner than the replicas could recompute it.

Two measured costs, each fitted by least squares to its recent samples::

    recompute  t(n) = a*n + b*n^2    seconds a replica takes to prefill n chunks cold, per namespace
                                     (replicas report each cold prefill: protocol.PrefillReport);
                                     b is attention's share, which grows with the context
    fetch      f(x) = c + x/B        seconds the tier takes to bring x bytes from the store into the
                                     arena (every promotion is timed, start to last commit)

A lookup whose arena holds chunks 0..m-1 asks the store for up to K more. Promoting k of
them leaves the replica the chunks from m+k on, computed over the longer prefix, so::

    prefill with the store      f(k*P) + t(n) - t(m+k)        (P: page bytes)
    prefill without             t(n) - t(m)
    saved                       s(k) = t(m+k) - t(m) - f(k*P),    s(0) = 0

The tier promotes the k in 0..K that saves most, and no chunk that would arrive after
--remote-promote-timeout; k = 0 answers the lookup at once, as a miss. t is convex and f
linear, so s is convex on k >= 1 and its maximum lies at k = 1 or at the largest k:
three candidates, no search. Without a reported rate (no replica of that page size has
reported), or before the store was ever timed, every chunk is asked for, as without this
module. While lookups are skipped, the store's timing goes stale; one lookup in
``REMEASURE_S`` then fetches a batch in the background to time it again.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

NUM_SAMPLES = 32  # newest samples kept per fit
REMEASURE_S = 30.0  # a store timing older than this, while lookups are skipped, is measured again


def fit_nonnegative(rows: list[tuple[float, float]], ys: list[float], fallback: int) -> tuple[float, float]:
    """Least squares y ~ c0*x0 + c1*x1 with c0, c1 >= 0; one basis alone (``fallback`` first) when both cannot be.

    Pure: the normal equations of two unknowns, and the one-unknown fits on their boundary.
    """
    s00 = sum(r[0] * r[0] for r in rows)
    s01 = sum(r[0] * r[1] for r in rows)
    s11 = sum(r[1] * r[1] for r in rows)
    t0 = sum(r[0] * y for r, y in zip(rows, ys))
    t1 = sum(r[1] * y for r, y in zip(rows, ys))
    det = s00 * s11 - s01 * s01
    if det > 1e-12 * max(s00 * s11, 1e-300):
        c0, c1 = (t0 * s11 - t1 * s01) / det, (t1 * s00 - t0 * s01) / det
        if c0 >= 0 and c1 >= 0:
            return c0, c1
    for index in (fallback, 1 - fallback):
        denominator, numerator = (s00, t0) if index == 0 else (s11, t1)
        if denominator > 0 and numerator >= 0:
            c = numerator / denominator
            return (c, 0.0) if index == 0 else (0.0, c)
    return 0.0, 0.0


@dataclass(frozen=True)
class PrefillFit:
    """t(n) = a*n + b*n^2 seconds to prefill n chunks cold."""

    a: float
    b: float

    def seconds(self, num_chunks: int) -> float:
        return self.a * num_chunks + self.b * num_chunks * num_chunks


@dataclass(frozen=True)
class FetchFit:
    """f(x) = latency_s + x / bytes_per_s seconds to promote x bytes."""

    latency_s: float
    bytes_per_s: float

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s if num_bytes else 0.0


def promote_len(
    prefill: PrefillFit, fetch: FetchFit, page_bytes: int, num_local: int, num_missing: int, timeout_s: float
) -> int:
    """How many of the ``num_missing`` chunks after the arena's ``num_local`` to promote (0: none). Pure."""
    in_time = int((timeout_s - fetch.latency_s) * fetch.bytes_per_s // page_bytes) if timeout_s > fetch.latency_s else 0
    largest = max(0, min(num_missing, in_time))

    def saved(k: int) -> float:
        return prefill.seconds(num_local + k) - prefill.seconds(num_local) - fetch.seconds(k * page_bytes)

    best = max({0, min(1, largest), largest}, key=lambda k: (saved(k), k))
    return best if saved(best) > 0 else 0


@dataclass(frozen=True)
class Plan:
    num_promote: int  # chunks to ask the store for, in chain order
    is_costed: bool  # both costs were known: the number is the cost rule's, not "all"
    is_remeasure: bool = False  # nothing is promoted for the lookup, but a batch is timed in the background


class PromotionCosts:
    """What the tier has measured of the store and been told of the replicas; the loop thread's only."""

    def __init__(self) -> None:
        self._prefill: dict[bytes, deque[tuple[int, float]]] = {}  # namespace -> (chunks, seconds)
        self._namespace_of_size: dict[int, bytes] = {}  # page bytes -> the namespace that reported last
        self._fetch: deque[tuple[int, float]] = deque(maxlen=NUM_SAMPLES)  # (bytes, seconds)
        self._fetch_at = 0.0  # when the newest fetch sample was taken
        self._remeasure_at = 0.0
        self.num_prefill_reports = 0

    def report_prefill(self, namespace: bytes, page_bytes: int, num_chunks: int, seconds: float) -> None:
        """A replica prefilled ``num_chunks`` chunks of ``namespace`` cold in ``seconds``."""
        self._prefill.setdefault(namespace, deque(maxlen=NUM_SAMPLES)).append((num_chunks, seconds))
        self._namespace_of_size[page_bytes] = namespace
        self.num_prefill_reports += 1

    def record_fetch(self, num_bytes: int, seconds: float, now: float) -> None:
        """A promotion brought ``num_bytes`` into the arena in ``seconds`` (from its start)."""
        if num_bytes > 0 and seconds > 0:
            self._fetch.append((num_bytes, seconds))
            self._fetch_at = now

    def prefill_fit(self, namespace: bytes | None, page_bytes: int) -> PrefillFit | None:
        """The namespace's fit; for a chain of unknown namespace, that of the page size's last reporter."""
        samples = self._prefill.get(namespace) if namespace is not None else None
        if not samples:
            samples = self._prefill.get(self._namespace_of_size.get(page_bytes, b""))
        if not samples:
            return None
        a, b = fit_nonnegative([(n, n * n) for n, _ in samples], [s for _, s in samples], fallback=0)
        return PrefillFit(a, b) if a > 0 or b > 0 else None

    def fetch_fit(self) -> FetchFit | None:
        if not self._fetch:
            return None
        latency, per_byte = fit_nonnegative([(1.0, x) for x, _ in self._fetch], [s for _, s in self._fetch], fallback=1)
        if per_byte <= 0:  # only latency explained it (samples of one size): the plain rate of the newest
            x, s = self._fetch[-1]
            latency, per_byte = 0.0, s / x
        return FetchFit(latency, 1.0 / per_byte)

    def plan(
        self, namespace: bytes | None, page_bytes: int, num_local: int, num_missing: int, timeout_s: float, now: float
    ) -> Plan:
        """How much of a lookup's missing run to promote."""
        prefill, fetch = self.prefill_fit(namespace, page_bytes), self.fetch_fit()
        if prefill is None or fetch is None:
            return Plan(num_missing, is_costed=False)
        k = promote_len(prefill, fetch, page_bytes, num_local, num_missing, timeout_s)
        if k == 0 and now - max(self._fetch_at, self._remeasure_at) >= REMEASURE_S:
            self._remeasure_at = now
            return Plan(0, is_costed=True, is_remeasure=True)
        return Plan(k, is_costed=True)

    def stats(self) -> dict[str, int]:
        fetch = self.fetch_fit()
        return {
            "prefill_reports": self.num_prefill_reports,
            "prefill_namespaces": len(self._prefill),
            "store_bytes_per_s": int(fetch.bytes_per_s) if fetch else 0,
            "store_latency_us": int(fetch.latency_s * 1e6) if fetch else 0,
        }
