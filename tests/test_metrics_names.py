"""Every /metrics endpoint kvshare serves passes ``promtool check metrics``'s lint rules, here in Python.

The rules (prometheus/util/promlint): a HELP and a TYPE for every family; names in snake_case with no
colons; counters end in ``_total`` and nothing else does; no ``_count``/``_sum``/``_bucket`` on a family
that is not a histogram or summary; base units (seconds, bytes), not milli/kilo/... And kvshare's own: one
``kvshare_`` prefix, vLLM's ``model_name`` label on a replica's metrics, latency histograms past 120 s.
"""

import re
import time
import urllib.request

import pytest

from kvshare.pool.spawn import running_pool
from kvshare.router.config import RouterConfig
from kvshare.router.server import RouterServer
from kvshare.serve.audit import AuditConfig
from tests.pool.conftest import free_port
from tests.serve.live import LiveApp, call, replica, tiny_engine

_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_NON_BASE_UNITS = (
    "milliseconds",
    "microseconds",
    "nanoseconds",
    "minutes",
    "hours",
    "days",
    "kilobytes",
    "megabytes",
    "gigabytes",
    "kibibytes",
    "mebibytes",
    "gibibytes",
    "percent",
    "millis",
)


def lint(text: str) -> list[str]:
    """promtool check metrics' complaints about an exposition text (an empty list: it passes)."""
    problems, helps, types = [], {}, {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP ") :].partition(" ")
            helps[name] = help_text
        elif line.startswith("# TYPE "):
            name, _, kind = line[len("# TYPE ") :].partition(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            sample = re.split(r"[{ ]", line, maxsplit=1)[0]
            family = next(
                (
                    f
                    for f in types
                    if sample == f
                    or (
                        sample.startswith(f + "_")
                        and sample[len(f) :] in ("_bucket", "_sum", "_count", "_created", "_total")
                    )
                ),
                None,
            )
            if family is None:
                problems.append(f"{sample}: a sample of no TYPEd family")
            for label in re.findall(r'([A-Za-z_:][A-Za-z0-9_:]*)="', line.partition("{")[2]):
                if not _NAME.fullmatch(label):
                    problems.append(f"{sample}: label {label} is not snake_case")
    for name, kind in types.items():
        if not helps.get(name):
            problems.append(f"{name}: no help text")
        if not _NAME.fullmatch(name):
            problems.append(f"{name}: not a snake_case name without colons")
        if kind == "counter" and not name.endswith("_total"):
            problems.append(f'{name}: counter metrics should have "_total" suffix')
        if kind != "counter" and name.endswith("_total"):
            problems.append(f'{name}: non-counter metrics should not have "_total" suffix')
        if kind not in ("histogram", "summary") and name.endswith(("_count", "_sum", "_bucket")):
            problems.append(f"{name}: a {kind} named like a histogram's series")
        if any(unit in name for unit in _NON_BASE_UNITS):
            problems.append(f"{name}: use base units (seconds, bytes)")
        if not name.startswith("kvshare_"):
            problems.append(f"{name}: not under the kvshare_ prefix")
    return problems


def scrape(url: str) -> str:
    return urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()


def test_the_lint_finds_what_promtool_finds():
    bad = (
        "# HELP kvshare:requests Requests\n# TYPE kvshare:requests counter\nkvshare:requests 1.0\n"
        "# TYPE kvshare_up_total gauge\nkvshare_up_total 1.0\n# HELP vllm_ms Time\n# TYPE vllm_ms counter\n"
        "vllm_ms_total 1.0\n"
    )
    problems = lint(bad)
    assert any("not a snake_case name without colons" in p for p in problems)
    assert any("no help text" in p for p in problems) and any("non-counter" in p for p in problems)
    assert any('"_total" suffix' in p and p.startswith("vllm_ms") for p in problems)
    assert any("kvshare_ prefix" in p for p in problems)


@pytest.fixture(scope="module")
def urls():
    """(replica URL, router URL), each having answered one request (so every labelled series exists)."""
    with replica(tiny_engine(), audit=AuditConfig(rate=1.0)) as replica_url:
        router = RouterServer(RouterConfig(replicas=(replica_url,), health_interval_s=0.2))
        with LiveApp(router.app()) as router_url:
            assert call(router_url, "/v1/completions", {"prompt": "hello", "max_tokens": 2})[0] == 200
            yield replica_url, router_url


def test_replica_and_router_metrics_pass_promtools_rules(urls):
    """Fails with the kvshare: and kvshare_router: names (colons), three schemes, no model_name label."""
    replica_url, router_url = urls
    replica_text, router_text = scrape(replica_url), scrape(router_url)
    assert lint(replica_text) == [] and lint(router_text) == []
    assert 'kvshare_time_to_first_token_seconds_count{model_name="tiny"} 1.0' in replica_text
    assert 'kvshare_request_success_total{finished_reason="length",model_name="tiny"} 1.0' in replica_text
    assert "kvshare_audit_checks_total" in replica_text and "kvshare_router_requests_total{" in router_text


def test_latency_histograms_reach_past_two_minutes(urls):
    """Fails with the router's default buckets, which stopped at 10 s (a 256k cold prefill takes ~47 s)."""
    for url, name in [
        (urls[0], "kvshare_e2e_request_latency_seconds"),
        (urls[1], "kvshare_router_request_latency_seconds"),
    ]:
        bounds = [float(b) for b in re.findall(name + r'_bucket\{[^}]*le="([0-9.e+]+)"', scrape(url))]
        assert max(bounds) >= 120, (name, bounds)


def test_pool_metrics_pass_promtools_rules():
    port = free_port()
    with running_pool("64MiB", ("--extent-size", "16MiB", "--metrics-port", str(port)), quiet=True):
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                text = scrape(url)
                break
            except OSError:  # the pool's metrics server is not up yet
                time.sleep(0.1)
        assert "kvshare_pool_capacity_bytes" in text and lint(text) == []
