"""kvshare up's child commands (no process started)."""

import json
import os

from kvshare.keys import DEFAULT_CHUNK_TOKENS
from kvshare.launch import Cluster, ClusterConfig


def test_vllm_replicas_prefill_in_steps_of_one_pool_chunk(tmp_path):
    """Step boundaries on chunk boundaries: a replica loading k chunks recomputes the tail in the same steps."""
    cluster = Cluster(ClusterConfig(engine="vllm", model=str(tmp_path), replica_args=("--max-num-seqs", "8")))
    cluster.pool_socket = str(tmp_path / "pool.sock")
    argv, _env = cluster._replica_command(0, [])
    budget = argv[argv.index("--max-num-batched-tokens") + 1]
    assert int(budget) == DEFAULT_CHUNK_TOKENS
    assert argv[-2:] == ["--max-num-seqs", "8"]  # --replica-arg comes last: it overrides the defaults


def test_one_device_per_replica_as_a_comma_list(tmp_path):
    """--device cuda:0,cuda:1 gives each replica its own GPU (cycled over more replicas), seen as its only one;
    one device is everyone's, with the environment as inherited."""
    import pytest

    cluster = Cluster(ClusterConfig(num_replicas=3, device="cuda:0,cuda:1"))
    cluster.pool_socket = str(tmp_path / "pool.sock")
    commands = [cluster._replica_command(i, []) for i in range(3)]
    assert [argv[argv.index("--device") + 1] for argv, _ in commands] == ["cuda", "cuda", "cuda"]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in commands] == ["0", "1", "0"]
    single = Cluster(ClusterConfig(num_replicas=2, device="cuda:1"))
    single.pool_socket = cluster.pool_socket
    argv, env = single._replica_command(1, [])
    assert argv[argv.index("--device") + 1] == "cuda:1"
    assert env.get("CUDA_VISIBLE_DEVICES") == __import__("os").environ.get("CUDA_VISIBLE_DEVICES")
    for bad in ("cuda:0,", "gpu", "cuda:x,cuda:1"):
        with pytest.raises(ValueError, match="--device takes cpu, cuda, cuda:N or a comma list"):
            ClusterConfig(device=bad)
    ClusterConfig(engine="vllm", model=str(tmp_path), device="cuda:0,cuda:1")  # vLLM replicas: a GPU each too
    with pytest.raises(ValueError, match="not mixed"):
        ClusterConfig(engine="vllm", model=str(tmp_path), device="cuda:0,cpu")


def test_vllm_replicas_publish_their_own_kv_events_on_their_port_and_topic(tmp_path):
    cluster = Cluster(ClusterConfig(engine="vllm", model=str(tmp_path), replica_kv_events_port=5600))
    cluster.pool_socket = str(tmp_path / "pool.sock")
    argv, _env = cluster._replica_command(1, [])
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5601",
                      "topic": f"kv@replica1@{tmp_path.name}"}
    plain = Cluster(ClusterConfig(engine="vllm", model=str(tmp_path)))
    plain.pool_socket = cluster.pool_socket
    assert "--kv-events-config" not in plain._replica_command(0, [])[0]


def test_vllm_replicas_leave_their_rendezvous_files_in_a_directory_the_cluster_removes(tmp_path):
    """Fails when a vLLM replica inherits TMPDIR: its tensor-parallel ranks' vllm_dist_* files (vLLM's
    get_file_store_init_method) stayed behind in /dev/shm or /tmp after every run."""
    (tmp_path / "config.json").write_text("{}")
    cluster = Cluster(ClusterConfig(engine="vllm", model=str(tmp_path), tensor_parallel_size=2))
    dirs = []
    for i in range(2):
        _, env = cluster._replica_command(i, [])
        dirs.append(env["TMPDIR"])
        with open(os.path.join(env["TMPDIR"], "vllm_dist_0123"), "w") as f:  # what a rank leaves
            f.write("x")
    assert len(set(dirs)) == 2 and all(d.startswith(cluster._tmp.name) for d in dirs)
    assert oct(os.stat(cluster._tmp.name).st_mode & 0o777) == "0o700"
    cluster.stop()
    assert not any(os.path.exists(d) for d in dirs)
