"""A hybrid model (Gated DeltaNet + gated attention) through two vLLM servers on one GPU sharing one pool.

Suites gpu and vllm: skipped without CUDA or without vLLM (on the GPU machine: vLLM 0.26 from the bundle,
``bash benchmarks/vllm_hybrid_gpu.sh 3``). The connector moves the GDN state on CUDA only with
``allow_untested_vllm`` (hybrid.TESTED_HYBRID_VLLM names the runs that showed it), which the replicas get here.
Replica A computes a prompt of several blocks and stores its chunks and the GDN checkpoint after the last whole one;
replica B loads them (the attention KV and the state, transposed into vLLM CUDA's [HV, V, K] by gpu_states) and
computes the tail: its greedy tokens equal its own cold run of the prompt (salted, so that neither its prefix cache
nor the pool's pages serve it). The servers get what ``kvshare up`` gives a hybrid model (launch.hybrid_settings) and
keep the recurrent state in float32 (Qwen3.5's ``mamba_ssm_dtype``; vLLM CUDA keeps a Qwen3-Next's in the model's
dtype otherwise); the GDN prefill runs on the FLA Triton kernels (the bundle carries no FlashInfer).
"""

import random

import pytest
import torch

from kvshare.integrations.vllm.launch import VllmServerConfig, hybrid_settings
from kvshare.pool.spawn import start_pool, stop_process
from tests.integrations.vllm.servers import (
    answer,
    complete,
    free_port,
    metric,
    private_socket,
    provenance,
    start_servers,
    stop_servers,
    vllm_python,
    vllm_suite_marks,
    wait_for_metric,
)
from tests.integrations.vllm.tiny_hybrid import make_hybrid_model_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    *vllm_suite_marks(),
    pytest.mark.timeout(480),  # two servers start (CUDA graphs captured) within it
]

VLLM_ARGS = (
    "--mamba-ssm-cache-dtype", "float32",
    "--gdn-prefill-backend", "triton",
    "--kv-cache-memory-bytes", str(2 << 30),
)  # fmt: skip
GPU_SHARE = 0.4  # each replica's share of the card: vLLM starts only where its share is free


def prompt_of(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(num_tokens)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-hybrid-cuda")
    model = make_hybrid_model_dir(str(work / "model"))
    settings = hybrid_settings(model, "cuda")
    assert settings is not None
    with private_socket("kvshare-hybrid-cuda") as socket_path:
        pool = start_pool(socket_path, "1GiB", ("--extent-size", "64MiB", "--lease-ttl", "60"))
        common = dict(
            model=model,
            python=vllm_python(),
            device="cuda",
            gpu_memory_utilization=GPU_SHARE,
            max_model_len=4096,
            pool_retry_s=1.0,
            allow_untested_vllm=True,
            block_size=settings.block_size,
            chunk_tokens=settings.chunk_tokens,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            mamba_cache_mode=settings.mamba_cache_mode,
            extra_args=VLLM_ARGS,
        )
        configs = {
            name: VllmServerConfig(port=free_port(), pool_socket=socket_path, replica=name, **common)
            for name in ("A", "B")
        }
        servers = start_servers(configs, str(work))
        try:
            yield servers, settings.chunk_tokens
        finally:
            stop_servers(servers)
            stop_process(pool)


def test_b_resumes_from_as_checkpoint_and_answers_as_its_own_cold_run(cluster):
    servers, C = cluster
    num_chunks, tail = 3, 80
    prompt = prompt_of(1, num_chunks * C + tail)  # a checkpoint after the last whole chunk
    cold_b = complete(servers["B"], prompt, cache_salt="b-alone")  # neither B's prefix cache nor the pool has it
    assert provenance(cold_b)["computed_tokens"] == len(prompt)

    cold_a = complete(servers["A"], prompt)
    assert provenance(cold_a)["computed_tokens"] == len(prompt)
    assert wait_for_metric(servers["A"], "vllm:kvshare_stored_states_total", 1) >= 1

    warm = complete(servers["B"], prompt)
    origin = provenance(warm)
    assert (origin["local_tokens"], origin["pool_tokens"], origin["computed_tokens"]) == (0, num_chunks * C, tail)
    assert wait_for_metric(servers["B"], "vllm:kvshare_loaded_states_total", 1) >= 1
    assert metric(servers["B"], "vllm:kvshare_load_failures_total") == 0
    assert answer(warm)[1] == answer(cold_b)[1]  # B's greedy tokens, resumed from A's state, as computed alone
    assert answer(cold_a)[1] == answer(cold_b)[1]
