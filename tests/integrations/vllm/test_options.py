"""Connector settings, per-request options, refusals and the server command line (no vLLM needed)."""

import json
import pathlib
from types import SimpleNamespace

import pytest

from kvshare.integrations.vllm.cpu_cores import rank_core_binds, reserved_cpus_advice
from kvshare.integrations.vllm.launch import VllmServerConfig, kv_transfer_config, vllm_server_command
from kvshare.integrations.vllm.options import (
    ConnectorConfig,
    TransferParams,
    check_supported,
    kv_layout_of,
    provenance,
)


def test_extra_config_is_parsed_and_checked():
    config = ConnectorConfig.from_extra_config({"pool_socket": "/p.sock", "chunk_tokens": 512, "verify_fraction": 1})
    assert config.socket_path == "/p.sock" and config.chunk_tokens == 512 and config.verify_fraction == 1.0
    assert ConnectorConfig().verify_fraction == 1.0  # every page unless asked otherwise: never serve unchecked KV
    with pytest.raises(ValueError, match="verify_fraction must lie in"):
        ConnectorConfig.from_extra_config({"verify_fraction": 1.5})
    with pytest.raises(ValueError, match="verify_checksums is gone: set verify_fraction"):
        ConnectorConfig.from_extra_config({"verify_checksums": True})
    with pytest.raises(ValueError, match="copy_threads"):
        ConnectorConfig(copy_threads=0)
    assert ConnectorConfig.from_extra_config(None).socket_path.endswith("pool.sock")  # kvshare's default socket
    with pytest.raises(ValueError, match="unknown kvshare connector settings.*pool_sockets"):
        ConnectorConfig.from_extra_config({"pool_sockets": "/p.sock"})
    with pytest.raises(ValueError, match="true or false"):
        ConnectorConfig.from_extra_config({"store": "no"})
    with pytest.raises(ValueError, match="chunk_tokens must be of type int"):
        ConnectorConfig.from_extra_config({"chunk_tokens": "many"})
    with pytest.raises(ValueError, match="multiple of vLLM's block size"):
        ConnectorConfig(chunk_tokens=256).check_block_size(48)


def test_request_options_default_to_the_pool_on():
    assert TransferParams.from_params(None).use_pool
    assert TransferParams.from_params({"other_connector": 1}).use_pool
    assert not TransferParams.from_params({"kvshare": {"use_pool": False}}).use_pool
    assert TransferParams.from_params({"kvshare": {"use_pool": "false"}}).use_pool  # only a JSON false turns it off
    assert TransferParams.from_params({"kvshare": "off"}).use_pool


def test_provenance_always_adds_up():
    assert provenance("A", 1100, 0, 1024) == {
        "replica": "A",
        "local_tokens": 0,
        "pool_tokens": 1024,
        "computed_tokens": 76,
    }
    assert provenance("A", 100, 80, 64)["computed_tokens"] == 0  # clipped, never negative


def _vllm_config(tp=1, pp=1, cache_dtype="auto", calculate_kv_scales=False):
    model = SimpleNamespace(
        dtype="torch.float32",
        get_num_layers=lambda parallel: 8,
        get_num_kv_heads=lambda parallel: max(1, 2 // parallel.tensor_parallel_size),
        get_total_num_kv_heads=lambda: 2,
        get_head_size=lambda: 64,
    )
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    cache = SimpleNamespace(cache_dtype=cache_dtype, calculate_kv_scales=calculate_kv_scales)
    return SimpleNamespace(model_config=model, cache_config=cache, parallel_config=parallel)


def test_pipeline_parallel_is_refused_tensor_parallel_is_not():
    check_supported(_vllm_config(tp=2))
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        check_supported(_vllm_config(pp=2))


def test_page_layout_from_the_vllm_config():
    layout = kv_layout_of(_vllm_config(), 256)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (8, 2, 64, "float32")
    assert layout.page_bytes == 2 << 20
    assert kv_layout_of(_vllm_config(tp=2), 256) == layout  # pages hold every head, whatever the TP size
    fp8 = kv_layout_of(_vllm_config(cache_dtype="fp8"), 256)
    assert fp8.dtype == "float8_e4m3fn" and fp8.page_bytes == layout.page_bytes // 4
    assert kv_layout_of(_vllm_config(cache_dtype="fp8_e5m2"), 256).dtype == "float8_e5m2"
    with pytest.raises(ValueError, match="kv-cache-dtype int8 is not supported"):
        kv_layout_of(_vllm_config(cache_dtype="int8"), 256)
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        kv_layout_of(_vllm_config(cache_dtype="fp8", calculate_kv_scales=True), 256)


def test_server_command_line():
    config = VllmServerConfig(
        model="/models/tiny",
        port=8123,
        pool_socket="/run/pool.sock",
        python="/venv/bin/python",
        replica="r0",
        max_model_len=2048,
        kv_cache_gib=2,
        dtype="float32",
    )
    spec = vllm_server_command(config, base_env={"PATH": "/bin"})
    argv = spec.argv
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enforce-eager", "--enable-prompt-tokens-details", "--enable-prefix-caching"):
        assert flag in argv
    assert argv[argv.index("--block-size") + 1] == "32"
    assert argv[argv.index("--max-model-len") + 1] == "2048"
    assert argv[argv.index("--served-model-name") + 1] == "tiny"
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer == kv_transfer_config(config)
    assert transfer["kv_connector_module_path"] == "kvshare.integrations.vllm"
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert transfer["kv_connector_extra_config"]["pool_socket"] == "/run/pool.sock"
    assert "verify_fraction" not in transfer["kv_connector_extra_config"]  # the connector's default
    ConnectorConfig.from_extra_config(transfer["kv_connector_extra_config"])  # every key is one the connector knows
    checked = kv_transfer_config(VllmServerConfig(model="m", port=1, pool_socket="/p", verify_fraction=1.0))
    assert ConnectorConfig.from_extra_config(checked["kv_connector_extra_config"]).verify_fraction == 1.0
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and spec.env["PATH"] == "/bin"
    assert spec.base_url == "http://127.0.0.1:8123"

    assert "KVSHARE_LOG_LEVEL" not in spec.env
    debug = vllm_server_command(VllmServerConfig(model="m", port=1, log_level="DEBUG"), base_env={})
    assert debug.env["KVSHARE_LOG_LEVEL"] == "DEBUG"  # the connector's phase timings (bench --timings)

    assert "--tensor-parallel-size" not in argv
    tp = vllm_server_command(VllmServerConfig(model="m", port=1, tensor_parallel_size=2), base_env={})
    assert tp.argv[tp.argv.index("--tensor-parallel-size") + 1] == "2"
    assert tp.env["VLLM_CPU_OMP_THREADS_BIND"].count("|") == 1  # one share of the cores per rank
    assert rank_core_binds([0, 1], 2) == "0|1" and rank_core_binds([0, 1, 2, 3, 4], 2) == "0,1|2,3"
    with pytest.raises(ValueError, match="at least 4 cores"):
        rank_core_binds([0, 1], 4)

    plain = vllm_server_command(VllmServerConfig(model="/models/tiny", port=8124, pool_socket=None))
    assert "--kv-transfer-config" not in plain.argv
    with pytest.raises(ValueError, match="multiple of block_size"):
        VllmServerConfig(model="m", port=1, chunk_tokens=100)


def test_a_cpu_replica_with_the_connector_gets_the_openmp_cores_of_plain_vllm():
    """vLLM CPU keeps one more core per rank off its OpenMP threads when any KV connector is configured; on 2 cores
    that made the replica with the connector run 2 threads where plain vLLM ran 1 (decode 3.6x slower beside it).
    Fails when vllm_server_command leaves VLLM_CPU_NUM_OF_RESERVED_CPU unset for a replica with the connector."""
    ours = vllm_server_command(VllmServerConfig(model="m", port=1, pool_socket="/p"), base_env={})
    assert ours.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"  # what vLLM reserves for one rank without a connector
    plain = vllm_server_command(VllmServerConfig(model="m", port=1), base_env={})
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in plain.env  # vLLM's own choice, the same 1
    given = vllm_server_command(
        VllmServerConfig(model="m", port=1, pool_socket="/p"), base_env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "3"}
    )
    assert given.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "3"  # an operator's value stands
    gpu = vllm_server_command(VllmServerConfig(model="m", port=1, pool_socket="/p", device="cuda"), base_env={})
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in gpu.env


def test_vllm_started_by_hand_with_the_connector_is_told_which_cores_to_give_back():
    """The connector's warning where vLLM was started without kvshare's launch (its environment then lacks the
    reservation): none where the reservation or an explicit binding is set."""
    advice = reserved_cpus_advice({}, 2)
    assert advice is not None and "VLLM_CPU_NUM_OF_RESERVED_CPU=2" in advice
    assert reserved_cpus_advice({"VLLM_CPU_OMP_THREADS_BIND": "auto"}, 1) is not None
    assert (
        reserved_cpus_advice(
            vllm_server_command(VllmServerConfig(model="m", port=1, pool_socket="/p"), base_env={}).env, 1
        )
        is None
    )  # kvshare up's replicas
    assert reserved_cpus_advice({"VLLM_CPU_OMP_THREADS_BIND": "0-3"}, 1) is None  # cores chosen by hand


def test_up_passes_tensor_parallel_size_to_vllm_replicas(tmp_path):
    import argparse

    from kvshare.commands.up import add_arguments
    from kvshare.launch import Cluster, ClusterConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--engine", "vllm", "--tensor-parallel-size", "2"]).tensor_parallel_size == 2
    (tmp_path / "config.json").write_text("{}")
    argv, env = Cluster(ClusterConfig(engine="vllm", model=str(tmp_path), tensor_parallel_size=2))._replica_command(
        0, []
    )
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and "|" in env["VLLM_CPU_OMP_THREADS_BIND"]
    with pytest.raises(ValueError, match="vLLM replicas only"):
        ClusterConfig(engine="builtin", tensor_parallel_size=2)


def test_cuda_server_command_keeps_vllms_compiled_defaults():
    """Fails when --enforce-eager is passed on CUDA (CUDA graphs and torch.compile off)."""
    spec = vllm_server_command(
        VllmServerConfig(model="m", port=1, device="cuda", max_model_len=None, gpu_memory_utilization=0.45), base_env={}
    )
    assert "--enforce-eager" not in spec.argv and "--max-model-len" not in spec.argv
    assert spec.argv[spec.argv.index("--gpu-memory-utilization") + 1] == "0.45"
    assert "VLLM_CPU_KVCACHE_SPACE" not in spec.env and "CUDA_VISIBLE_DEVICES" not in spec.env
    assert "--enforce-eager" in vllm_server_command(VllmServerConfig(model="m", port=1), base_env={}).argv  # CPU
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VllmServerConfig(model="m", port=1, device="cuda", gpu_memory_utilization=1.5)


def test_the_other_kv_tiers_compared_with_kvshare_come_from_the_same_command():
    """vLLM's own CPU offloading and LMCache's MP connector are fields of the one command builder; vLLM runs one KV
    connector, so two tiers at once are refused. Fails when either flag is left out of the command line."""
    offload = vllm_server_command(
        VllmServerConfig(model="m", port=1, device="cuda", kv_offloading_gib=40), base_env={}
    ).argv
    assert offload[offload.index("--kv-offloading-size") + 1] == "40" and "--kv-transfer-config" not in offload
    lmcache = vllm_server_command(
        VllmServerConfig(model="m", port=1, lmcache_mp_port=5555, load_format="dummy"), base_env={}
    ).argv
    transfer = json.loads(lmcache[lmcache.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "LMCacheMPConnector"
    assert transfer["kv_connector_extra_config"] == {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555}
    assert lmcache[lmcache.index("--load-format") + 1] == "dummy"
    with pytest.raises(ValueError, match="one KV connector"):
        VllmServerConfig(model="m", port=1, pool_socket="/p.sock", lmcache_mp_port=5555)
    with pytest.raises(ValueError, match="one KV connector"):
        VllmServerConfig(model="m", port=1, pool_socket="/p.sock", kv_offloading_gib=1)


def test_no_benchmark_or_module_builds_a_vllm_server_command_of_its_own():
    """launch.vllm_server_command is the one place a vLLM server's command line is built. Fails when a script under
    benchmarks/ or a module of kvshare/ spells vLLM's server module itself (benchmarks/vllm_gpu.py once did)."""
    root = pathlib.Path(__file__).resolve().parents[3]
    spelled = [
        str(path.relative_to(root))
        for folder in ("kvshare", "benchmarks")
        for path in (root / folder).rglob("*")
        if path.suffix in (".py", ".sh") and "vllm.entrypoints.openai.api_server" in path.read_text()
    ]
    assert spelled == ["kvshare/integrations/vllm/launch.py"]


def _vllm_replicas(tmp_path, device: str, replicas: int = 2, replica_args: tuple = ()) -> list[tuple[list, dict]]:
    from kvshare.launch import Cluster, ClusterConfig

    (tmp_path / "config.json").write_text("{}")
    cluster = Cluster(
        ClusterConfig(
            engine="vllm",
            model=str(tmp_path),
            device=device,
            num_replicas=replicas,
            vllm_python="/venv/bin/python",
            replica_args=replica_args,
        )
    )
    return [cluster._replica_command(i, []) for i in range(replicas)]


def _flag(argv: list, name: str):
    return argv[argv.index(name) + 1] if name in argv else None


def test_up_vllm_two_replicas_share_one_gpu(tmp_path):
    """Fails when replicas on one GPU each take vLLM's default 0.9 of it (the second then cannot start)."""
    (a, env_a), (b, env_b) = _vllm_replicas(tmp_path, "cuda")
    assert _flag(a, "--gpu-memory-utilization") == _flag(b, "--gpu-memory-utilization") == "0.45"
    for argv, env in ((a, env_a), (b, env_b)):
        assert "--enforce-eager" not in argv and "--max-num-batched-tokens" not in argv
        assert "--max-model-len" not in argv and "VLLM_CPU_KVCACHE_SPACE" not in env
        assert argv[0] == "/venv/bin/python"
    assert _flag(a, "--port") != _flag(b, "--port")
    assert "CUDA_VISIBLE_DEVICES" not in env_a or env_a["CUDA_VISIBLE_DEVICES"] == env_b["CUDA_VISIBLE_DEVICES"]
    (own, _), _ = _vllm_replicas(tmp_path, "cuda", replica_args=("--gpu-memory-utilization=0.3",))
    assert _flag(own, "--gpu-memory-utilization") is None and "--gpu-memory-utilization=0.3" in own


def test_up_vllm_one_replica_per_gpu(tmp_path):
    """Fails when a list of GPUs is refused for vLLM replicas or each replica does not see only its own GPU."""
    (a, env_a), (b, env_b) = _vllm_replicas(tmp_path, "cuda:0,cuda:1")
    assert (env_a["CUDA_VISIBLE_DEVICES"], env_b["CUDA_VISIBLE_DEVICES"]) == ("0", "1")
    assert _flag(a, "--gpu-memory-utilization") is None and _flag(b, "--gpu-memory-utilization") is None
    ((c, env_c),) = _vllm_replicas(tmp_path, "cuda:1", replicas=1)
    assert env_c["CUDA_VISIBLE_DEVICES"] == "1"
    three = _vllm_replicas(tmp_path, "cuda:0,cuda:1", replicas=3)  # cycled: two share GPU 0
    assert [_flag(argv, "--gpu-memory-utilization") for argv, _ in three] == ["0.45", None, "0.45"]
    from kvshare.launch import ClusterConfig

    with pytest.raises(ValueError, match="not mixed"):
        ClusterConfig(engine="vllm", device="cpu,cuda:0")


def test_vllm_python_found_on_path(tmp_path, monkeypatch):
    import importlib.util
    import os

    from kvshare import launch

    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    (tmp_path / "venv" / "bin" / "vllm").write_text(f"#!{python}\nimport vllm\n")
    os.chmod(tmp_path / "venv" / "bin" / "vllm", 0o755)
    monkeypatch.setenv("PATH", f"{python.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # this python has no vLLM
    assert launch.find_vllm_python() == str(python)


def test_vllm_replicas_on_one_gpu_start_one_after_another():
    """Fails when replicas sharing a GPU start together (vLLM then sizes the second's KV from a busy GPU)."""
    from kvshare.launch import ClusterConfig, starts_after

    shared = ClusterConfig(engine="vllm", device="cuda", num_replicas=3)
    assert [starts_after(shared, i) for i in range(3)] == [[], [0], [0, 1]]
    apart = ClusterConfig(engine="vllm", device="cuda:0,cuda:1", num_replicas=2)
    assert [starts_after(apart, i) for i in range(2)] == [[], []]
    sized = ClusterConfig(engine="vllm", device="cuda", num_replicas=2, replica_args=("--kv-cache-memory-bytes=24G",))
    assert starts_after(sized, 1) == []
    assert starts_after(ClusterConfig(engine="vllm", num_replicas=2), 1) == []  # CPU
    assert starts_after(ClusterConfig(engine="builtin", device="cuda", num_replicas=2), 1) == []
