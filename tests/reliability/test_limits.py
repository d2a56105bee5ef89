"""Every limit answers with a clear 4xx (an OpenAI error body) or a pool error, and the process keeps serving.

One `kvshare up` cluster (one replica behind the router) with small limits: prompt tokens, max_tokens,
body size, concurrent requests (429), the pool's message size and a per-namespace pool quota, with
tenants named by a header (no API keys: the gateway-set header mode).
"""

import concurrent.futures
import json
import subprocess
import sys

import pytest

from kvshare.pool.client import PoolClient, PoolRequestError
from tests.pool.conftest import make_keys
from tests.reliability.conftest import call, completion, is_openai_error, pool_is_clean, report, start

pytestmark = pytest.mark.reliability
PAGE = 2 << 20


@pytest.fixture(scope="module")
def cluster():
    c = start(
        "round_robin",
        replicas=1,
        tenant_header="X-Tenant-ID",
        pool_args=("--namespace-quota", "8MiB", "--max-message-bytes", "64KiB"),
        replica_args=(
            "--max-prompt-tokens",
            "1024",
            "--max-tokens-limit",
            "16",
            "--max-body-size",
            "64KiB",
            "--max-requests",
            "2",
        ),
    )
    yield c
    c.stop()


def still_serves(url: str) -> None:
    status, out = completion(url, "still here?", max_tokens=2)
    assert status == 200 and out["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "path, body, status, param, code",
    [
        ("/v1/completions", {"prompt": "x" * 1025}, 400, "prompt", "context_length_exceeded"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x" * 1100}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": 17}, 400, "max_tokens", None),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 17},
            400,
            "max_completion_tokens",  # the field the request used
            None,
        ),
        ("/v1/completions", {"prompt": "x" * (70 << 10)}, 413, None, "body_too_large"),
    ],
)
def test_request_limits_answer_4xx_with_an_error_body(cluster, path, body, status, param, code):
    url = cluster.replica_urls[0]
    for target in (url, cluster.router_url):  # the router passes the replica's answer on unchanged
        got, out = call(target, path, {"model": "tiny", **body})
        assert got == status and is_openai_error(out), out
        assert out["error"]["param"] == param and out["error"]["code"] == code
    still_serves(url)


def test_a_request_without_max_tokens_gets_the_limit_not_an_error(cluster):
    status, out = call(
        cluster.router_url,
        "/v1/chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True},
    )
    assert status == 200 and out["usage"]["completion_tokens"] == 16


def test_router_body_limit_is_an_openai_error_too(cluster):
    got, out = call(cluster.router_url, "/v1/completions", raw=b'{"prompt": "' + b"x" * (17 << 20) + b'"}')
    assert got == 413 and is_openai_error(out) and out["error"]["code"] == "body_too_large"
    got, out = call(cluster.router_url, "/v1/nothing", {"model": "tiny"})
    assert got == 404 and is_openai_error(out)


def test_concurrent_requests_over_the_limit_get_429(cluster):
    url = cluster.replica_urls[0]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda i: completion(url, f"{i} " + "busy " * 200, max_tokens=16), range(8)))
    statuses = [status for status, _ in results]
    assert statuses.count(429) >= 1 and set(statuses) == {200, 429}, statuses
    report("429", ok=statuses.count(200), rate_limited=statuses.count(429))
    for status, out in results:
        if status == 429:
            assert is_openai_error(out) and out["error"]["type"] == "rate_limit_error"
    still_serves(url)


def test_pool_message_size_limit_closes_only_the_offender(cluster):
    with PoolClient(cluster.pool_socket, name="big-talker") as pool:
        assert pool.lookup(make_keys("fits", 3000), PAGE).num_pages == 0  # ~54 KB: under 64 KiB
        with pytest.raises(PoolRequestError) as err:
            pool.lookup(make_keys("too-big", 4000), PAGE)  # ~72 KB
        assert err.value.code == "protocol" and "exceeds the limit" in str(err.value)
    stats = pool_is_clean(cluster.pool_socket)
    assert stats["protocol_errors"] >= 1
    still_serves(cluster.replica_urls[0])


def test_namespace_quota_bounds_one_tenant_and_never_touches_another(cluster):
    url = cluster.replica_urls[0]
    calm, flood = {"X-Tenant-ID": "calm"}, {"X-Tenant-ID": "flood"}
    calm_text = "The calm tenant's prompt. " * 31  # ~800 tokens: 3 chunks = 6 MiB, under the 8 MiB quota
    assert completion(url, calm_text, calm)[0] == 200
    # the header salts the namespace: flood, with calm's prompt, reuses nothing (and stores its own 3 chunks)
    assert completion(url, calm_text, flood)[1]["kvshare"] == {
        "replica": "replica0",
        "local_tokens": 0,
        "pool_tokens": 0,
        "computed_tokens": 806,
        "deterministic": False,
        "pool_kv_bytes": 0,
    }
    for i in range(5):  # 15 more chunks of flood's: far over its quota
        status, out = completion(url, f"flood {i} " + "more and more " * 60, flood)
        assert status == 200, out
    calm_ns = call(url, "/admin/namespace?tenant=calm")[1]["namespace"]
    flood_ns = call(url, "/admin/namespace?tenant=flood")[1]["namespace"]
    listing = subprocess.run(
        [sys.executable, "-m", "kvshare", "pool-admin", "--socket", cluster.pool_socket, "namespaces"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    rows = {row["namespace"]: row for row in json.loads(listing)["namespaces"]}
    assert json.loads(listing)["quota_bytes"] == 8 << 20
    assert rows[flood_ns]["bytes"] <= 8 << 20 and rows[calm_ns]["entries"] == 3
    stats = pool_is_clean(cluster.pool_socket)
    assert stats["quota_evictions"] > 0 and stats["evictions"] == 0  # the quota, not global pressure, evicted
    out = completion(url, calm_text, calm, kvshare={"use_local_cache": False})[1]
    assert out["kvshare"]["pool_tokens"] == 768  # calm's chunks are all still in the pool
    report(
        "namespace quota",
        flood_bytes=rows[flood_ns]["bytes"],
        calm_entries=rows[calm_ns]["entries"],
        quota_evictions=stats["quota_evictions"],
        quota_skipped_pages=stats["quota_skipped_pages"],
    )
