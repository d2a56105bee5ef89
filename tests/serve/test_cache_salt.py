"""``cache_salt`` (vLLM's: requests with different salts never share cached KV), on real replicas.

A pool and two built-in replicas behind a cache_aware router (``kvshare up``'s Cluster). The
salt joins the namespace digest beside the tenant salt, so it splits the local prefix cache
and the pool alike: equal salts reuse each other's chunks, different salts never do, and a
request without a salt never reuses a salted chunk (nor the reverse). Every answer's
``kvshare`` provenance and ``usage.prompt_tokens_details.cached_tokens`` say where its KV came from.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from kvshare.router.policy import ReplicaView, RouteFacts, Router, prefix_blocks
from tests.serve.conftest import start_cluster

CHUNK = 256
BODY = "Salted prefixes stay with the tenant that computed them. " * 14  # 798 characters = tokens: 3 full chunks
REUSABLE = 3 * CHUNK


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster("cache_aware")
    yield c
    c.stop()


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def complete(url: str, tag: str, salt: str | None = None, **extra) -> tuple[int, int]:
    """(local_tokens, pool_tokens) of a completion of tag + BODY, checked against usage's cached_tokens."""
    body = {"prompt": f"[{tag}] {BODY}", "max_tokens": 2, "temperature": 0} | extra
    if salt is not None:
        body["cache_salt"] = salt
    status, out = post(url, "/v1/completions", body)
    assert status == 200, out
    return _reuse(out)


def chat(url: str, tag: str, salt: str | None = None) -> tuple[int, int]:
    body = {"messages": [{"role": "user", "content": f"[{tag}] {BODY}"}], "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    status, out = post(url, "/v1/chat/completions", body)
    assert status == 200, out
    return _reuse(out)


def _reuse(out: dict) -> tuple[int, int]:
    p = out["kvshare"]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == p["local_tokens"] + p["pool_tokens"]
    assert p["local_tokens"] + p["pool_tokens"] + p["computed_tokens"] == out["usage"]["prompt_tokens"]
    return p["local_tokens"], p["pool_tokens"]


def test_local_cache_equal_salts_reuse_different_salts_and_no_salt_do_not(cluster):
    r0 = cluster.replica_urls[0]
    assert complete(r0, "local", "tenant-a") == (0, 0)
    assert complete(r0, "local", "tenant-b") == (0, 0)  # before the fix: local_tokens 768 from tenant-a's
    assert complete(r0, "local") == (0, 0)  # no salt never reuses a salted chunk
    assert complete(r0, "local", "tenant-a") == (REUSABLE, 0)  # the control: the same salt reuses
    assert complete(r0, "local") == (REUSABLE, 0)  # and the unsalted request's own chunks are its own
    assert complete(r0, "local-rev") == (0, 0)
    assert complete(r0, "local-rev", "tenant-a") == (0, 0)  # the reverse: a salt never reuses unsalted chunks


def test_pool_equal_salts_reuse_across_replicas_different_salts_and_no_salt_do_not(cluster):
    r0, r1 = cluster.replica_urls
    assert complete(r0, "pool", "tenant-a") == (0, 0)  # computed on replica 0, stored in the pool
    assert complete(r1, "pool", "tenant-b") == (0, 0)  # before the fix: pool_tokens 768
    assert complete(r1, "pool") == (0, 0)
    assert complete(r1, "pool", "tenant-a", kvshare={"use_local_cache": False}) == (0, REUSABLE)  # the control
    assert complete(r0, "pool-rev") == (0, 0)
    assert complete(r1, "pool-rev", "tenant-a") == (0, 0)  # the reverse
    assert complete(r1, "pool-rev", kvshare={"use_local_cache": False}) == (0, REUSABLE)


def test_chat_honours_cache_salt(cluster):
    r0, r1 = cluster.replica_urls
    assert chat(r0, "chat", "tenant-a") == (0, 0)
    assert chat(r1, "chat", "tenant-b") == (0, 0)
    local, pool = chat(r1, "chat", "tenant-a")
    assert local == 0 and pool >= 2 * CHUNK  # the chat template's tokens make the count differ from BODY's
    assert chat(r0, "chat", "tenant-a")[0] >= 2 * CHUNK
    assert chat(r0, "chat") == (0, 0)


def test_the_router_forwards_the_salt(cluster):
    url = cluster.router_url
    assert complete(url, "routed", "tenant-a") == (0, 0)
    # cache_aware: back to the replica that holds it, whose sequence KV still holds all but the last token
    assert complete(url, "routed", "tenant-a") == (len(f"[routed] {BODY}") - 1, 0)
    assert complete(url, "routed", "tenant-b") == (0, 0)  # the salt reached the replica: nothing shared
    assert complete(url, "routed") == (0, 0)


@pytest.mark.parametrize("salt", [7, "", ["a"], None])
def test_a_salt_that_is_not_a_non_empty_string_is_a_400(cluster, salt):
    for url in (cluster.router_url, cluster.replica_urls[0]):
        for path, body in (
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
        ):
            status, out = post(url, path, body | {"cache_salt": salt, "max_tokens": 1})
            if salt is None:  # null is "no salt"
                assert status == 200, out
                continue
            assert status == 400 and out["error"]["param"] == "cache_salt", out
            assert out["error"]["type"] == "invalid_request_error" and out["error"]["message"]


def test_cache_aware_routing_matches_prefixes_of_one_salt_only():
    text = BODY * 2
    unsalted, a, b = prefix_blocks(text), prefix_blocks(text, salt="a"), prefix_blocks(text, salt="b")
    assert len(unsalted) == len(a) == len(b) > 0
    assert not set(unsalted) & set(a) and not set(a) & set(b) and not set(unsalted) & set(b)
    assert prefix_blocks(text, salt="a") == a
    router = Router("cache_aware", 2)
    idle = [ReplicaView(0, True, 0), ReplicaView(1, True, 0)]
    home = router.choose(RouteFacts(prefix_blocks=a), idle, now=0.0)[0]
    assert router.choose(RouteFacts(prefix_blocks=a), idle, now=0.0)[0] == home  # the same salt follows its prefix
    # another salt's request is placed as if nothing were cached (round robin), whichever replica holds a's prefix
    picks = {router.choose(RouteFacts(prefix_blocks=prefix_blocks(text, salt=f"s{i}")), idle, 0.0)[0] for i in range(4)}
    assert picks == {0, 1}
