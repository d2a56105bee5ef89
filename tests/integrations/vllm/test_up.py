"""`kvshare up --engine vllm`: the pool, two vLLM replicas with the connector and the router, as a user starts them.

Suite ``vllm`` (run with the vLLM environment's python).
"""

import json
import socket
import time
import urllib.request
from types import SimpleNamespace

import psutil

from kvshare.integrations.vllm.gpu_rows import on_off_row
from kvshare.launch import Cluster, ClusterConfig, free_port_block
from kvshare.pool.client import PoolClient
from kvshare.router.hints import encode_hint, make_hint
from tests.benchmarks.loader import load_benchmark
from tests.commands.test_errors import kvshare
from tests.integrations.vllm.servers import metric, vllm_python, vllm_suite_marks, wait_for_metric

PYTHON = vllm_python()
pytestmark = vllm_suite_marks()


API_KEY, OTHER_KEY = "key-of-one-tenant-0123", "key-of-another-tenant-4567"


def _complete(url: str, prompt: str, key: str = API_KEY, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1, **extra}
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_up_with_vllm_replicas_shares_the_pool_through_the_router(monkeypatch):
    """With the account key up writes itself, every salt of one API key is charged to one account, and another
    key's same prompt reuses nothing, in the pool or vLLM's prefix cache. Fails when the connector reserves with
    no account (each cache_salt's namespace is its own owner), or when the router forwards the client's
    cache_salt: the other key's request then reuses the first key's blocks."""
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # /reset_prefix_cache, as benchmarks/vllm_gpu.py runs them
    monkeypatch.delenv("KVSHARE_ACCOUNT_KEY", raising=False)
    cluster = Cluster(
        ClusterConfig(
            engine="vllm",
            vllm_python=PYTHON,
            model="tiny",
            num_replicas=2,
            policy="round_robin",
            port=free_port_block(3),
            pool_size="1GiB",
            ready_timeout_s=400,
            api_keys=(API_KEY, OTHER_KEY),
        )
    )
    cluster.start()
    try:
        children = [psutil.Process(p.pid) for p in cluster.processes.values()]
        prompt = "Sharing a prefix across vLLM replicas. " * 25  # ~1000 byte tokens
        first = _complete(cluster.router_url, prompt)
        second = _complete(cluster.router_url, prompt)  # round robin: the other replica
        a, b = first["kv_transfer_params"]["kvshare"], second["kv_transfer_params"]["kvshare"]
        assert a["replica"] != b["replica"]
        assert a["pool_tokens"] == 0 and b["pool_tokens"] > 0
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= b["pool_tokens"]
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert second["choices"][0]["logprobs"]["token_logprobs"] == first["choices"][0]["logprobs"]["token_logprobs"]
        for salt in ("s1", "s2"):
            _complete(cluster.router_url, prompt, cache_salt=salt)
        with PoolClient(cluster.pool_socket, name="test") as client:
            held = client.list_namespaces()
        assert len(held.namespaces) == 3, held  # no salt, s1, s2
        assert [row.num_bytes for row in held.accounts] == [sum(row.num_bytes for row in held.namespaces)], held
        other = _complete(cluster.router_url, prompt, key=OTHER_KEY)  # both replicas hold the prompt by now
        assert other["kv_transfer_params"]["kvshare"]["pool_tokens"] == 0
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        flush_one_keys_namespace(cluster, a["namespace"])
        prefetch_hints_reach_the_replicas(cluster, b["replica"])
        pool_on_equals_pool_off(*cluster.replica_urls)
    finally:
        cluster.stop()
    family = [c for c in children if c.is_running()]
    gone, alive = psutil.wait_procs(family, timeout=60)
    assert not alive


def prefetch_hints_reach_the_replicas(cluster: Cluster, replica: str) -> None:
    """The second request above was announced to its replica by the router (up wires each replica's hint socket
    and the key). A prompt hinted to a replica ahead of its request is copied ahead there and loaded from the copy,
    with the answer of a cold run; a hint signed with another key is refused. Fails when up leaves the router or
    the connectors without the hint addresses, or when a load takes no copy ahead."""
    index = int(replica.removeprefix("replica"))
    b, a = SimpleNamespace(url=cluster.replica_urls[index]), SimpleNamespace(url=cluster.replica_urls[1 - index])
    assert wait_for_metric(b, "vllm:kvshare_hints_total", 1) >= 1  # the router's, through its connection
    prompt = [40 + (11 * i) % 200 for i in range(1100)]
    cold = _complete(a.url, prompt)  # the other replica computes and stores it
    hits = metric(b, "vllm:kvshare_prefetch_hits_total")
    with open(cluster.account_key_file) as f:
        key = f.read().strip()
    with socket.socket(socket.AF_UNIX) as conn:  # the hint well ahead of its request: the copy is surely done
        conn.connect(cluster.hint_address(index))
        conn.sendall(encode_hint(make_hint("tiny", "", prompt), key))
        time.sleep(1.0)
        conn.sendall(encode_hint(make_hint("tiny", "", list(range(600))), "forged-key-0123456789abcdef"))
    warm = _complete(b.url, prompt)
    assert warm["kv_transfer_params"]["kvshare"]["pool_tokens"] == 1024
    assert warm["choices"][0]["logprobs"]["token_logprobs"] == cold["choices"][0]["logprobs"]["token_logprobs"]
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
    assert wait_for_metric(b, "vllm:kvshare_prefetch_hits_total", hits + 4) >= hits + 4  # every page from the copy
    assert wait_for_metric(b, "vllm:kvshare_hints_refused_total", 1) >= 1


def flush_one_keys_namespace(cluster: Cluster, namespace: str) -> None:
    """``pool-admin flush --replica URL --api-key KEY`` against a vLLM replica drops the namespace of that key's
    unsalted requests (the one their provenance names) and no other. Fails when pool-admin asks only
    /admin/namespace, which vLLM answers 404."""

    def held() -> dict[str, int]:
        with PoolClient(cluster.pool_socket, name="test") as client:
            return {row.namespace.hex(): row.num_entries for row in client.list_namespaces().namespaces}

    before = held()
    done = kvshare(
        "pool-admin",
        "--socket",
        cluster.pool_socket,
        "flush",
        "--replica",
        cluster.replica_urls[0],
        "--api-key",
        API_KEY,
        "--yes",
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["namespace"] == namespace and out["dropped"] == before[namespace] > 0, (out, before)
    assert held() == {digest: n for digest, n in before.items() if digest != namespace}


def pool_on_equals_pool_off(a: str, b: str) -> None:
    """benchmarks/vllm_gpu.py's on-off mode against real vLLM: B's answer with the pool off for the request (its own
    cold run), then, its prefix cache reset, with the prefix loaded from the pool. 1100 tokens: both runs compute
    the last 76 in one step of the same shape, so vLLM CPU gives the same bits. Fails when the request's
    ``use_pool: false`` does not reach the connector (the OFF run then loads from the pool too)."""
    client = load_benchmark("vllm_gpu_client")
    prompt = [30 + (7 * i) % 200 for i in range(1100)]
    client.stream_completion(a, "tiny", prompt, 8, 300)  # A computes it and stores its 4 chunks
    off = client.stream_completion(
        b, "tiny", prompt, 8, 300, extra={"kv_transfer_params": {"kvshare": {"use_pool": False}}}
    )
    client.post(b, "/reset_prefix_cache")
    on = client.stream_completion(b, "tiny", prompt, 8, 300)
    assert off.cached_tokens == 0 and on.cached_tokens == 1024
    row = on_off_row(
        model="tiny", prompt_tokens=len(prompt), vllm_version="0.32", off=off, on=on, batch_invariant=False
    )
    assert row["tokens_equal"] and row["logprobs_equal"], row
