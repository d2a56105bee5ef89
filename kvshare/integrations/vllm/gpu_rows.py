"""Rows of the vLLM GPU benchmark (``benchmarks/vllm_gpu.py``): one dict per measurement, built from what its
HTTP client saw and what the servers logged. Pure functions: no vLLM, no sockets, no clock.

Every TTFT row carries ``ROW_FIELDS`` (None where a mode does not measure one); the other modes' rows carry
``model``, ``vllm_version``, ``engine`` and ``mode`` and their own figures.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from kvshare.stats import percentile

ENGINES = ("kvshare", "vllm-offloading", "lmcache-mp")
ROW_FIELDS = (
    "model",
    "prompt_tokens",
    "vllm_version",
    "engine",
    "cold_s",
    "cross_s",
    "local_s",
    "bound_s",
    "cross_over_bound",
    "first_request",
    "tokens_equal",
    "first_divergence",
)
STORE_COST_GOAL = 1.05  # the connector storing may make a cold request at most 5% slower
LOGPROB_ATOL = 1e-6  # logprobs closer than this count as equal (they travel as JSON floats)


@dataclass(frozen=True)
class Completion:
    """One streamed greedy completion as the client saw it."""

    ttft_s: float  # request sent -> first token streamed
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]  # the sampled token's logprob, per step
    tops: tuple[tuple[float, ...], ...]  # the top-k logprobs, descending, per step
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens
    last_token_s: float | None = None  # request sent -> last token streamed

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first (None with fewer than two tokens)."""
        if self.last_token_s is None or len(self.tokens) < 2 or self.last_token_s <= self.ttft_s:
            return None
        return (len(self.tokens) - 1) / (self.last_token_s - self.ttft_s)


def compare(reference: Completion, other: Completion) -> dict:
    """Greedy tokens and logprobs of ``other`` against ``reference`` (the cold run).

    Where the tokens differ: the first step that differs and the reference's top-2 logprob gap there (a gap
    near 0 is a tie that rounding may break either way). ``max_logprob_diff`` covers the steps before it."""
    steps = min(len(reference.tokens), len(other.tokens))
    first = next((i for i in range(steps) if reference.tokens[i] != other.tokens[i]), None)
    if first is None and len(reference.tokens) != len(other.tokens):
        first = steps
    same = first if first is not None else steps
    diffs = [abs(a - b) for a, b in zip(reference.logprobs[:same], other.logprobs[:same])]
    max_diff = max(diffs, default=0.0)
    gap = None
    if first is not None and first < len(reference.tops) and len(reference.tops[first]) > 1:
        gap = reference.tops[first][0] - reference.tops[first][1]
    return {
        "tokens_equal": first is None,
        "first_divergence": first,
        "top2_gap": gap,
        "logprobs_equal": first is None and max_diff <= LOGPROB_ATOL,
        "max_logprob_diff": max_diff,
    }


def bound_seconds(cached_tokens: int | None, kv_bytes_per_token: int, h2d_bytes_per_s: float | None) -> float | None:
    """The copy bound of a hit: its KV bytes over the pinned host->device rate (None off a GPU or without a hit)."""
    if not cached_tokens or not h2d_bytes_per_s:
        return None
    return cached_tokens * kv_bytes_per_token / h2d_bytes_per_s


def ttft_row(
    *,
    model: str,
    prompt_tokens: int,
    vllm_version: str,
    engine: str,
    cold: Completion,
    cross: Completion | None,
    local: Completion | None,
    kv_bytes_per_token: int,
    h2d_bytes_per_s: float | None,
    first_request: bool,
    local_kind: str,
) -> dict:
    """A cold / cross-replica / local-hit row. The bound is that of the cross request's hit (of the local one
    where there is no cross request: vLLM's own offloading reaches only its replica); tokens are those of the
    cross request (else the local one) against the cold run."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    hit = cross if cross is not None else local
    bound = bound_seconds(hit.cached_tokens if hit else None, kv_bytes_per_token, h2d_bytes_per_s)
    row = {
        "model": model,
        "prompt_tokens": prompt_tokens,
        "vllm_version": vllm_version,
        "engine": engine,
        "cold_s": cold.ttft_s,
        "cross_s": cross.ttft_s if cross else None,
        "local_s": local.ttft_s if local else None,
        "bound_s": bound,
        "cross_over_bound": cross.ttft_s / bound if cross and bound else None,
        "first_request": first_request,
        "local_kind": local_kind,
        "cross_cached_tokens": cross.cached_tokens if cross else None,
        "local_cached_tokens": local.cached_tokens if local else None,
    }
    row.update(compare(cold, hit) if hit else {"tokens_equal": None, "first_divergence": None})
    return row


def on_off_row(
    *,
    model: str,
    prompt_tokens: int,
    vllm_version: str,
    off: Completion,
    on: Completion,
    batch_invariant: bool,
    own_hit: Completion | None = None,
    a_cold: Completion | None = None,
) -> dict:
    """Pool ON == OFF on one replica: its greedy tokens and logprobs with the prefix loaded from the pool (``on``)
    against its own cold run with the pool off for the request (``off``).

    vLLM's kernels are not batch-invariant: a suffix computed against a cached prefix is not bitwise the cold
    prefill, whoever supplies the prefix. Two controls separate that from the bytes: ``own_hit`` (the replica's own
    GPU prefix hit of the prompt, pool off) reuses as many tokens as the pool load and computes the same suffix
    with the same kernels, so ``own_hit_*`` says whether the pool's prefix equals the replica's own, bitwise where
    the two replicas' cold runs are (``replicas_cold_*``: A's cold run against B's)."""
    row = {
        "mode": "on-off",
        "model": model,
        "prompt_tokens": prompt_tokens,
        "vllm_version": vllm_version,
        "engine": "kvshare",
        "cold_s": off.ttft_s,
        "cross_s": on.ttft_s,
        "cross_cached_tokens": on.cached_tokens,
        "off_cached_tokens": off.cached_tokens,
        "tokens_compared": len(off.tokens),
        "batch_invariant": batch_invariant,
        **compare(off, on),
    }
    if own_hit is not None:
        row["own_hit_s"], row["own_hit_cached_tokens"] = own_hit.ttft_s, own_hit.cached_tokens
        row["own_hit_same_split"] = own_hit.cached_tokens == on.cached_tokens
        row.update({f"own_hit_{k}": v for k, v in compare(own_hit, on).items()})
    if a_cold is not None:
        row.update({f"replicas_cold_{k}": v for k, v in compare(a_cold, off).items()})
    return row


def store_cost_row(
    *, model: str, prompt_tokens: int, vllm_version: str, storing: list[Completion], plain: list[Completion]
) -> dict:
    """Cold TTFT and decode rate with the connector storing every prompt against plain vLLM (medians); the
    goal is met when neither is more than 5% worse."""
    if not storing or not plain:
        raise ValueError("store cost needs at least one request with the connector and one without")

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    cold_on, cold_off = median(c.ttft_s for c in storing), median(c.ttft_s for c in plain)
    rate_on = median(c.decode_tokens_per_s for c in storing)
    rate_off = median(c.decode_tokens_per_s for c in plain)
    ttft_ratio = cold_on / cold_off
    decode_ratio = rate_off / rate_on if rate_on and rate_off else None  # > 1: slower with the connector
    return {
        "mode": "store-cost",
        "model": model,
        "prompt_tokens": prompt_tokens,
        "vllm_version": vllm_version,
        "engine": "kvshare",
        "cold_s": cold_on,
        "cold_plain_s": cold_off,
        "cold_ratio": ttft_ratio,
        "decode_tokens_per_s": rate_on,
        "decode_plain_tokens_per_s": rate_off,
        "decode_slowdown": decode_ratio,
        "requests": len(storing),
        "goal_met": ttft_ratio <= STORE_COST_GOAL and (decode_ratio is None or decode_ratio <= STORE_COST_GOAL),
    }


def load_row(
    *,
    model: str,
    vllm_version: str,
    pool: str,
    num_sessions: int,
    duration_s: float,
    ttfts_s: list[float],
    num_errors: int,
    num_requests: int,
    cached_tokens: int,
    prompt_tokens: int,
) -> dict:
    """A load run through the router: TTFT percentiles, errors, and the share of prompt tokens not computed."""
    return {
        "mode": "load",
        "model": model,
        "vllm_version": vllm_version,
        "engine": "kvshare",
        "pool": pool,
        "sessions": num_sessions,
        "duration_s": duration_s,
        "requests": num_requests,
        "errors": num_errors,
        "ttft_p50_s": percentile(ttfts_s, 50) if ttfts_s else None,
        "ttft_p99_s": percentile(ttfts_s, 99) if ttfts_s else None,
        "cached_share": cached_tokens / prompt_tokens if prompt_tokens else None,
    }


BENCH_SERVE_KEYS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
)


def bench_serve_row(*, model: str, vllm_version: str, target: str, result: dict, command: list[str]) -> dict:
    """The figures of a ``vllm bench serve --save-result`` JSON file, as vLLM's own client measured them."""
    if "completed" not in result:
        raise ValueError("not a vllm bench serve result: it has no 'completed' count")
    row = {
        "mode": "bench-serve",
        "model": model,
        "vllm_version": vllm_version,
        "engine": "kvshare",
        "target": target,
        "command": " ".join(command),
    }
    row.update({key: result.get(key) for key in BENCH_SERVE_KEYS})
    if row["failed"] is None and "num_prompts" in result:
        row["failed"] = result["num_prompts"] - result["completed"]
    return row


# vLLM's log lines, as `kvshare up` copies them: "replica1| (EngineCore pid=9) INFO 12-05 05:15:58 [f.py:1] ..."
_LOG_LINE = re.compile(r"^(replica\d+)\| .*?\b(?:INFO|WARNING|DEBUG|ERROR) (\d\d-\d\d \d\d:\d\d:\d\d) (.*)$")
_KV_SIZE = re.compile(r"\b(\w+) KV cache size: ([\d,]+) tokens")
_SERVING = re.compile(r"Starting vLLM (?:API )?server on")


def _seconds(stamp: str) -> int:
    """Seconds of a vLLM log stamp "MM-DD HH:MM:SS", counted from the start of the month (the logs carry no year;
    a run that spans the end of a month is not ordered by this)."""
    day, clock = stamp.split(" ")
    h, m, s = (int(x) for x in clock.split(":"))
    return ((int(day.split("-")[1]) * 24 + h) * 60 + m) * 60 + s


def startup_row(*, model: str, vllm_version: str, device: str, log_lines: list[str]) -> dict:
    """When each vLLM replica of ``kvshare up`` started logging and serving, and the KV cache it sized.

    ``started_in_order``: each replica logged its first line no earlier than the one before it began serving
    (the order up keeps for replicas that share a GPU; vLLM's stamps have whole seconds, so equal counts)."""
    first: dict[str, int] = {}
    serving: dict[str, int] = {}
    kv_tokens: dict[str, int] = {}
    kv_device = None
    for line in log_lines:
        match = _LOG_LINE.match(line)
        if match is None:
            continue
        replica, at, text = match.group(1), _seconds(match.group(2)), match.group(3)
        first.setdefault(replica, at)
        if _SERVING.search(text):
            serving.setdefault(replica, at)
        size = _KV_SIZE.search(text)
        if size:
            kv_device = size.group(1)
            kv_tokens.setdefault(replica, int(size.group(2).replace(",", "")))
    names = sorted(first, key=lambda name: int(name[len("replica") :]))
    in_order = all(names[i - 1] in serving and first[names[i]] >= serving[names[i - 1]] for i in range(1, len(names)))
    sizes = [kv_tokens[n] for n in names if n in kv_tokens]
    return {
        "mode": "startup",
        "model": model,
        "vllm_version": vllm_version,
        "engine": "kvshare",
        "device": device,
        "replicas": len(names),
        "started_in_order": in_order if len(names) > 1 else None,
        "kv_cache_device": kv_device,
        "kv_cache_tokens": {n: kv_tokens.get(n) for n in names},
        "kv_cache_tokens_min_over_max": min(sizes) / max(sizes) if len(sizes) == len(names) and sizes else None,
        "serving_after_s": {n: serving[n] - first[names[0]] for n in names if n in serving},
    }


STALL_GOAL = 2.0  # the streams' worst gap while a prefix loads beside them: at most twice their p99 gap without one


def token_gaps(arrivals: list[list[float]], start: float, end: float) -> list[float]:
    """The gaps between consecutive tokens of each stream (``arrivals``: each stream's token times) that overlap
    ``start .. end``: a stream stopped across the whole window shows one gap longer than it."""
    return [b - a for times in arrivals for a, b in zip(times, times[1:]) if b > start and a < end]


def _p99(values: list[float]) -> float | None:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None


def stall_row(
    *,
    model: str,
    prompt_tokens: int,
    vllm_version: str,
    engine: str,
    baseline: tuple[list[list[float]], float, float],
    load: tuple[list[list[float]], float, Completion],
    cold: tuple[list[list[float]], float, Completion] | None,
    local: tuple[list[list[float]], float, Completion] | None = None,
    counters: dict[str, dict[str, float]] | None = None,
) -> dict:
    """Decode streams on one replica while a prefix of ``prompt_tokens`` comes to it: ``baseline`` (their token
    times, the window's start and end) with nothing else, ``load`` (token times, when the request was sent, its
    completion) while it loads the prefix from the shared tier, ``local`` the same prompt again once the replica
    holds it (vLLM's own prefix hit: what receiving and answering the request costs vLLM beside the streams, no
    load), ``cold`` while it computes a prompt nobody holds (vLLM's chunked prefill). The worst gap of each is over
    the request's time to first token. ``counters``: per phase, how the replica's connector counters changed
    during it (load: ``async_loads`` 1 when it ran beside the streams' steps, 0 inside one; local: no
    ``loaded_tokens``, else it was no prefix hit of vLLM's own)."""
    arrivals, start, end = baseline
    p99 = _p99(token_gaps(arrivals, start, end))
    row = {
        "mode": "stall",
        "model": model,
        "prompt_tokens": prompt_tokens,
        "vllm_version": vllm_version,
        "engine": engine,
        "streams": len(arrivals),
        "baseline_p99_gap_s": p99,
        "goal_over_p99": STALL_GOAL,
    }
    for name, phase in (("load", load), ("local", local), ("cold", cold)):
        if phase is None:
            continue
        streams, sent, done = phase
        worst = max(token_gaps(streams, sent, sent + done.ttft_s), default=None)
        row[f"{name}_ttft_s"] = done.ttft_s
        row[f"{name}_cached_tokens"] = done.cached_tokens
        row[f"{name}_worst_gap_s"] = worst
        row[f"{name}_over_p99"] = worst / p99 if worst is not None and p99 else None
        # every stream kept streaming past the request's first token: the window was measured whole
        row[f"{name}_streams_outlasted"] = all(s and s[-1] > sent + done.ttft_s for s in streams)
    for phase, changes in (counters or {}).items():
        row.update({f"{phase}_{name}": value for name, value in changes.items()})
    return row
