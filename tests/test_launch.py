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
