"""kvshare up's child commands (no process started)."""

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
    """--device cuda:0,cuda:1 gives each replica its own GPU (cycled over more replicas); one device is everyone's."""
    import pytest

    cluster = Cluster(ClusterConfig(num_replicas=3, device="cuda:0,cuda:1"))
    cluster.pool_socket = str(tmp_path / "pool.sock")
    devices = [argv[argv.index("--device") + 1] for argv, _ in (cluster._replica_command(i, []) for i in range(3))]
    assert devices == ["cuda:0", "cuda:1", "cuda:0"]
    single = ClusterConfig(num_replicas=2, device="cuda")
    assert [single.replica_device(i) for i in range(2)] == ["cuda", "cuda"]
    for bad in ("cuda:0,", "gpu", "cuda:x,cuda:1"):
        with pytest.raises(ValueError, match="--device takes cpu, cuda, cuda:N or a comma list"):
            ClusterConfig(device=bad)
    with pytest.raises(ValueError, match="applies to built-in replicas"):
        ClusterConfig(engine="vllm", model=str(tmp_path), device="cuda:0,cuda:1")
