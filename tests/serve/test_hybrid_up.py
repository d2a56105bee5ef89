"""`kvshare up` with the Qwen3.5 hybrid: two replicas share a prompt's prefix through the pool (KV pages and the
state checkpoint at their end), and the replica that reads it answers as the one that computed it."""

import json
import urllib.request

from tests.serve.conftest import start_cluster


def _complete(url: str, prompt: str) -> dict:
    body = {"model": "qwen3.5-tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}
    req = urllib.request.Request(
        url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def test_up_shares_a_hybrids_prefix_across_replicas_through_the_pool():
    cluster = start_cluster("round_robin", replicas=2, model="qwen3.5-tiny")
    try:
        assert cluster.pool_socket is not None  # up started its pool
        prompt = "The hybrid keeps a state where attention keeps keys. " * 8  # 432 byte tokens: one whole chunk
        first, second = _complete(cluster.router_url, prompt), _complete(cluster.router_url, prompt)
    finally:
        cluster.stop()
    assert first["kvshare"]["replica"] != second["kvshare"]["replica"]
    assert first["kvshare"]["pool_tokens"] == 0
    assert second["kvshare"]["pool_tokens"] == 256  # the chunk's KV and the state after it, from the pool
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
