"""The connector's ``kvshare timing:`` debug lines (``bench --timings``), parsed and summarised (pure)."""

from __future__ import annotations

import re
import statistics

_TIMING = re.compile(r"kvshare timing: (\w+) (\S+) (.*)$")


def parse_timings(log_text: str) -> list[dict]:
    """The connector's ``kvshare timing:`` debug lines as {"what", "req", field: value} (ms fields in seconds)."""
    records = []
    for line in log_text.splitlines():
        match = _TIMING.search(line)
        if match is None:
            continue
        record: dict = {"what": match.group(1), "req": match.group(2)}
        for pair in match.group(3).split():
            name, _, value = pair.partition("=")
            record[name] = float(value[:-2]) / 1e3 if value.endswith("ms") else int(value)
        records.append(record)
    return records


def timing_report(timings: dict[str, list[dict]]) -> list[str]:
    """Median ms of every phase, per server, kind of record and size (tokens, chunks or step shape)."""
    lines = ["", "| server | what | size | count | median phases (ms) |", "| --- | --- | --- | ---: | --- |"]
    for server, records in sorted(timings.items()):
        groups: dict[tuple, list[dict]] = {}
        for r in records:
            size = {
                "load": f"tokens={r.get('tokens')}",
                "store": f"chunks={r.get('chunks')}",
                "match": f"chunks={r.get('chunks')} hit={r.get('hit')}",
                "step": f"loads={r.get('loads')} stores={r.get('stores')}"
                + (f" tokens={r['tokens']}" if "tokens" in r else ""),
            }.get(r["what"], "")
            groups.setdefault((r["what"], size), []).append(r)
        for (what, size), group in sorted(groups.items()):
            phases = [k for k, v in group[0].items() if isinstance(v, float)]
            text = " ".join(f"{k} {statistics.median(g[k] for g in group) * 1e3:.1f}" for k in phases)
            lines.append(f"| {server} | {what} | {size} | {len(group)} | {text} |")
    return lines
