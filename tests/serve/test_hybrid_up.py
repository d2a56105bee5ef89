"""`kvshare up` with the Qwen3.5 hybrid: the pool starts, the replica serves without it (a hybrid's GDN state is
not in pool pages yet) and reuses a prompt locally."""

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


def test_up_serves_a_hybrid_beside_a_pool_it_does_not_use():
    cluster = start_cluster("round_robin", replicas=1, model="qwen3.5-tiny")
    try:
        assert cluster.pool_socket is not None  # up started its pool
        prompt = "The hybrid keeps a state where attention keeps keys. " * 8
        first, again = _complete(cluster.router_url, prompt), _complete(cluster.router_url, prompt)
    finally:
        cluster.stop()
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    assert first["kvshare"]["pool_tokens"] == again["kvshare"]["pool_tokens"] == 0
    assert again["kvshare"]["computed_tokens"] == 1  # the same prompt: its last token alone, from the state before it
