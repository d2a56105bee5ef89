"""bench routing --engine vllm without vLLM: the flags -> the cluster's vLLM replicas (KV size, dtype, context,
their own KV events) and the routers (engine, account key, each replica's events), the request's extension, and
the outputs cell. The replay through real vLLM is tests/integrations/vllm/test_routing.py."""

from __future__ import annotations

import json

import pytest

from kvshare.bench.client import BenchRequest
from kvshare.bench.routing_cluster import RoutingCluster, RoutingTarget
from kvshare.bench.routing_summary import replay_row, summarize
from kvshare.cli import build_parser
from kvshare.commands.bench_routing import routing_plan, vllm_max_model_len
from kvshare.engine.presets import get_preset, model_config_of, preset_hf_config
from kvshare.launch import Cluster
from tests.bench.test_routing import record

TRACE = ["--sessions", "8", "--prompts", "2", "--turns", "2", "--system-tokens", "200-300", "--user-tokens", "60-100"]
TRACE += ["--answer-tokens", "4-8", "--gpu-share", "2"]


def _tiny_dir(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(preset_hf_config(get_preset("tiny"))))
    return str(tmp_path)


def _plan(*argv: str):
    return routing_plan(build_parser().parse_args(["bench", "routing", *argv]))


def _flag(argv, flag: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
    return value


def test_vllm_replicas_get_the_working_set_share_as_their_kv_cache_and_their_own_events(tmp_path):
    """The KV size reaches vLLM as bytes on CPU too. Fails when the replica's environment keeps
    VLLM_CPU_KVCACHE_SPACE (vLLM CPU takes it over --kv-cache-memory-bytes: every replica then gets 1 GiB of KV,
    the whole working set, and no placement matters)."""
    model = _tiny_dir(tmp_path)
    config, target = _plan("--model", model, "--engine", "vllm", "--vllm-python", "/venv/bin/python", *TRACE)
    assert target.engine == "vllm" and target.vllm_python == "/venv/bin/python"
    per_token = model_config_of(model).kv_bytes_per_token
    from kvshare.bench.routing_trace import make_trace

    trace = make_trace(config)
    assert target.local_cache_bytes == int(trace.working_set_tokens() * per_token / 2)
    assert target.max_model_len == vllm_max_model_len(trace) >= trace.longest_request_tokens()
    assert target.max_model_len % 256 == 0

    routing = RoutingCluster(target, ("round_robin", "pool_aware", "pool_aware_dropped"))
    try:
        cluster_config = routing.cluster_config(port=20100, replica_events_port=20200)
        assert cluster_config.engine == "vllm" and cluster_config.vllm_python == "/venv/bin/python"
        assert cluster_config.replica_kv_events_port == 20200
        assert cluster_config.account_key_file == routing._account_key_file
        args = cluster_config.replica_args
        assert _flag(args, "--kv-cache-memory-bytes") == str(target.local_cache_bytes)
        assert _flag(args, "--dtype") == "float32" and _flag(args, "--max-model-len") == str(target.max_model_len)
        assert "--local-cache-size" not in args
        assert {"--engine", "vllm", "--expose-replica-header"} <= set(cluster_config.router_args)

        cluster = Cluster(cluster_config)
        cluster.pool_socket = str(tmp_path / "pool.sock")
        argv, env = cluster._replica_command(1, [])
        assert argv[0] == "/venv/bin/python" and "vllm.entrypoints.openai.api_server" in argv
        assert _flag(argv, "--kv-cache-memory-bytes") == str(target.local_cache_bytes)
        assert json.loads(argv[argv.index("--kv-events-config") + 1])["endpoint"] == "tcp://*:20201"
        assert "VLLM_CPU_KVCACHE_SPACE" not in env
    finally:
        routing._tmp.cleanup()


def test_pool_aware_routers_read_every_vllm_replicas_events_and_the_dropped_one_reads_none(tmp_path):
    """Fails when the pool_aware routers are not given the replicas' own events (their GPU term is then what the
    router sent, not what vLLM holds) or the events-dropped router is (it must see no event at all)."""
    _, target = _plan("--model", _tiny_dir(tmp_path), "--engine", "vllm", "--replicas", "3", *TRACE)
    routing = RoutingCluster(target, ("pool_aware", "pool_aware_gpu", "pool_aware_dropped", "sticky"))
    try:
        routing._replica_events_port = 20300
        for name in ("pool_aware", "pool_aware_gpu"):
            argv = routing.router_args(name)
            endpoints = [argv[i + 1] for i, a in enumerate(argv) if a == "--replica-kv-events"]
            assert endpoints == [f"tcp://127.0.0.1:{20300 + i}" for i in range(3)]
            assert argv[argv.index("--engine") + 1] == "vllm" and "--expose-replica-header" in argv
            assert argv[argv.index("--account-key-file") + 1] == routing._account_key_file
        dropped = routing.router_args("pool_aware_dropped")
        assert "--replica-kv-events" not in dropped and "--kv-events-replay" not in dropped
        assert routing.router_args("sticky")[:2] == ("--policy", "sticky") and "--engine" in routing.router_args(
            "sticky"
        )
    finally:
        routing._tmp.cleanup()
    _, builtin = _plan("--model", "tiny", *TRACE)
    plain = RoutingCluster(builtin, ("pool_aware",))
    try:
        plain._replica_events_port = None
        assert "--replica-kv-events" not in plain.router_args("pool_aware")
        assert "--engine" not in plain.router_args("pool_aware")
        config = plain.cluster_config(port=20100, replica_events_port=0)
        assert config.engine == "builtin" and config.replica_kv_events_port is None
        assert config.replica_args[:2] == ("--local-cache-size", f"{-(-builtin.local_cache_bytes // (1 << 20))}MiB")
    finally:
        plain._tmp.cleanup()


def test_what_the_bench_sizes_itself_is_refused_as_a_replica_arg_and_a_kv_too_small_for_one_request(tmp_path):
    model = _tiny_dir(tmp_path)
    with pytest.raises(ValueError, match="--replica-arg --kv-cache-memory-bytes: bench routing sizes"):
        _plan("--model", model, "--engine", "vllm", "--replica-arg=--kv-cache-memory-bytes=1G", *TRACE)
    with pytest.raises(ValueError, match="cannot hold the trace's longest request"):
        _plan("--model", model, "--engine", "vllm", *TRACE, "--gpu-share", "8")
    RoutingTarget(model="m", replica_args=("--max-model-len=99",))  # the built-in engine's own flag: its business


def test_a_vllm_request_carries_the_pool_switch_where_the_connector_reads_it():
    """Fails when use_pool goes in the body's kvshare object (vLLM ignores it: the pool-off condition loads)."""
    request = BenchRequest("http://r", "chat", "m", messages=[], use_pool=False, engine="vllm", timeline=True)
    body = request.body()
    assert body["kv_transfer_params"] == {"kvshare": {"use_pool": False}} and "kvshare" not in body
    with pytest.raises(ValueError, match="cache_salt of its own"):
        BenchRequest("http://r", "chat", "m", messages=[], use_local_cache=False, engine="vllm")
    salted = BenchRequest("http://r", "chat", "m", messages=[], use_local_cache=False, engine="vllm", cache_salt="s")
    assert salted.body()["cache_salt"] == "s"
    assert BenchRequest("http://r", "chat", "m", messages=[], use_pool=False).body()["kvshare"]["use_pool"] is False


def test_prefill_tokens_without_provenance_and_outputs_by_the_gap_rule():
    """A vLLM stream names no computed tokens: the prompt less its cached tokens are. Outputs that part from the
    recompute are reported by the gap rule (step and gap), as kvshare.bench.outputs tallies them."""
    measured = record(1, 0.2, "http://127.0.0.1:1", None, check="near-tie")
    measured.computed_tokens, measured.pool_tokens, measured.prompt_tokens, measured.cached_tokens = None, None, 100, 64
    measured.first_divergence, measured.divergence_gap = 3, 2e-4
    equal = record(0, 0.1, "http://127.0.0.1:2", 100, check="equal")
    row = replay_row("k", 1.0, "pool_aware/on", 0, [measured, equal], 1.0, 0.0, 0.0, [])
    assert row["prefill_tokens"] == 36 + 100
    (summary,) = summarize([row])
    assert summary["outputs"] == "equal 1/2; near-tie 1 (step 3, gap 0.0002); mismatch 0"
    old = {k: v for k, v in row.items() if k != "output_checks"}  # a row written before the verdicts were kept
    assert summarize([old])[0]["outputs"] == "1/2"


def test_a_hints_condition_has_its_own_router_sending_them_and_no_other_router_does(tmp_path, monkeypatch):
    """POLICY/hints: the policy's router with every replica's hint socket; the replicas take hints; every other
    router, round_robin's included, sends none. Fails when the cluster's own router (which kvshare up gives the
    hint sockets) serves round_robin/on beside a hints condition, or the hinting router lacks an address."""
    from kvshare.bench.routing_trace import parse_condition

    monkeypatch.delenv("KVSHARE_ACCOUNT_KEY", raising=False)
    assert parse_condition("cache_aware/hints").router == "cache_aware+hints"
    assert parse_condition("cache_aware/hints").use_pool
    _, target = _plan("--model", _tiny_dir(tmp_path), "--engine", "vllm", *TRACE)
    routing = RoutingCluster(target, ("round_robin", "cache_aware", "cache_aware+hints"))
    try:
        config = routing.cluster_config(port=20100, replica_events_port=20200)
        assert config.hints and routing.has_hints
        cluster = Cluster(config)
        cluster.pool_socket = str(tmp_path / "pool.sock")
        hinted = routing._hint_args(cluster)
        addresses = [hinted[i + 1] for i, a in enumerate(hinted) if a == "--hint-address"]
        assert addresses == [cluster.hint_address(i) for i in range(2)] and all(addresses)
        assert routing.router_args("cache_aware+hints")[:2] == ("--policy", "cache_aware")
        assert "--hint-address" not in routing.router_args("cache_aware")
        assert "--hint-address" not in routing.router_args("round_robin")
        cluster.stop()
    finally:
        routing._tmp.cleanup()
    plain = RoutingCluster(target, ("round_robin", "cache_aware"))
    try:
        assert not plain.cluster_config(port=20100, replica_events_port=20200).hints
    finally:
        plain._tmp.cleanup()
    _, builtin = _plan("--model", "tiny", *TRACE)
    with pytest.raises(ValueError, match="vLLM replicas"):
        RoutingCluster(builtin, ("cache_aware+hints",))
