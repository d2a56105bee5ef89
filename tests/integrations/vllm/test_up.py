"""`kvshare up --engine vllm`: the pool, two vLLM replicas with the connector and the router, as a user starts them.

Suite ``vllm`` (run with the vLLM environment's python).
"""

import json
import urllib.request

import psutil
import pytest

from kvshare.launch import Cluster, ClusterConfig, free_port_block
from kvshare.pool.client import PoolClient
from tests.integrations.vllm.servers import vllm_python, vllm_suite_marks

PYTHON = vllm_python()
pytestmark = vllm_suite_marks()


API_KEY = "key-of-one-tenant-0123"


def _complete(url: str, prompt: str, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1, **extra}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def test_up_with_vllm_replicas_shares_the_pool_through_the_router(monkeypatch):
    """With an account key the router and the replicas share, every salt of one API key is charged to one
    account. Fails when the connector reserves with no account: each cache_salt's namespace is its own owner."""
    monkeypatch.setenv("KVSHARE_ACCOUNT_KEY", "account-key-of-this-cluster-0123")  # the children inherit it
    cluster = Cluster(ClusterConfig(engine="vllm", vllm_python=PYTHON, model="tiny", num_replicas=2,
                                    policy="round_robin", port=free_port_block(3), pool_size="1GiB",
                                    ready_timeout_s=400, router_args=("--api-key", API_KEY)))
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
    finally:
        cluster.stop()
    family = [c for c in children if c.is_running()]
    gone, alive = psutil.wait_procs(family, timeout=60)
    assert not alive
