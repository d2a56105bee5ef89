"""What a load run measured: counts, rates, latency percentiles, mismatches. Pure bookkeeping."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvshare.outputs import top2_gap
from kvshare.reliability.exchange import Outcome
from kvshare.stats import percentile

MAX_DETAILS = 20  # errors and mismatches described one by one, at most


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first step where two token sequences differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@dataclass
class LoadTally:
    """Running counts of one load run (mutated by the sessions, read at the end)."""

    started_at: float
    num_ok: int = 0
    num_errors: int = 0
    num_rate_limited: int = 0  # 429: the replica's queue was full (counted apart from errors)
    num_checked: int = 0
    num_mismatches: int = 0
    num_reference_errors: int = 0
    num_reference_not_cold: int = 0  # a pool-off reference that still reused KV (the switch did not hold)
    num_conversations: int = 0
    num_bytes: int = 0  # response bytes received (requests and references)
    latencies_s: list[float] = field(default_factory=list)
    ttfts_s: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    reference_latencies_s: list[float] = field(default_factory=list)
    errors_by_kind: Counter = field(default_factory=Counter)
    replicas: Counter = field(default_factory=Counter)
    tokens_by_source: Counter = field(default_factory=Counter)
    details: list[dict] = field(default_factory=list)

    def add(self, out: Outcome) -> None:
        self.num_bytes += out.num_bytes
        if out.status == 429:
            self.num_rate_limited += 1
        elif not out.is_ok:
            self.num_errors += 1
            self.errors_by_kind[_kind(out)] += 1
            self._detail({"error": out.error, "status": out.status})
        else:
            self.num_ok += 1
            self.latencies_s.append(out.e2e_s)
            if out.ttft_s is not None:
                self.ttfts_s.append(out.ttft_s)
            if out.prompt_tokens is not None:
                self.prompt_tokens.append(out.prompt_tokens)
            self.replicas[out.replica or "?"] += 1
            for source in ("local_tokens", "pool_tokens", "computed_tokens"):
                self.tokens_by_source[source] += (out.provenance or {}).get(source, 0)

    def add_check(self, out: Outcome, ref: Outcome, what: str) -> None:
        """Compare a served answer with its pool-off reference (both complete)."""
        self.num_bytes += ref.num_bytes
        self.reference_latencies_s.append(ref.e2e_s)
        if not ref.is_ok:
            self.num_reference_errors += 1
            self.errors_by_kind["reference: " + _kind(ref)] += 1
            self._detail({"reference_error": ref.error, "status": ref.status})
            return
        self.num_checked += 1
        prov = ref.provenance or {}
        if prov.get("pool_tokens", 0) or prov.get("local_tokens", 0):
            self.num_reference_not_cold += 1
            self._detail({"reference_not_cold": prov})
        step = first_difference(out.token_ids or [], ref.token_ids or [])
        if step is not None:
            self.num_mismatches += 1
            # a step's top logprobs: {token: logprob}
            gap = top2_gap(ref.top_logprobs[step].values()) if step < len(ref.top_logprobs) else None
            self._detail(
                {
                    "mismatch": what,
                    "step": step,
                    "served": (out.token_ids or [])[step : step + 4],
                    "reference": (ref.token_ids or [])[step : step + 4],
                    "reference_top2_gap": gap,
                    "provenance": out.provenance,
                    "prompt_tokens": out.prompt_tokens,
                }
            )

    def _detail(self, item: dict) -> None:
        if len(self.details) < MAX_DETAILS:
            self.details.append(item)

    def summary(self, elapsed_s: float, config: dict, unfinished: int) -> dict:
        """The report: JSON-ready."""
        done = self.num_ok + self.num_errors + self.num_rate_limited
        return {
            "config": config,
            "elapsed_s": round(elapsed_s, 3),
            "requests": done,
            "ok": self.num_ok,
            "errors": self.num_errors + self.num_reference_errors,
            "rate_limited": self.num_rate_limited,
            "unfinished": unfinished,
            "checked": self.num_checked,
            "mismatches": self.num_mismatches,
            "references_not_cold": self.num_reference_not_cold,
            "conversations": self.num_conversations,
            "requests_per_s": round(self.num_ok / elapsed_s, 3) if elapsed_s > 0 else 0.0,
            "requests_per_s_with_references": round((self.num_ok + self.num_checked) / elapsed_s, 3)
            if elapsed_s > 0
            else 0.0,
            "latency_s": distribution(self.latencies_s),
            "ttft_s": distribution(self.ttfts_s),
            "reference_latency_s": distribution(self.reference_latencies_s),
            "prompt_tokens": distribution([float(n) for n in self.prompt_tokens], digits=0),
            "tokens_by_source": dict(self.tokens_by_source),
            "replicas": dict(self.replicas),
            "errors_by_kind": dict(self.errors_by_kind),
            "details": self.details,
        }


def distribution(values: list[float], digits: int = 3) -> dict:
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": round(sum(values) / len(values), digits),
        **{f"p{q}": round(percentile(values, q), digits) for q in (50, 95, 99)},
        "max": round(max(values), digits),
    }


def _kind(out: Outcome) -> str:
    if out.status:
        return f"HTTP {out.status}"
    return (out.error or "unknown").split(":")[0]


def render(summary: dict) -> str:
    """A few lines for a terminal."""
    lat, ttft = summary["latency_s"], summary["ttft_s"]
    lines = [
        f"{summary['requests']} requests in {summary['elapsed_s']:.0f} s: {summary['ok']} ok, "
        f"{summary['errors']} errors, {summary['rate_limited']} rate-limited (429), {summary['unfinished']} unfinished",
        f"checked against pool-off references: {summary['checked']}, mismatches: {summary['mismatches']}",
        f"throughput: {summary['requests_per_s']} requests/s "
        f"({summary['requests_per_s_with_references']} with references)",
    ]
    if lat.get("n"):
        lines.append(f"latency s: p50 {lat['p50']}  p95 {lat['p95']}  p99 {lat['p99']}  max {lat['max']}")
    if ttft.get("n"):
        lines.append(f"time to first token s: p50 {ttft['p50']}  p95 {ttft['p95']}  p99 {ttft['p99']}")
    lines.append(f"prompt tokens by source: {summary['tokens_by_source']}; replicas: {summary['replicas']}")
    if summary["errors_by_kind"]:
        lines.append(f"errors: {summary['errors_by_kind']}")
    for item in summary["details"][:5]:
        lines.append(f"  {item}")
    if "pool" in summary:
        lines.append(f"pool after the run: {summary['pool']}")
    return "\n".join(lines)
