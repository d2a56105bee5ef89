"""`kvshare up --policy pool_aware --kv-events ...` on CPU with the tiny preset: the pool's events reach the
router, which indexes the stored prompt and places on it."""

import argparse
import json
import re
import time
import urllib.request

import pytest

from kvshare.commands import up
from kvshare.launch import Cluster, ClusterConfig, free_port_block

pytest.importorskip("zmq")


def up_args(*argv):
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser.parse_args(list(argv))


def post(url, body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.load(resp)


def metric(router_url, name):
    with urllib.request.urlopen(router_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(found.group(1)) if found else None


def test_up_flags_give_the_pool_a_topic_per_replica_and_the_router_the_local_endpoints():
    pool, router = up.kv_events_args(
        up_args("--policy", "pool_aware", "--kv-events", "tcp://*:5557", "--kv-events-replay", "tcp://*:5558")
    )
    assert pool == (
        "--kv-events",
        "tcp://*:5557",
        "--kv-events-replay",
        "tcp://*:5558",
        "--kv-events-topic",
        "kv@replica0@tiny",
        "--kv-events-topic",
        "kv@replica1@tiny",
    )
    assert router == (
        "--kv-events",
        "tcp://127.0.0.1:5557",
        "--kv-events-topic",
        "kv@replica0@tiny",
        "--model",
        "tiny",
        "--kv-events-replay",
        "tcp://127.0.0.1:5558",
    )
    _, router = up.kv_events_args(
        up_args("--policy", "pool_aware", "--kv-events", "ipc:///tmp/ev", "--replica-kv-events-port", "5600")
    )
    assert router[-4:] == ("--replica-kv-events", "tcp://127.0.0.1:5600", "--replica-kv-events", "tcp://127.0.0.1:5601")
    with pytest.raises(ValueError, match="pool_aware"):
        up.kv_events_args(up_args("--policy", "pool_aware"))
    with pytest.raises(ValueError, match=r"tcp://\*:PORT"):
        up.kv_events_args(up_args("--kv-events", "tcp://10.0.0.1:5557"))


@pytest.mark.timeout(300)
def test_the_router_indexes_what_the_pool_commits_and_places_a_repeat_where_it_is_held(tmp_path):
    """The first request is placed round robin (no event yet); its commit's batch reaches the router past the
    gap (replay). Fails when the engine sends no token ids with its reserves (the index stays at 0 chunks), and
    when a request placed during the fallback is not remembered (the repeat went to the other replica)."""
    args = up_args(
        "--policy", "pool_aware", "--kv-events", f"ipc://{tmp_path}/ev", "--kv-events-replay", f"ipc://{tmp_path}/rep"
    )
    pool_events, router_events = up.kv_events_args(args)
    cfg = ClusterConfig(
        num_replicas=2,
        policy="pool_aware",
        port=free_port_block(3),
        pool_size="512MiB",
        ready_timeout_s=120,
        pool_args=pool_events,
        router_args=router_events,
    )
    cluster = Cluster(cfg).start()
    try:
        url = cluster.router_url
        prefix = "".join(chr(97 + (i * 7) % 26) for i in range(1100))  # byte-level tokens: 4 full chunks of 256
        first = post(url + "/v1/completions", {"model": "tiny", "prompt": prefix + " one", "max_tokens": 2})
        deadline = time.monotonic() + 60
        while (metric(url, "kvshare_router_pool_index_chunks") or 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(url, "kvshare_router_pool_index_chunks") >= 4  # announced, replayed past the gap, indexed
        assert metric(url, "kvshare_router_kv_events_live") == 1
        again = post(url + "/v1/completions", {"model": "tiny", "prompt": prefix + " two", "max_tokens": 2})
        assert again["kvshare"]["replica"] == first["kvshare"]["replica"]  # its GPU and the pool: no load at all
        assert again["kvshare"]["local_tokens"] >= 1024
    finally:
        cluster.stop()
