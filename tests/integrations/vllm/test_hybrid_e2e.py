"""A hybrid model (Gated DeltaNet + gated attention) through two vLLM CPU servers sharing one pool.

Suite ``vllm``. Replica B resumes what replica A computed: the attention KV of every chunk up to a GDN checkpoint
and the state there, vLLM computing the rest; its answers equal A's cold ones. The servers get what
``kvshare up`` gives a hybrid model (launch.hybrid_settings: blocks of 640 tokens, one chunk per block, prefill
steps of one block, ``--mamba-cache-mode align``), so B computes the tail in the same steps as A did.
"""

import pytest

from kvshare.integrations.vllm.hybrid import state_layout_of
from kvshare.integrations.vllm.launch import VllmServerConfig, hybrid_settings
from kvshare.keys import state_key
from kvshare.layout import KVLayout
from kvshare.pool import protocol as P
from kvshare.pool.client import PoolClient
from tests.integrations.vllm.servers import (
    assert_same_answer,
    complete,
    free_port,
    metric,
    pool_stats,
    private_pool,
    prompt_of,
    provenance,
    running_servers,
    stored_keys,
    vllm_python,
    vllm_suite_marks,
    wait_for_metric,
)
from tests.integrations.vllm.tiny_hybrid import TEXT_CONFIG, make_hybrid_model_dir

PYTHON = vllm_python()
pytestmark = vllm_suite_marks()

C = 640  # vLLM's block size for the tiny hybrid on CPU, one chunk per block
NUM_GDN_LAYERS = 6
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16", chunk_tokens=C)


class _Text:
    def __init__(self, values: dict) -> None:
        self.__dict__.update(values)


STATE_BYTES = state_layout_of(_Text(TEXT_CONFIG), "bfloat16", NUM_GDN_LAYERS).checkpoint_bytes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-hybrid")
    model = make_hybrid_model_dir(str(work / "model"))
    settings = hybrid_settings(model, "cpu")
    assert settings is not None and settings.block_size == C
    with private_pool("kvshare-hybrid", "256MiB", ("--extent-size", "64MiB", "--lease-ttl", "60")) as pool:
        socket_path = pool.socket_path
        common = dict(
            model=model,
            python=PYTHON,
            max_model_len=4096,
            kv_cache_gib=1,
            pool_retry_s=1.0,
            block_size=settings.block_size,
            chunk_tokens=settings.chunk_tokens,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            mamba_cache_mode=settings.mamba_cache_mode,
        )
        configs = {
            "A": VllmServerConfig(port=free_port(), pool_socket=socket_path, replica="A", **common),
            "B": VllmServerConfig(port=free_port(), pool_socket=socket_path, replica="B", **common),
        }
        with running_servers(configs, str(work)) as servers:
            yield servers, socket_path


def checkpoint_page(client, keys, num_chunks):
    """The committed checkpoint after ``num_chunks`` chunks of the prompt keyed ``keys`` (None: not held)."""
    candidate = P.StateCandidate(key=state_key(keys[num_chunks - 1]), num_kv=num_chunks)
    grant = client.lookup(keys, LAYOUT.page_bytes, lease=False, states=[candidate], state_page_bytes=STATE_BYTES)
    return grant.state.page if grant.state is not None else None


def test_b_resumes_from_the_checkpoint_a_stored(cluster):
    servers, socket_path = cluster
    prompt = prompt_of(1, 2000)  # 3 whole chunks and an 80-token tail: a checkpoint after chunk 3
    cold = complete(servers["A"], prompt)
    assert provenance(cold)["computed_tokens"] == 2000
    keys = stored_keys(socket_path, prompt, LAYOUT)
    with PoolClient(socket_path, name="test") as client:
        assert len(client.lookup(keys, LAYOUT.page_bytes, lease=False).pages) == 3
        assert checkpoint_page(client, keys, 3) is not None
    assert wait_for_metric(servers["A"], "vllm:kvshare_stored_states_total", 1) >= 1

    warm = complete(servers["B"], prompt)
    origin = provenance(warm)
    assert (origin["local_tokens"], origin["pool_tokens"], origin["computed_tokens"]) == (0, 3 * C, 80)
    assert_same_answer(warm, cold)
    assert metric(servers["B"], "vllm:kvshare_load_failures_total") == 0


def test_b_extends_its_own_prefix_hit_from_the_pool(cluster):
    """B holds the first prompt (loaded above) in its own prefix cache; A computes a longer one over it. B resumes
    from A's deeper checkpoint: vLLM's own hit, then the pool's chunks after it and the state at their end."""
    servers, socket_path = cluster
    prompt = prompt_of(1, 2000) + prompt_of(11, 1300)  # 5 whole chunks and a 100-token tail
    on_a = complete(servers["A"], prompt)  # A too resumes from its own cache: the first prompt's blocks
    on_b = complete(servers["B"], prompt)
    origin = provenance(on_b)
    assert origin["local_tokens"] > 0 and origin["local_tokens"] + origin["pool_tokens"] == 5 * C
    assert origin["pool_tokens"] >= 2 * C
    assert_same_answer(on_b, on_a)


def test_kv_without_a_checkpoint_is_computed_not_resumed(cluster):
    """A prompt of whole chunks resumes one chunk before its end (its last token is computed); A kept the state
    only after all 4 chunks, so B finds KV but no checkpoint it may resume from and computes the whole prompt."""
    servers, socket_path = cluster
    longer = prompt_of(2, 2700)  # A: 4 whole chunks, a checkpoint after chunk 4 only
    complete(servers["A"], longer)
    prompt = longer[: 4 * C]
    keys = stored_keys(socket_path, prompt, LAYOUT)
    with PoolClient(socket_path, name="test") as client:
        assert len(client.lookup(keys, LAYOUT.page_bytes, lease=False).pages) == 4
        assert checkpoint_page(client, keys, 4) is not None and checkpoint_page(client, keys, 3) is None

    got = complete(servers["B"], prompt)
    assert (provenance(got)["local_tokens"], provenance(got)["pool_tokens"]) == (0, 0)
    assert_same_answer(got, complete(servers["A"], prompt))  # A resumes from its own prefix cache


def test_corrupted_checkpoint_is_detected_and_recomputed(cluster):
    servers, socket_path = cluster
    prompt = prompt_of(3, 1400)  # 2 whole chunks: a checkpoint after chunk 2
    cold = complete(servers["A"], prompt)
    keys = stored_keys(socket_path, prompt, LAYOUT)
    with PoolClient(socket_path, name="vandal") as client:
        page_header = checkpoint_page(client, keys, 2)
        page = client.page(page_header.offset, page_header.page_bytes)
        page[:] = page[::-1].copy()  # the state's bytes reversed: plausible floats, a wrong state
    failures = metric(servers["B"], "vllm:kvshare_checksum_failures_total")
    dropped = pool_stats(socket_path)["dropped_pages"]

    got = complete(servers["B"], prompt)
    assert provenance(got)["pool_tokens"] == 0  # KV without its state is of no use: all of it computed
    assert_same_answer(got, cold)
    assert wait_for_metric(servers["B"], "vllm:kvshare_checksum_failures_total", failures + 1) == failures + 1
    assert pool_stats(socket_path)["dropped_pages"] == dropped + 1  # nobody else loads it
    with PoolClient(socket_path, name="test") as client:  # B's recompute stored a good one again
        assert checkpoint_page(client, keys, 2) is not None
