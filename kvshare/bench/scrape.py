"""A server's Prometheus ``/metrics`` read over plain HTTP: one metric's value, summed over its labels."""

from __future__ import annotations

import re
import urllib.request


def metric(url: str, name: str) -> float | None:
    """``name`` on ``url``'s /metrics, summed over its labels (None: not there)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", resp.read().decode(), re.M)
    return sum(map(float, found)) if found else None
