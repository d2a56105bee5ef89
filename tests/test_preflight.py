"""kvshare.preflight: the checks made before anything starts."""

import json
import socket

import pytest

from kvshare import preflight
from kvshare.errors import UserError
from kvshare.layout import KVLayout


def test_model_is_a_directory_with_config_json_or_a_preset(tmp_path):
    preflight.check_model("tiny")
    with pytest.raises(UserError, match="/nope: no such directory, and not a preset"):
        preflight.check_model("/nope")
    with pytest.raises(UserError, match="holds no config.json"):
        preflight.check_model(str(tmp_path))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_attention_heads": 4,
                "hidden_size": 256,
                "vocab_size": 260,
                "intermediate_size": 1024,
                "num_hidden_layers": 3,
                "num_key_value_heads": 2,
                "dtype": "bfloat16",
            }
        )
    )
    preflight.check_model(str(tmp_path))
    assert preflight.model_layout(str(tmp_path), 256) == KVLayout(3, 2, 64, "bfloat16", 256)


def test_a_port_with_a_listener_is_named():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(UserError, match=f"port {port} \\(replica1\\) on 127.0.0.1 is in use"):
            preflight.check_ports_free("127.0.0.1", {port: "replica1"})
    preflight.check_ports_free("127.0.0.1", {port: "replica1"})  # closed: free again


def test_pool_sizes_below_the_minimum_or_above_memory_are_refused():
    with pytest.raises(UserError, match="below the minimum"):
        preflight.check_pool_size(1024)
    limit, what = preflight.memory_limit()
    with pytest.raises(UserError, match="larger than"):
        preflight.check_pool_size(limit + (1 << 30))
    preflight.check_pool_size(64 << 20)


def test_a_pool_must_hold_one_page_of_the_model():
    tiny = preflight.model_layout("tiny", 256)  # 2 MiB pages
    preflight.check_pool_holds_a_page(2 << 20, 256 << 20, tiny, "tiny")
    with pytest.raises(UserError, match="larger than the pool, 1.00 MiB"):
        preflight.check_pool_holds_a_page(1 << 20, 256 << 20, tiny, "tiny")
    with pytest.raises(UserError, match="extent"):
        preflight.check_pool_holds_a_page(64 << 20, 1 << 20, tiny, "tiny")


def test_socket_directory_must_exist(tmp_path):
    preflight.check_socket_dir(str(tmp_path / "pool.sock"))
    with pytest.raises(UserError, match=f"the directory {tmp_path}/missing does not exist"):
        preflight.check_socket_dir(str(tmp_path / "missing" / "pool.sock"))
