"""The routing workload's figures: one row per replay, then per (rate, condition) over the runs (pure).

A replay's row holds what its records say (TTFT of first and later turns, the tokens each replica computed,
the router's added latency) and what the metrics counted over it (pool bytes loaded, fallbacks, sampled event
lag). Across runs, request-level figures (TTFT and added-latency percentiles) pool the runs' requests and
take a bootstrap interval of the percentile; run-level totals (prefill tokens, pool bytes, output tokens/s)
take a bootstrap interval of their mean over the runs (kvshare.stats).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from statistics import fmean

from kvshare.bench.outputs import tally
from kvshare.bench.records import Record
from kvshare.outputs import EQUAL, OutputCheck
from kvshare.stats import bootstrap_ci, percentile


def router_added_s(r: Record) -> float | None:
    """The client's TTFT minus the replica's own time to writing the first token: the router's hop and placement."""
    written = (r.timeline or {}).get("first_token_written")
    if r.ttft_s is None or written is None:
        return None
    return r.ttft_s - written


def computed_tokens(r: Record) -> int:
    """Prompt tokens the replica computed: its provenance's count, else (a vLLM replica's stream carries none) the
    prompt less what usage calls cached (vLLM's prefix cache hits and what the connector loaded)."""
    if r.computed_tokens is not None:
        return r.computed_tokens
    if r.prompt_tokens is not None and r.cached_tokens is not None:
        return r.prompt_tokens - r.cached_tokens
    return 0


def replay_row(
    key: str,
    rate: float,
    condition: str,
    run: int,
    records: list[Record],
    wall_s: float,
    pool_bytes_loaded: float,
    fallbacks: float | None,
    lag_samples: list[float],
) -> dict:
    """One replay's figures (``records``: its measured and verify requests)."""
    measured = [r for r in records if r.role == "measure"]
    ok = [r for r in measured if r.is_ok]
    verified = [r for r in measured if r.output_check is not None]
    ended = [r.started_at + (r.e2e_s or 0.0) for r in ok]
    span = (max(ended) - min(r.started_at for r in ok)) if ok else 0.0
    output_tokens = sum(r.completion_tokens or 0 for r in ok)
    return {
        "unit": key,
        "rate": rate,
        "condition": condition,
        "run": run,
        "num_requests": len(measured),
        "num_errors": len(measured) - len(ok),
        "wall_s": round(wall_s, 3),
        "ttft_first_s": [r.ttft_s for r in ok if r.turn == 0],
        "ttft_later_s": [r.ttft_s for r in ok if r.turn],
        "router_added_s": [a for a in map(router_added_s, ok) if a is not None],
        "prefill_tokens": sum(map(computed_tokens, ok)),
        "local_tokens": sum(r.local_tokens or 0 for r in ok),
        "pool_tokens": sum(r.pool_tokens or 0 for r in ok),
        "pool_bytes_loaded": pool_bytes_loaded,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / span if span > 0 else 0.0,
        "per_replica": dict(Counter(r.replica for r in ok)),
        "fallbacks": fallbacks,
        "event_lag_s": lag_samples,
        "outputs_compared": len(verified),
        "outputs_equal": sum(r.output_check == EQUAL for r in verified),
        # each verdict (kvshare.outputs.OutputCheck's fields): where an output parted from its recompute, the
        # step and the reference's top-2 gap there, as the other benches' "outputs" cells show them
        "output_checks": [dataclasses.asdict(r.check()) for r in verified],
    }


def _pct_ci(values: Sequence[float], q: float) -> dict | None:
    if not values:
        return None
    ci = bootstrap_ci(values, statistic=lambda v: percentile(v, q), num_resamples=500)
    return {"value": percentile(values, q), "low": ci.low, "high": ci.high, "n": len(values)}


def _mean_ci(values: Sequence[float]) -> dict:
    ci = bootstrap_ci(values, statistic=fmean, num_resamples=500)
    return {"value": fmean(values), "low": ci.low, "high": ci.high, "n": len(values)}


def summarize(rows: list[dict]) -> list[dict]:
    """Per (rate, condition), in the order the rows first name them: the figures over every run."""
    groups: dict[tuple[float, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["rate"], row["condition"]), []).append(row)
    out = []
    for (rate, condition), group in sorted(groups.items(), key=lambda kv: kv[0][0]):
        pooled = {
            name: [v for row in group for v in row[name]]
            for name in ("ttft_first_s", "ttft_later_s", "router_added_s", "event_lag_s")
        }
        fallbacks = [row["fallbacks"] for row in group if row["fallbacks"] is not None]
        send_p99 = [row["router_send_p99_s"] for row in group if row.get("router_send_p99_s") is not None]
        out.append(
            {
                "rate": rate,
                "condition": condition,
                "num_runs": len(group),
                "num_requests": sum(row["num_requests"] for row in group),
                "num_errors": sum(row["num_errors"] for row in group),
                "ttft_first_p50": _pct_ci(pooled["ttft_first_s"], 50),
                "ttft_first_p99": _pct_ci(pooled["ttft_first_s"], 99),
                "ttft_later_p50": _pct_ci(pooled["ttft_later_s"], 50),
                "ttft_later_p99": _pct_ci(pooled["ttft_later_s"], 99),
                "router_added_p99": _pct_ci(pooled["router_added_s"], 99),
                "router_send_p99": _mean_ci(send_p99) if send_p99 else None,  # each run's, by the router's buckets
                "prefill_tokens": _mean_ci([row["prefill_tokens"] for row in group]),
                "pool_bytes_loaded": _mean_ci([row["pool_bytes_loaded"] for row in group]),
                "output_tokens_per_s": _mean_ci([row["output_tokens_per_s"] for row in group]),
                "event_lag_max_s": max(pooled["event_lag_s"]) if pooled["event_lag_s"] else None,
                "fallbacks": sum(fallbacks) if fallbacks else None,
                "outputs": _outputs(group),
            }
        )
    return out


def _outputs(rows: list[dict]) -> str:
    """The rows' output verdicts tallied as kvshare.bench.outputs does ("equal 3/4; near-tie 0; mismatch 1 (step 5,
    gap 0.031)"); rows written before the verdicts were kept say only "equal/compared"."""
    if any("output_checks" not in row for row in rows):
        return f"{sum(r['outputs_equal'] for r in rows)}/{sum(r['outputs_compared'] for r in rows)}"
    return str(tally(OutputCheck(**check) for row in rows for check in row["output_checks"]))


def highest_complete_rate(summary: list[dict]) -> float | None:
    """The highest rate at which every condition finished every request."""
    rates = sorted({s["rate"] for s in summary})
    complete = [r for r in rates if all(s["num_errors"] == 0 for s in summary if s["rate"] == r)]
    return complete[-1] if complete else None


def _fig(f: dict | None, scale: float = 1.0, digits: int = 3) -> str:
    if f is None:
        return "-"
    return f"{f['value'] * scale:.{digits}f} [{f['low'] * scale:.{digits}f}, {f['high'] * scale:.{digits}f}]"


HEADERS = (
    "rate /s",
    "condition",
    "runs",
    "TTFT p50 first",
    "TTFT p99 first",
    "TTFT p50 later",
    "TTFT p99 later",
    "prefill tokens / run",
    "pool MB / run",
    "output tok/s",
    "router added p99 ms",
    "router send p99 ms",
    "event lag max s",
    "fallbacks",
    "errors",
    "outputs vs recompute",
)


def table_rows(summary: list[dict]) -> list[tuple[str, ...]]:
    return [
        (
            f"{s['rate']:g}",
            s["condition"],
            str(s["num_runs"]),
            _fig(s["ttft_first_p50"]),
            _fig(s["ttft_first_p99"]),
            _fig(s["ttft_later_p50"]),
            _fig(s["ttft_later_p99"]),
            _fig(s["prefill_tokens"], digits=0),
            _fig(s["pool_bytes_loaded"], 1e-6, 1),
            _fig(s["output_tokens_per_s"], digits=1),
            _fig(s["router_added_p99"], 1e3, 2),
            _fig(s.get("router_send_p99"), 1e3, 2),
            "-" if s["event_lag_max_s"] is None else f"{s['event_lag_max_s']:.3f}",
            "-" if s["fallbacks"] is None else f"{s['fallbacks']:.0f}",
            str(s["num_errors"]),
            s["outputs"],
        )
        for s in summary
    ]


def markdown(summary: list[dict], meta: dict) -> str:
    """The report: what ran (every invocation's command, the commits, hardware, sizes; kvshare.bench.routing_results'
    folder_meta), then one table of every (rate, condition)."""
    commands = meta.get("commands") or []
    lines = ["# Routing workload", ""]
    if len(commands) == 1:
        lines.append(f"- command: `{commands[0]}`")
    else:
        lines += [f"- commands ({len(commands)} invocations into this folder):"]
        lines += [f"  - `{command}`" for command in commands]
    lines += [
        f"- commit: {', '.join(map(str, meta.get('commits') or [None]))}",
        f"- hardware: {'; '.join(map(str, meta.get('hardware') or [None]))}",
        f"- sizes: {meta.get('sizes')}",
        f"- runs: {meta.get('num_runs')}; figures are value [95% bootstrap interval]: percentiles over every "
        "run's requests, per-run totals as their mean over the runs",
        "",
    ]
    rate = highest_complete_rate(summary)
    lines.append(
        f"Highest rate at which every condition completed every request: "
        f"{'none' if rate is None else f'{rate:g} sessions/s'}."
    )
    lines += ["", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summary)]
    return "\n".join(lines) + "\n"
