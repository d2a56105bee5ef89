"""A TP=2 and a TP=1 vLLM replica sharing one pool (pages hold every KV head), and a TP=2 rank that dies
mid-store. Suite ``vllm``.

One pool and two servers for the module (started together): T1 (tensor_parallel_size 1) and T2
(tensor_parallel_size 2, one core per rank, kvshare's connector with a fault: rank 1 exits in a
store once the test arms it). Cold references come from the same replica with a cache_salt, which
(as the salt guard requires) never loads the unsalted pages. Across TP sizes the KV differs in the
last bits (another reduction order of the attention output), so answers are compared as tokens
equal and logprobs within 1e-3; within one TP size a reload is exact in the other e2e tests.
"""

import http.client
import os
import time

import pytest

from kvshare.integrations.vllm.launch import VllmServerConfig, vllm_server_command
from tests.integrations.vllm.servers import (
    answer,
    complete,
    free_port,
    pool_stats,
    private_pool,
    prompt_of,
    provenance,
    running_servers,
    vllm_python,
    vllm_suite_marks,
    with_connector,
)
from tests.integrations.vllm.tiny_model import make_model_dir

PYTHON = vllm_python()
pytestmark = [
    *vllm_suite_marks(),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a TP=2 vLLM CPU server needs two cores"),
]


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-tp")
    model = make_model_dir(str(work / "model"))
    with private_pool("kvshare-tp", "256MiB", ("--extent-size", "64MiB", "--lease-ttl", "60")) as pool:
        socket_path = pool.socket_path
        die_file = str(work / "die")
        common = dict(
            model=model,
            python=PYTHON,
            dtype="float32",
            max_model_len=4096,
            kv_cache_gib=1,
            max_num_batched_tokens=512,
            pool_socket=socket_path,
        )
        t2 = vllm_server_command(VllmServerConfig(port=free_port(), replica="T2", tensor_parallel_size=2, **common))
        configs = {
            "T1": VllmServerConfig(port=free_port(), replica="T1", **common),
            "T2": with_connector(
                t2, "DyingConnector", "tests.integrations.vllm.dying_connector", {"KVSHARE_TEST_DIE_FILE": die_file}
            ),
        }
        with running_servers(configs, str(work)) as servers:
            yield servers, socket_path, die_file


def assert_close_answer(got, want):
    _, tokens, logprobs = answer(got)
    _, ref_tokens, ref_logprobs = answer(want)
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-3)


def cold(server, prompt):
    """The replica's own answer computed from nothing: a salt no stored page carries."""
    got = complete(server, prompt, cache_salt=f"cold-{time.monotonic_ns()}")
    assert provenance(got)["pool_tokens"] == 0 and provenance(got)["local_tokens"] == 0
    return got


def test_tp2_and_tp1_share_pages_both_ways_and_a_dead_rank_leaves_none(replicas):
    servers, socket_path, die_file = replicas
    t1, t2 = servers["T1"], servers["T2"]

    # TP=1 stores, TP=2 loads: each rank its head of every page
    p1 = prompt_of(41, 1100)
    stored = provenance(complete(t1, p1))
    assert stored["pool_tokens"] == 0
    assert pool_stats(socket_path)["entries"] == 4
    got = complete(t2, p1)
    assert provenance(got) == {
        "replica": "T2",
        "local_tokens": 0,
        "pool_tokens": 1024,
        "computed_tokens": 76,
        "namespace": stored["namespace"],
    }  # one namespace for every TP size
    assert_close_answer(got, cold(t2, p1))
    salted = complete(t2, p1, cache_salt="tenant-b")  # a salt never reaches unsalted pages
    assert provenance(salted)["pool_tokens"] == 0

    # TP=2 stores (both ranks' parts, committed once both are in), TP=1 loads
    p2 = prompt_of(42, 1100)
    entries = pool_stats(socket_path)["entries"]
    assert provenance(complete(t2, p2))["pool_tokens"] == 0
    assert pool_stats(socket_path)["entries"] == entries + 4
    got = complete(t1, p2)
    assert provenance(got)["pool_tokens"] == 1024
    assert_close_answer(got, cold(t1, p2))

    # rank 1 of T2 dies mid-store: no page of that prompt may become visible
    p3 = prompt_of(43, 700)
    entries = pool_stats(socket_path)["entries"]
    open(die_file, "w").close()
    with pytest.raises((OSError, http.client.HTTPException)):  # an error status, or the connection broken
        complete(t2, p3)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and pool_stats(socket_path)["writing"]:
        time.sleep(0.5)  # the pool drops T2's reservation when T2's scheduler connection goes
    stats = pool_stats(socket_path)
    assert stats["entries"] == entries and stats["writing"] == 0
    got = complete(t1, p3)
    assert provenance(got)["pool_tokens"] == 0
    assert answer(got) == answer(cold(t1, p3))
