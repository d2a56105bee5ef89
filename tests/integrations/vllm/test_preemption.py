"""Real vLLM with the connector under preemption: several requests per step on a KV cache too small for them.

Suite ``vllm`` (run with the vLLM environment's python). Replica A has the connector and a KV cache of
NUM_BLOCKS blocks, about a third of what the concurrent requests need at their longest, so vLLM preempts
running requests (their blocks freed, their tokens recomputed when they resume) while others load from the
pool, hit A's own prefix cache or prefill cold, in chunked-prefill steps that batch several requests.
R is plain vLLM (no connector, a roomy cache); each prompt sent to R alone is the reference.
"""

import threading

import pytest

from kvshare.integrations.vllm.launch import VllmServerConfig, vllm_server_command
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
    vllm_python,
    vllm_suite_marks,
    wait_for_metric,
)
from tests.integrations.vllm.tiny_model import make_model_dir

PYTHON = vllm_python()
pytestmark = vllm_suite_marks()

C = 256  # chunk tokens
# 40 blocks of 32 tokens (8 KiB of KV per token of the tiny model: 10 MiB). vLLM admits a request once its whole
# prompt fits; each then grows by 5 blocks (MAX_TOKENS) as it decodes. Any two of the cold prompts fit together
# (18 + 19 blocks) and outgrow the cache (23 + 24), as do the three on SHARED (16 + 5 + 6 + 6, then 16 + 3 * 11):
# whatever the order the requests arrive in, running requests are preempted. max_model_len fits once.
NUM_BLOCKS = 40
MAX_MODEL_LEN = 1024
MAX_TOKENS = 160
POOL_ARGS = ("--extent-size", "64MiB", "--lease-ttl", "60")


SHARED = prompt_of(100, 2 * C)  # in the pool (stored by A, then dropped from A's own cache)
LOCAL = prompt_of(101, C)  # in A's own prefix cache (and in the pool) when the storm starts
STORM = [
    SHARED + prompt_of(200, 150),
    SHARED + prompt_of(201, 170),
    SHARED + prompt_of(202, 190),
    LOCAL + prompt_of(203, 300),
    prompt_of(204, 560),
    prompt_of(205, 600),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The pool, replica A (the connector, NUM_BLOCKS blocks of KV) and R (no connector, the reference)."""
    work = tmp_path_factory.mktemp("vllm-preempt")
    model = make_model_dir(str(work / "model"))
    with private_pool("kvshare-preempt", "256MiB", POOL_ARGS) as pool:
        socket_path = pool.socket_path
        common = dict(model=model, python=PYTHON, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_gib=1)
        small = VllmServerConfig(
            port=free_port(),
            pool_socket=socket_path,
            replica="A",
            max_num_batched_tokens=512,
            extra_args=("--num-gpu-blocks-override", str(NUM_BLOCKS)),
            **common,
        )
        spec = vllm_server_command(small)
        spec.env["VLLM_SERVER_DEV_MODE"] = "1"  # POST /reset_prefix_cache
        configs = {"A": spec, "R": VllmServerConfig(port=free_port(), pool_socket=None, replica="R", **common)}
        with running_servers(configs, str(work)) as servers:
            yield servers, socket_path


def reset_local_cache(server) -> None:
    """Drop A's own prefix cache (not the pool's pages): the next request finds its prefix only in the pool."""
    assert post(server.url, "/reset_prefix_cache", {})["success"] is True


def storm(server, prompts: list[list[int]]) -> list[dict]:
    """Every prompt sent at once, one thread each; the responses in prompt order."""
    responses: list[dict | BaseException | None] = [None] * len(prompts)

    def send(i: int) -> None:
        try:
            responses[i] = complete(server, prompts[i], max_tokens=MAX_TOKENS)
        except BaseException as exc:  # reported below, with the others
            responses[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    failed = {i: r for i, r in enumerate(responses) if not isinstance(r, dict)}
    assert not failed, f"requests that did not complete: {failed}"
    return responses


def test_preempted_requests_mixing_pool_loads_local_hits_and_cold_prefills_answer_like_the_reference(cluster):
    """A preemption needs several running requests, so the storm ran steps that batch them.

    Fails when the connector loads chunk 0's page into chunk 1's blocks too (a storm request that loaded SHARED
    then answers other tokens than the reference: its second token, as run); two chunks of a prefix swapped would
    pass, since the suffix attends to the same set of keys. Fails when a resumed request's provenance describes
    its resume (a never-seen 560-token prompt reported 544 local tokens where vLLM's cached_tokens said 0)."""
    servers, socket_path = cluster
    a, r = servers["A"], servers["R"]
    complete(a, SHARED + prompt_of(300, 40), max_tokens=1)  # SHARED's two chunks into the pool
    reset_local_cache(a)
    complete(a, LOCAL + prompt_of(301, 40), max_tokens=1)  # LOCAL in A's cache (and the pool)
    preemptions = metric(a, "vllm:num_preemptions_total")

    got = storm(a, STORM)

    # vLLM's counters reach /metrics with its stats, which may come after the last response: polled, not read once
    preempted = wait_for_metric(a, "vllm:num_preemptions_total", preemptions + 1)
    assert preempted > preemptions, "the storm never preempted a request"
    origins = [provenance(response) for response in got]
    for i, (response, origin) in enumerate(zip(got, origins)):  # both describe the request's first prefill
        assert origin["local_tokens"] + origin["pool_tokens"] == cached_tokens(response), (i, origin)
    assert sum(origin["pool_tokens"] for origin in origins[:3]) >= 2 * C, origins  # SHARED came from the pool
    want = [complete(r, prompt, max_tokens=MAX_TOKENS) for prompt in STORM]
    for i, (response, reference) in enumerate(zip(got, want)):
        assert_same_answer(response, reference, f"storm request {i}: {origins[i]}")
    # vLLM publishes the connector's counters at its logging interval: wait for the storm's loads to arrive
    loaded = wait_for_metric(a, "vllm:kvshare_loaded_tokens_total", 2 * C)
    assert loaded >= 2 * C and metric(a, "vllm:kvshare_hit_tokens_total") > 0
    assert metric(a, "vllm:kvshare_checksum_failures_total") == 0
    assert metric(a, "vllm:kvshare_load_failures_total") == 0
    assert pool_stats(socket_path)["leases"] == 0  # every lease of the storm was released

    # every full chunk the storm computed, preempted requests' included, was stored with the right bytes
    for i, (prompt, reference) in enumerate(zip(STORM, want)):
        reset_local_cache(a)
        again = complete(a, prompt, max_tokens=MAX_TOKENS)
        assert provenance(again)["pool_tokens"] == len(prompt) // C * C, (i, provenance(again))
        assert_same_answer(again, reference, f"prompt {i} loaded from the pool after the storm")
    full_chunks = sum(len(prompt) // C * C for prompt in STORM)
    assert wait_for_metric(a, "vllm:kvshare_loaded_tokens_total", loaded + full_chunks) >= loaded + full_chunks
    assert metric(a, "vllm:kvshare_checksum_failures_total") == 0
    assert metric(a, "vllm:kvshare_load_failures_total") == 0
    assert pool_stats(socket_path)["leases"] == 0
