"""--model-revision reaches every replica: serve's EngineConfig, up's built-in and vLLM replica commands."""

from __future__ import annotations

import json

from kvshare.cli import build_parser
from kvshare.commands.serve import engine_config
from kvshare.launch import Cluster, ClusterConfig


def test_serve_maps_the_flag_onto_the_engine_config():
    args = build_parser().parse_args(["serve", "--model", "tiny", "--model-revision", "0123abcd"])
    assert engine_config(args).model_revision == "0123abcd"
    assert engine_config(build_parser().parse_args(["serve", "--model", "tiny"])).model_revision == ""  # off


def test_up_passes_the_revision_to_every_replica(tmp_path):
    args = build_parser().parse_args(["up", "--model-revision", "0123abcd"])
    assert args.model_revision == "0123abcd"
    builtin = Cluster(ClusterConfig(num_replicas=2, model_revision="0123abcd"))
    builtin.pool_socket = str(tmp_path / "pool.sock")
    for i in range(2):
        argv, _env = builtin._replica_command(i, [])
        assert argv[argv.index("--model-revision") + 1] == "0123abcd"
    vllm = Cluster(ClusterConfig(engine="vllm", model=str(tmp_path), model_revision="0123abcd"))
    vllm.pool_socket = builtin.pool_socket
    argv, _env = vllm._replica_command(0, [])
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_extra_config"]["model_revision"] == "0123abcd"
    plain = Cluster(ClusterConfig(engine="vllm", model=str(tmp_path)))
    plain.pool_socket = builtin.pool_socket
    argv, _env = plain._replica_command(0, [])
    assert "model_revision" not in argv[argv.index("--kv-transfer-config") + 1]  # off by default


def test_serve_maps_no_reuse_in_place_onto_the_engine_config():
    assert engine_config(build_parser().parse_args(["serve"])).reuse_in_place  # on by default
    assert not engine_config(build_parser().parse_args(["serve", "--no-reuse-in-place"])).reuse_in_place
