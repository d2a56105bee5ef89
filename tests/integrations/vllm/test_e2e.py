"""Two vLLM OpenAI servers sharing one pool, against a vLLM server without the connector.

Suite ``vllm`` (run with the vLLM environment's python). One set of servers serves the
whole module; the tests run in file order and the last one kills the pool.
"""

import os
import signal
import time

import pytest

from kvshare.integrations.vllm.launch import VllmServerConfig
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import start_pool
from tests.integrations.vllm.servers import (
    assert_same_answer,
    cached_tokens,
    complete,
    free_port,
    metric,
    pool_stats,
    post,
    private_pool,
    prompt_of,
    provenance,
    running_servers,
    stored_keys,
    vllm_python,
    vllm_suite_marks,
    wait_for_metric,
)
from tests.integrations.vllm.tiny_model import make_model_dir

PYTHON = vllm_python()
pytestmark = vllm_suite_marks()

C = 256
LAYOUT = KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=C)
POOL_ARGS = ("--extent-size", "64MiB", "--lease-ttl", "60")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A pool, replicas A and B with the connector, C with it and overlap_load, and R without it (the reference)."""
    work = tmp_path_factory.mktemp("vllm-e2e")
    model = make_model_dir(str(work / "model"))
    events = (f"ipc://{work}/events", f"ipc://{work}/events-replay")  # the pool's KV events and their replay
    with private_pool(
        "kvshare-e2e", "256MiB", (*POOL_ARGS, "--kv-events", events[0], "--kv-events-replay", events[1])
    ) as pool:
        socket_path = pool.socket_path
        common = dict(
            model=model,
            python=PYTHON,
            dtype="float32",
            max_model_len=4096,
            kv_cache_gib=1,
            max_num_batched_tokens=512,
            pool_retry_s=1.0,
        )
        configs = {
            "A": VllmServerConfig(port=free_port(), pool_socket=socket_path, replica="A", **common),
            "B": VllmServerConfig(port=free_port(), pool_socket=socket_path, replica="B", **common),
            "R": VllmServerConfig(port=free_port(), pool_socket=None, replica="R", **common),
            # loads copied layer by layer beside the forward (overlap_load, off by default)
            "C": VllmServerConfig(port=free_port(), pool_socket=socket_path, replica="C", overlap_load=True, **common),
        }
        with running_servers(configs, str(work)) as servers:
            yield servers, {"pool": pool, "socket": socket_path, "events": events}


def test_prompt_computed_on_a_is_served_by_b_from_the_pool(cluster):
    servers, state = cluster
    prompt = prompt_of(1, 1100)  # 4 full chunks and a 76-token tail; prefill over 3 steps of 512
    first = complete(servers["A"], prompt)
    namespace = provenance(first)["namespace"]  # the same on both replicas
    assert provenance(first) == {
        "replica": "A",
        "local_tokens": 0,
        "pool_tokens": 0,
        "computed_tokens": 1100,
        "namespace": namespace,
    }
    stats = pool_stats(state["socket"])
    assert stats["entries"] == 4  # every full chunk stored, across the chunked-prefill steps
    hits_before = stats["hit_chunks"]

    second = complete(servers["B"], prompt)
    assert cached_tokens(second) == 1024
    assert provenance(second) == {
        "replica": "B",
        "local_tokens": 0,
        "pool_tokens": 1024,
        "computed_tokens": 76,
        "namespace": namespace,
    }
    stats = pool_stats(state["socket"])
    assert stats["hit_chunks"] - hits_before == 4
    assert stats["leases"] == 0  # released as soon as the load step finished

    assert_same_answer(second, complete(servers["R"], prompt))
    assert_same_answer(first, complete(servers["R"], prompt))
    assert wait_for_metric(servers["B"], "vllm:kvshare_loaded_tokens_total", 1024) >= 1024
    assert wait_for_metric(servers["A"], "vllm:kvshare_stored_chunks_total", 4) >= 4
    assert metric(servers["B"], "vllm:kvshare_load_failures_total") == 0


def test_prompt_of_whole_chunks_and_a_local_hit_extended_from_the_pool(cluster):
    servers, state = cluster
    base = prompt_of(2, 512)
    complete(servers["A"], base)  # two chunks into the pool
    exact = complete(servers["B"], base)  # all of it in the pool: the last block is still computed
    assert provenance(exact)["pool_tokens"] == 480 and cached_tokens(exact) == 480
    assert_same_answer(exact, complete(servers["R"], base))

    longer = base + prompt_of(3, 600)  # 1112 tokens: chunks 0-1 are in B's own cache now
    complete(servers["A"], longer)  # A stores chunks 2 and 3
    both = complete(servers["B"], longer)
    origin = provenance(both)
    assert origin["local_tokens"] >= 480 and origin["local_tokens"] + origin["pool_tokens"] == 1024
    assert origin["pool_tokens"] >= 512
    assert_same_answer(both, complete(servers["R"], longer))


def test_chunks_a_replica_computes_after_a_loaded_prefix_are_announced_after_it_with_their_tokens(cluster):
    """What vLLM stores through the connector reaches the pool's KV events as an indexer needs it: B loads A's
    four chunks and stores chunks 4 and 5, announced with chunk 3 as their parent and their token ids. Fails
    when the connector's store names no parent (chunks 4-5 never announced) or sends no tokens."""
    zmq = pytest.importorskip("zmq")  # noqa: F841
    from kvshare.pool.event_publisher import POOL_TOPIC
    from tests.pool.test_events_wire import BlockStored, Subscriber

    servers, state = cluster
    sub = Subscriber(*state["events"], POOL_TOPIC)
    try:
        prompt = prompt_of(7, 1100)
        complete(servers["A"], prompt)  # chunks 0..3
        longer = prompt + prompt_of(8, 600)  # 1700 tokens: chunks 4 and 5 are new
        assert provenance(complete(servers["B"], longer))["pool_tokens"] == 1024
        wanted = [longer[i * C : (i + 1) * C] for i in range(6)]
        by_tokens = {}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(tuple(t) in by_tokens for t in wanted):
            sub.poll(100)
            by_tokens = {tuple(e.token_ids): e for e in sub.events if isinstance(e, BlockStored)}
    finally:
        sub.close()
    chain = [by_tokens.get(tuple(t)) for t in wanted]
    assert all(e is not None for e in chain), [e is not None for e in chain]
    assert chain[0].parent_block_hash is None
    assert [e.parent_block_hash for e in chain[1:]] == [e.block_hashes[0] for e in chain[:-1]]


def test_use_pool_false_turns_the_pool_off_for_a_request(cluster):
    servers, state = cluster
    prompt = prompt_of(4, 800)
    complete(servers["A"], prompt)
    entries = pool_stats(state["socket"])["entries"]
    off = complete(servers["B"], prompt, kv_transfer_params={"kvshare": {"use_pool": False}})
    assert provenance(off)["pool_tokens"] == 0 and cached_tokens(off) == 0
    assert_same_answer(off, complete(servers["R"], prompt))
    other = complete(servers["B"], prompt_of(5, 800), kv_transfer_params={"kvshare": {"use_pool": False}})
    assert provenance(other)["pool_tokens"] == 0
    assert pool_stats(state["socket"])["entries"] == entries  # nothing stored either


def test_chat_completions_carry_provenance(cluster):
    servers, _ = cluster
    messages = [{"role": "user", "content": "pool page chunk lease replica cache prefix " * 60}]
    model = servers["A"].spec.argv[servers["A"].spec.argv.index("--served-model-name") + 1]
    body = {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0.0}
    post(servers["A"].url, "/v1/chat/completions", body)
    on_b = post(servers["B"].url, "/v1/chat/completions", body)
    reference = post(servers["R"].url, "/v1/chat/completions", body)
    assert provenance(on_b)["pool_tokens"] > 0
    assert on_b["choices"][0]["message"]["content"] == reference["choices"][0]["message"]["content"]


def test_corrupted_page_is_detected_and_recomputed(cluster):
    servers, state = cluster
    prompt = prompt_of(6, 900)  # chunks 0..2
    complete(servers["A"], prompt)
    keys = stored_keys(state["socket"], prompt, LAYOUT)
    with PoolClient(state["socket"], name="vandal") as client:
        pages = client.lookup(keys, LAYOUT.page_bytes, lease=False).pages
        assert len(pages) == 3
        page = client.page(pages[1].offset, LAYOUT.page_bytes)
        page[:] = page[::-1].copy()  # chunk 1's bytes reversed: plausible-looking floats, wrong KV
    failures = metric(servers["B"], "vllm:kvshare_checksum_failures_total")
    dropped = pool_stats(state["socket"])["dropped_pages"]

    got = complete(servers["B"], prompt)
    assert_same_answer(got, complete(servers["R"], prompt))
    assert wait_for_metric(servers["B"], "vllm:kvshare_checksum_failures_total", failures + 1) == failures + 1
    assert pool_stats(state["socket"])["dropped_pages"] == dropped + 1  # nobody else loads it
    assert provenance(got)["pool_tokens"] == C  # chunk 0 came from the pool, the rest was recomputed

    with PoolClient(state["socket"], name="test") as client:  # B recomputed chunk 1 and stored it
        assert len(client.lookup(keys, LAYOUT.page_bytes, lease=False).pages) == 3


def test_layered_loads_beside_the_forward_give_the_same_answer(cluster):
    """overlap_load: each attention layer waits for its own layer's copy (a forward that never waited would
    fail the load: pool_tokens 0 and a load failure); a corrupted page is found after the forward read it,
    and the request is still recomputed from there."""
    servers, state = cluster
    prompt = prompt_of(30, 1100)
    complete(servers["A"], prompt)
    got = complete(servers["C"], prompt)
    assert provenance(got) == {
        "replica": "C",
        "local_tokens": 0,
        "pool_tokens": 1024,
        "computed_tokens": 76,
        "namespace": provenance(got)["namespace"],  # the same model and salt as A's: A's pages were loaded
    }
    assert_same_answer(got, complete(servers["R"], prompt))
    assert metric(servers["C"], "vllm:kvshare_load_failures_total") == 0

    prompt = prompt_of(31, 900)
    complete(servers["A"], prompt)
    keys = stored_keys(state["socket"], prompt, LAYOUT)
    with PoolClient(state["socket"], name="vandal") as client:
        page = client.page(client.lookup(keys, LAYOUT.page_bytes, lease=False).pages[1].offset, LAYOUT.page_bytes)
        page[:] = page[::-1].copy()
    got = complete(servers["C"], prompt)
    assert_same_answer(got, complete(servers["R"], prompt))
    assert provenance(got)["pool_tokens"] == C
    assert wait_for_metric(servers["C"], "vllm:kvshare_checksum_failures_total", 1) == 1


def test_pool_killed_mid_run_both_servers_keep_answering(cluster):
    servers, state = cluster
    os.kill(state["pool"].proc.pid, signal.SIGKILL)
    state["pool"].proc.wait()
    for i, name in enumerate(("A", "B", "A", "B")):
        prompt = prompt_of(10 + i, 700)
        started = time.monotonic()
        got = complete(servers[name], prompt)
        assert time.monotonic() - started < 30
        assert provenance(got)["pool_tokens"] == 0
        assert_same_answer(got, complete(servers["R"], prompt))
    assert wait_for_metric(servers["A"], "vllm:kvshare_pool_errors_total", 1) >= 1

    # a pool started again on the same socket is found again once pool_retry_s has passed
    state["pool"].proc = start_pool(state["socket"], "256MiB", POOL_ARGS)
    time.sleep(1.5)
    prompt = prompt_of(20, 600)
    complete(servers["A"], prompt)
    got = complete(servers["B"], prompt)
    assert provenance(got)["pool_tokens"] == 512
    assert_same_answer(got, complete(servers["R"], prompt))
