"""From records to the experiments' tables (pure: lists of records in, rows of numbers out).

Only successful requests (no error, a first content token) enter the statistics; the
tables count the others as failures. Times are client-side seconds.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from kvshare.bench.outputs import OutputTally, tally
from kvshare.bench.records import Record
from kvshare.stats import Interval, Summary, improvement, median, pair_blocks, paired_ratios, summarize

# The study's published medians (docs/bench.md): cross-replica TTFT, seconds, OFF -> ON
STUDY_BLOCKS = {128_000: (31.715, 0.605), 256_000: (92.047, 0.790)}
STUDY_BLOCKS_REQUESTS = 768
# six-turn sessions with alternating placement, fraction of session time saved by the pool
STUDY_SESSIONS = {32_000: 0.35, 128_000: 0.45}


def outputs_of(records: Iterable[Record]) -> OutputTally:
    """The output checks of the compared records (older records: equal, or parted with the gap unknown)."""
    return tally(r.check() for r in records)


def divergences(records: Iterable[Record]) -> list[Record]:
    """Compared records whose output parted from their reference's, in experiment and context order."""
    parted = [r for r in records if (c := r.check()) is not None and not c.is_equal]
    order = {"ttft": 0, "blocks": 1, "sessions": 2}
    return sorted(parted, key=lambda r: (order.get(r.experiment, 3), r.context_tokens))


def _ok(records: Iterable[Record], **match) -> list[Record]:
    return [r for r in records if r.is_ok and all(getattr(r, k) == v for k, v in match.items())]


def _by_context(records: list[Record], experiment: str) -> dict[int, list[Record]]:
    groups: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        if r.experiment == experiment:
            groups[r.context_tokens].append(r)
    return dict(sorted(groups.items()))


@dataclass(frozen=True)
class TTFTRow:
    context: int
    medians: dict[str, float | None]  # condition -> median TTFT
    counts: dict[str, int]
    cross_pool_tokens: int | None  # median pool tokens of the cross requests
    num_failed: int
    outputs: OutputTally
    client: str = "token_ids"  # token_ids | text (kvshare.bench.ttft)
    text_overheads: dict[str, float | None] | None = None  # text rows: condition -> median text_overhead

    @property
    def cross_speedup(self) -> float | None:
        cold, cross = self.medians.get("cold"), self.medians.get("cross")
        return cold / cross if cold and cross else None


def ttft_rows(records: list[Record]) -> list[TTFTRow]:
    """One row per context length and client (records without a client sent token ids)."""
    rows = []
    for context, by_context in _by_context(records, "ttft").items():
        clients: dict[str, list[Record]] = defaultdict(list)
        for r in by_context:
            clients[r.client or "token_ids"].append(r)
        for client, group in sorted(clients.items(), key=lambda item: item[0] != "token_ids"):
            medians, counts, overheads = {}, {}, {}
            for condition in ("cold", "local", "cross"):
                done = _ok(group, condition=condition)
                medians[condition] = median([r.ttft_s for r in done]) if done else None
                counts[condition] = len(done)
                paired = [r.text_overhead for r in done if r.text_overhead is not None]
                overheads[condition] = median(paired) if paired else None
            pool = [r.pool_tokens for r in _ok(group, condition="cross") if r.pool_tokens is not None]
            rows.append(
                TTFTRow(
                    context,
                    medians,
                    counts,
                    int(median(pool)) if pool else None,
                    sum(not r.is_ok for r in group),
                    outputs_of(group),
                    client,
                    overheads if client == "text" else None,
                )
            )
    return rows


@dataclass(frozen=True)
class BlocksRow:
    context: int
    off: Summary | None
    on: Summary | None
    ratio: Summary | None  # paired ON/OFF ratios
    num_pairs: int
    min_on_pool_tokens: int | None  # smallest pool_tokens among measured ON requests
    num_failed: int
    outputs: OutputTally

    @property
    def speedup(self) -> float | None:
        return self.off.median / self.on.median if self.off and self.on and self.on.median > 0 else None


def blocks_rows(records: list[Record]) -> list[BlocksRow]:
    rows = []
    for context, group in _by_context(records, "blocks").items():
        measured = _ok(group, role="measure")
        by_block: dict[int, tuple[str, dict[int, float]]] = {}
        for r in measured:
            by_block.setdefault(r.block, (r.condition, {}))[1][r.position] = r.ttft_s
        design = []
        for block in sorted(by_block):
            condition, times = by_block[block]
            design.append((condition, [times.get(i) for i in range(max(times) + 1)]))
        pairs = [(off, on) for off, on in pair_blocks(design) if off is not None and on is not None]
        off = [t for c, ts in design if c == "off" for t in ts if t is not None]
        on = [t for c, ts in design if c == "on" for t in ts if t is not None]
        pool = [r.pool_tokens for r in measured if r.condition == "on" and r.pool_tokens is not None]
        rows.append(
            BlocksRow(
                context,
                summarize(off) if off else None,
                summarize(on) if on else None,
                summarize(paired_ratios(pairs)) if pairs else None,
                len(pairs),
                min(pool) if pool else None,
                sum(not r.is_ok for r in group),
                outputs_of(group),
            )
        )
    return rows


@dataclass(frozen=True)
class SessionsRow:
    context: int
    placement: str
    session_s: dict[str, float | None]  # pool off|on -> median total session time (sum of the turns' e2e)
    num_sessions: dict[str, int]
    turn_ttft: dict[str, list[float | None]]  # pool off|on -> median TTFT per turn
    num_failed: int
    outputs: OutputTally

    @property
    def improvement(self) -> float | None:
        off, on = self.session_s.get("off"), self.session_s.get("on")
        return improvement(off, on) if off and on is not None else None


def sessions_rows(records: list[Record]) -> list[SessionsRow]:
    rows = []
    for context, group in _by_context(records, "sessions").items():
        for placement in sorted({r.placement for r in group}):
            mine = [r for r in group if r.placement == placement]
            session_s, num_sessions, turn_ttft = {}, {}, {}
            for pool in ("off", "on"):
                turns = [r for r in mine if r.condition == f"{placement}/{pool}" and r.role == "measure"]
                sessions: dict[int, list[Record]] = defaultdict(list)
                for r in turns:
                    sessions[r.session].append(r)
                complete = [s for s in sessions.values() if all(r.is_ok for r in s)]  # a failed turn voids its session
                totals = [sum(r.e2e_s for r in s) for s in complete]
                session_s[pool] = median(totals) if totals else None
                num_sessions[pool] = len(totals)
                num_turns = max((r.turn for r in turns), default=-1) + 1
                per_turn = []
                for t in range(num_turns):
                    times = [r.ttft_s for r in _ok(turns, turn=t)]
                    per_turn.append(median(times) if times else None)
                turn_ttft[pool] = per_turn
            rows.append(
                SessionsRow(
                    context,
                    placement,
                    session_s,
                    num_sessions,
                    turn_ttft,
                    sum(not r.is_ok for r in mine),
                    outputs_of(mine),
                )
            )
    return rows


def nearest(context: int, known: dict[int, object], tolerance: float = 0.05) -> int | None:
    """The key of ``known`` within ``tolerance`` (relative) of ``context`` (128k = 128000 or 131072)."""
    for key in known:
        if abs(context - key) <= tolerance * key:
            return key
    return None


def format_ci(ci: Interval | None) -> str:
    return f"[{ci.low:.3f}, {ci.high:.3f}]" if ci is not None else "n/a"
