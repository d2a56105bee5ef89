"""Tenant isolation, authentication and administration on one `kvshare up --api-key ... --tenant-header ...` cluster.

Isolation is shown through provenance: a tenant's request with another tenant's prompt reuses nothing
(local_tokens == 0 and pool_tokens == 0) while the owner's own repeat does (the positive control).
The pool socket's owner-only mode and peer-uid check are tested in tests/pool/test_bad_input.py
(test_socket_is_owner_only_and_uid_check); here: `kvshare up`'s socket and directory are private too.
"""

import json
import os
import stat
import subprocess
import sys
import time

import pytest

from kvshare.pool.client import PoolClient
from kvshare.serve.tenancy import key_tenant
from tests.pool.conftest import make_keys
from tests.reliability.conftest import call, completion, health, is_openai_error, pool_is_clean, start

pytestmark = pytest.mark.reliability
KEY_A, KEY_B, ADMIN_KEY = "key-a-0123456789", "key-b-9876543210", "admin-key-0123456789"
A, B = {"Authorization": f"Bearer {KEY_A}"}, {"Authorization": f"Bearer {KEY_B}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PROMPT = "A tenant's confidential preamble, which no one else may reuse or time. " * 12  # ~850 tokens: 3 chunks
PAGE = 2 << 20


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    admin_key_file = tmp_path_factory.mktemp("admin") / "admin.key"
    admin_key_file.write_text(ADMIN_KEY + "\n")
    c = start(
        "round_robin",
        api_keys=(KEY_A, KEY_B),
        tenant_header="X-Tenant-ID",
        router_args=("--admin-key-file", str(admin_key_file)),
    )
    yield c
    c.stop()


def kv(out: dict) -> tuple[int, int]:
    return out["kvshare"]["local_tokens"], out["kvshare"]["pool_tokens"]


def pool_admin(cluster, *args) -> dict | list:
    out = subprocess.run(
        [sys.executable, "-m", "kvshare", "pool-admin", "--socket", cluster.pool_socket, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_router_and_replicas_refuse_requests_without_a_valid_key(cluster):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    for url in (cluster.router_url, *cluster.replica_urls):
        for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"Authorization": KEY_A}):
            status, out = call(url, "/v1/completions", body, headers)
            assert status == 401 and is_openai_error(out), (url, headers, out)
            assert out["error"]["type"] == "authentication_error" and out["error"]["code"] == "invalid_api_key"
        assert call(url, "/v1/models", headers={})[0] == 401
        assert call(url, "/v1/completions", body, A)[0] == 200
        assert health(url)["status"] == "ok"  # health stays open for probes
    status, out = call(cluster.router_url, "/admin/drain", {"replica": cluster.replica_urls[0]})
    assert status == 401 and is_openai_error(out)
    status, out = call(cluster.replica_urls[0], "/admin/namespace")
    assert status == 401 and is_openai_error(out)


def test_up_pool_socket_is_private(cluster):
    assert stat.S_IMODE(os.stat(cluster.pool_socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(cluster.pool_socket)).st_mode) == 0o700


def test_a_tenant_never_reuses_another_tenants_prefix(cluster):
    r0, r1 = cluster.replica_urls
    first = completion(r0, PROMPT, A)[1]
    assert kv(first) == (0, 0)
    assert kv(completion(r1, PROMPT, A)[1])[1] > 0  # positive control: A's own prefix comes from the pool...
    assert kv(completion(r0, PROMPT, A)[1])[0] > 0  # ... and from replica0's local cache
    # B, with A's prompt, on the replica whose local cache holds it and with A's chunks in the pool
    b0 = completion(r0, PROMPT, B)[1]
    assert kv(b0) == (0, 0), b0["kvshare"]
    # B naming A's identity in the tenant header only splits B's own namespace
    spoof = completion(r1, PROMPT, {**B, "X-Tenant-ID": key_tenant(KEY_A)})[1]
    assert kv(spoof) == (0, 0), spoof["kvshare"]
    # the header splits a key's namespace: team2 of key A does not reuse team1's chunks
    t1 = completion(r0, PROMPT + " team", {**A, "X-Tenant-ID": "team1"})[1]
    t2 = completion(r0, PROMPT + " team", {**A, "X-Tenant-ID": "team2"})[1]
    assert kv(t2) == (0, 0) and kv(completion(r1, PROMPT + " team", {**A, "X-Tenant-ID": "team1"})[1])[1] > 0
    # isolation changes where KV comes from, never the answer
    ids = {tuple(o["choices"][0]["token_ids"]) for o in (first, b0, spoof)}
    assert len(ids) == 1 and t1["choices"][0]["token_ids"] == t2["choices"][0]["token_ids"]


def test_flush_one_tenants_namespace_by_name_and_list_namespaces(cluster):
    r0, r1 = cluster.replica_urls
    text = "Flush me by tenant name, not by digest. " * 20
    for team in ("red", "blue"):
        assert completion(r0, text, {**A, "X-Tenant-ID": team})[0] == 200
    digest = {team: call(r0, f"/admin/namespace?tenant={team}", headers=A)[1]["namespace"] for team in ("red", "blue")}
    assert digest["red"] != digest["blue"]
    assert call(r1, "/admin/namespace?tenant=red", headers=A)[1]["namespace"] == digest["red"]  # same on every replica
    assert call(r0, "/admin/namespace?tenant=red", headers=B)[1]["namespace"] != digest["red"]  # B's key: B's space
    listed = {row["namespace"]: row for row in pool_admin(cluster, "namespaces")["namespaces"]}
    assert listed[digest["red"]]["entries"] == 3 and listed[digest["blue"]]["entries"] == 3
    out = pool_admin(cluster, "flush", "--replica", r0, "--tenant", "red", "--api-key", KEY_A, "--yes")
    assert out == {"dropped": 3, "namespace": digest["red"], "model": "tiny", "pool": cluster.pool_socket}
    listed = {row["namespace"]: row for row in pool_admin(cluster, "namespaces")["namespaces"]}
    assert digest["red"] not in listed and listed[digest["blue"]]["entries"] == 3  # blue untouched
    no_local = {"kvshare": {"use_local_cache": False}}
    assert completion(r1, text, {**A, "X-Tenant-ID": "red"}, **no_local)[1]["kvshare"]["pool_tokens"] == 0
    assert completion(r1, text, {**A, "X-Tenant-ID": "blue"}, **no_local)[1]["kvshare"]["pool_tokens"] == 768
    pool_is_clean(cluster.pool_socket)


def test_list_leases_with_their_ages(cluster):
    with PoolClient(cluster.pool_socket, name="lease-holder") as pool:
        keys = make_keys("admin-lease", 2)
        res = pool.reserve(b"admin-namespace!", keys, PAGE)
        pool.commit(res.reservation_id, [0, 0])
        lease = pool.lookup(keys, PAGE)
        time.sleep(0.5)
        rows = [r for r in pool_admin(cluster, "leases") if r["lease_id"] == lease.lease_id]
        assert len(rows) == 1 and rows[0]["client"] == "lease-holder" and rows[0]["pages"] == 2
        assert rows[0]["age_s"] >= 0.5
        pool.release([lease.lease_id], wait=True)
    assert not [r for r in pool_admin(cluster, "leases") if r["lease_id"] == lease.lease_id]


def test_drain_a_replica_from_the_router_and_resume_it(cluster):
    r0 = cluster.replica_urls[0]
    assert call(cluster.router_url, "/admin/drain", {"replica": r0, "drain": True}, A)[0] == 401  # a tenant's key
    status, out = call(cluster.router_url, "/admin/drain", {"replica": r0, "drain": True}, ADMIN)
    assert status == 200 and out["draining"] is True
    assert health(cluster.router_url)["replicas"][0]["draining"] is True
    served = {completion(cluster.router_url, f"drained {i}", A)[1]["kvshare"]["replica"] for i in range(4)}
    assert served == {"replica1"}
    assert call(cluster.router_url, "/admin/drain", {"replica": "http://127.0.0.1:1"}, ADMIN)[0] == 404
    assert call(cluster.router_url, "/admin/drain", {"nothing": 1}, ADMIN)[0] == 400
    assert call(cluster.router_url, "/admin/drain", {"replica": r0, "drain": False}, ADMIN)[0] == 200
    served = {completion(cluster.router_url, f"resumed {i}", A)[1]["kvshare"]["replica"] for i in range(4)}
    assert served == {"replica0", "replica1"}
