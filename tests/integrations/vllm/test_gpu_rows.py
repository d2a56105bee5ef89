"""Rows of the vLLM GPU benchmark (kvshare.integrations.vllm.gpu_rows): pure, no vLLM, no servers."""

import pytest

from kvshare.integrations.vllm.gpu_rows import (
    ROW_FIELDS,
    Completion,
    bench_serve_row,
    compare,
    load_row,
    on_off_row,
    startup_row,
    store_cost_row,
    ttft_row,
)

COMMON = {"model": "qwen3-8b", "vllm_version": "0.26.0"}


def completion(
    ttft_s=1.0, tokens=(5, 6, 7), logprobs=(-0.1, -0.2, -0.3), tops=((-0.1, -2.0),) * 3, cached=None, last_s=None
):
    return Completion(ttft_s, tuple(tokens), tuple(logprobs), tuple(tops), cached, last_s)


def test_a_ttft_row_carries_every_field_and_its_bound():
    """Fails when the bound is taken from another request than the cross one, or a field goes missing."""
    cold, cross, local = completion(2.0), completion(0.3, cached=1000), completion(0.1, cached=1024)
    row = ttft_row(
        **COMMON,
        prompt_tokens=1024,
        engine="kvshare",
        cold=cold,
        cross=cross,
        local=local,
        kv_bytes_per_token=100,
        h2d_bytes_per_s=1e6,
        first_request=True,
        local_kind="gpu",
    )
    assert set(ROW_FIELDS) <= set(row)
    assert row["bound_s"] == pytest.approx(0.1)  # 1000 cached tokens x 100 B / 1 MB/s
    assert row["cross_over_bound"] == pytest.approx(3.0)
    assert (row["cold_s"], row["cross_s"], row["local_s"]) == (2.0, 0.3, 0.1)
    assert row["tokens_equal"] is True and row["first_divergence"] is None


def test_an_offloading_row_has_no_cross_request_and_bounds_its_local_hit():
    row = ttft_row(
        **COMMON,
        prompt_tokens=64,
        engine="vllm-offloading",
        cold=completion(1.0),
        cross=None,
        local=completion(0.5, tokens=(5, 9, 7), cached=64),
        kv_bytes_per_token=10,
        h2d_bytes_per_s=640.0,
        first_request=False,
        local_kind="cpu tier",
    )
    assert row["cross_s"] is None and row["cross_over_bound"] is None and row["bound_s"] == pytest.approx(1.0)
    assert row["tokens_equal"] is False and row["first_divergence"] == 1


def test_no_bound_off_a_gpu_and_unknown_engines_are_refused():
    row = ttft_row(
        **COMMON,
        prompt_tokens=64,
        engine="lmcache-mp",
        cold=completion(),
        cross=completion(cached=64),
        local=None,
        kv_bytes_per_token=10,
        h2d_bytes_per_s=None,
        first_request=True,
        local_kind="",
    )
    assert row["bound_s"] is None and row["cross_over_bound"] is None and row["local_s"] is None
    with pytest.raises(ValueError, match="engine must be one of"):
        ttft_row(
            **COMMON,
            prompt_tokens=64,
            engine="sglang",
            cold=completion(),
            cross=None,
            local=None,
            kv_bytes_per_token=10,
            h2d_bytes_per_s=None,
            first_request=True,
            local_kind="",
        )


def test_compare_finds_the_first_divergence_and_the_top2_gap_there():
    """Fails when the gap is read from the other run or at the wrong step."""
    cold = completion(
        tokens=(1, 2, 3, 4),
        logprobs=(-0.1, -0.2, -0.3, -0.4),
        tops=((-0.1, -3.0), (-0.2, -0.9), (-0.3, -0.3004), (-0.4, -1.0)),
    )
    other = completion(tokens=(1, 2, 9, 4), logprobs=(-0.1, -0.25, -0.3, -0.4), tops=())
    got = compare(cold, other)
    assert got["tokens_equal"] is False and got["first_divergence"] == 2
    assert got["top2_gap"] == pytest.approx(0.0004)
    assert got["max_logprob_diff"] == pytest.approx(0.05) and got["logprobs_equal"] is False


def test_compare_calls_a_shorter_answer_a_divergence_and_equal_logprobs_equal():
    short = completion(tokens=(5, 6), logprobs=(-0.1, -0.2))
    assert compare(completion(), short)["first_divergence"] == 2
    same = compare(completion(), completion(ttft_s=0.2))
    assert same["tokens_equal"] and same["logprobs_equal"] and same["max_logprob_diff"] == 0.0


def test_on_off_row_compares_the_pool_load_with_the_replicas_own_cold_run():
    off = completion(1.0, cached=0)
    on = completion(0.2, logprobs=(-0.1, -0.2, -0.31), cached=1024)
    row = on_off_row(**COMMON, prompt_tokens=1100, off=off, on=on, batch_invariant=False)
    assert row["tokens_equal"] and not row["logprobs_equal"]
    assert row["max_logprob_diff"] == pytest.approx(0.01) and row["cross_cached_tokens"] == 1024


def test_store_cost_row_is_medians_and_the_five_percent_goal():
    """Fails when the decode rate ignores the first token's time or the ratio is inverted."""
    tokens = tuple(range(11))  # 10 tokens after the first
    storing = [completion(1.04, tokens=tokens, last_s=1.04 + 1.0), completion(1.06, tokens=tokens, last_s=2.06)]
    plain = [completion(1.0, tokens=tokens, last_s=2.0)]
    row = store_cost_row(**COMMON, prompt_tokens=32768, storing=storing, plain=plain)
    assert row["cold_ratio"] == pytest.approx(1.05) and row["decode_tokens_per_s"] == pytest.approx(10.0)
    assert row["decode_slowdown"] == pytest.approx(1.0) and row["goal_met"] is True
    slow = store_cost_row(
        **COMMON, prompt_tokens=32768, storing=[completion(1.2, tokens=tokens, last_s=2.2)], plain=plain
    )
    assert slow["goal_met"] is False
    with pytest.raises(ValueError):
        store_cost_row(**COMMON, prompt_tokens=1, storing=[], plain=plain)


def test_percentiles_and_the_load_row():
    row = load_row(
        **COMMON,
        pool="on",
        num_sessions=16,
        duration_s=180,
        ttfts_s=[0.1, 0.2, 0.3],
        num_errors=0,
        num_requests=3,
        cached_tokens=750,
        prompt_tokens=1000,
    )
    assert row["ttft_p50_s"] == pytest.approx(0.2) and row["cached_share"] == pytest.approx(0.75)
    assert row["ttft_p99_s"] == pytest.approx(0.298)
    empty = load_row(
        **COMMON,
        pool="on",
        num_sessions=16,
        duration_s=180,
        ttfts_s=[],
        num_errors=3,
        num_requests=3,
        cached_tokens=0,
        prompt_tokens=0,
    )
    assert empty["ttft_p50_s"] is None and empty["ttft_p99_s"] is None and empty["cached_share"] is None


def test_bench_serve_row_takes_vllms_own_figures():
    result = {
        "completed": 62,
        "num_prompts": 64,
        "request_throughput": 3.5,
        "median_ttft_ms": 40.0,
        "p99_ttft_ms": 90.0,
    }
    row = bench_serve_row(**COMMON, target="router", result=result, command=["vllm", "bench", "serve"])
    assert row["failed"] == 2 and row["median_ttft_ms"] == 40.0 and row["command"] == "vllm bench serve"
    with pytest.raises(ValueError, match="not a vllm bench serve result"):
        bench_serve_row(**COMMON, target="router", result={}, command=[])


UP_LOG = """\
replica0| (APIServer pid=965) INFO 12-05 05:14:52 [api_utils.py:345] version 0.26.0
replica0| (EngineCore pid=1183) INFO 12-05 05:15:40 [kv_cache_utils.py:2177] GPU KV cache size: 202,080 tokens
replica0| (APIServer pid=965) INFO 12-05 05:16:49 [api_server.py:677] Starting vLLM server on http://127.0.0.1:8201
replica1| (APIServer pid=967) INFO 12-05 05:16:50 [api_utils.py:345] version 0.26.0
replica1| (EngineCore pid=1205) INFO 12-05 05:17:58 [kv_cache_utils.py:2177] GPU KV cache size: 174,752 tokens
replica1| (APIServer pid=967) INFO 12-05 05:18:49 [api_server.py:677] Starting vLLM server on http://127.0.0.1:8202
router| something else
"""


def test_startup_row_reads_the_order_and_the_kv_sizes_from_ups_log():
    """Fails when a replica that began before its neighbour served counts as started in order."""
    row = startup_row(**COMMON, device="cuda", log_lines=UP_LOG.splitlines())
    assert row["started_in_order"] is True and row["replicas"] == 2
    assert row["kv_cache_tokens"] == {"replica0": 202080, "replica1": 174752} and row["kv_cache_device"] == "GPU"
    assert row["kv_cache_tokens_min_over_max"] == pytest.approx(174752 / 202080)
    assert row["serving_after_s"] == {"replica0": 117, "replica1": 237}
    together = UP_LOG.replace(
        "replica1| (APIServer pid=967) INFO 12-05 05:16:50", "replica1| (APIServer pid=967) INFO 12-05 05:14:53"
    )
    assert startup_row(**COMMON, device="cuda", log_lines=together.splitlines())["started_in_order"] is False


def test_on_off_row_separates_the_prefix_bytes_from_vllms_reuse_numerics():
    """A pool load that departs from the cold run but equals the replica's own prefix hit is vLLM's reuse numerics;
    one that departs from the own hit too is a different prefix. Fails when the own-hit comparison is dropped or
    compares the wrong pair (the cold run instead of the own hit)."""
    cold_b = completion(1.0, tokens=(5, 6, 7), logprobs=(-0.1, -0.2, -0.3), cached=0)
    own = completion(0.1, tokens=(5, 6, 8), logprobs=(-0.1, -0.25, -0.3), cached=1024)
    same = completion(0.2, tokens=(5, 6, 8), logprobs=(-0.1, -0.25, -0.3), cached=1024)
    row = on_off_row(
        **COMMON, prompt_tokens=1100, off=cold_b, on=same, batch_invariant=False, own_hit=own, a_cold=cold_b
    )
    assert not row["tokens_equal"] and row["first_divergence"] == 2
    assert row["own_hit_tokens_equal"] and row["own_hit_logprobs_equal"] and row["own_hit_same_split"]
    assert row["replicas_cold_logprobs_equal"] and row["own_hit_s"] == 0.1
    other = completion(0.2, tokens=(5, 9, 8), logprobs=(-0.1, -0.4, -0.3), cached=992)
    row = on_off_row(**COMMON, prompt_tokens=1100, off=cold_b, on=other, batch_invariant=False, own_hit=own)
    assert not row["own_hit_tokens_equal"] and row["own_hit_first_divergence"] == 1
    assert row["own_hit_same_split"] is False and "replicas_cold_tokens_equal" not in row


def test_a_stall_row_takes_the_worst_gap_over_the_requests_first_token_against_the_streams_p99():
    from kvshare.integrations.vllm.gpu_rows import Completion, stall_row, token_gaps

    steady = [[0.01 * k + s * 0.001 for k in range(400)] for s in range(4)]  # 10 ms a token, four streams
    stalled = [times[:150] + [t + 0.35 for t in times[150:]] for times in steady]  # 350 ms lost after token 149
    assert max(token_gaps(stalled, 1.2, 1.8)) == pytest.approx(0.36)
    assert token_gaps(steady, 10.0, 11.0) == []
    loaded = Completion(ttft_s=0.5, tokens=(1,), logprobs=(0.0,), tops=((0.0,),), cached_tokens=131072)
    row = stall_row(
        model="m",
        prompt_tokens=131072,
        vllm_version="0.26",
        engine="kvshare",
        baseline=(steady, 0.5, 3.5),
        load=(steady, 1.0, loaded),
        cold=(stalled, 1.2, loaded),
        local=(stalled, 1.3, loaded),
        counters={"load": {"async_loads": 1, "loaded_tokens": 131040}, "local": {"loaded_tokens": 0}},
    )
    assert row["baseline_p99_gap_s"] == pytest.approx(0.01)
    assert row["local_over_p99"] == pytest.approx(36.0) and row["local_ttft_s"] == 0.5
    assert row["load_async_loads"] == 1 and row["load_loaded_tokens"] == 131040 and row["local_loaded_tokens"] == 0
    assert row["load_over_p99"] == pytest.approx(1.0) and row["load_streams_outlasted"]
    assert row["cold_over_p99"] == pytest.approx(36.0) and row["cold_cached_tokens"] == 131072
    short = stall_row(
        model="m",
        prompt_tokens=1,
        vllm_version="0.26",
        engine="kvshare",
        baseline=(steady, 0.5, 3.5),
        load=([times[:100] for times in steady], 0.5, loaded),
        cold=None,
    )
    assert not short["load_streams_outlasted"] and "cold_ttft_s" not in short and "local_ttft_s" not in short
    assert "load_async_loads" not in short
