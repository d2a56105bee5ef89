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


def test_vllm_replicas_of_a_hybrid_model_get_what_its_state_needs(tmp_path):
    """A Gated DeltaNet hybrid: vLLM's block size for it (640 for this shape on CPU) as block, chunk and step, the
    GDN state snapshotted at block boundaries; up says so."""
    text = dict(
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_conv_kernel_dim=4, head_dim=64, num_key_value_heads=2, num_attention_heads=4, hidden_size=256,
        layer_types=["linear_attention"] * 3 + ["full_attention"], dtype="bfloat16",
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text}))
    cluster = Cluster(ClusterConfig(engine="vllm", model=str(tmp_path)))
    cluster.pool_socket = str(tmp_path / "pool.sock")
    argv, _env = cluster._replica_command(0, [])
    flag = lambda name: argv[argv.index(name) + 1]  # noqa: E731
    assert (flag("--block-size"), flag("--max-num-batched-tokens"), flag("--mamba-cache-mode")) == (
        "640",
        "640",
        "align",
    )
    assert json.loads(flag("--kv-transfer-config"))["kv_connector_extra_config"]["chunk_tokens"] == 640
    assert "--mamba-cache-mode align" in cluster.engine_settings


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
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:5601",
        "topic": f"kv@replica1@{tmp_path.name}",
    }
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


def _vllm_cluster(tmp_path, **fields) -> Cluster:
    cluster = Cluster(ClusterConfig(engine="vllm", model=str(tmp_path), **fields))
    cluster.pool_socket = str(tmp_path / "pool.sock")
    cluster.account_key_file = cluster._account_key_file()
    return cluster


def _connector_extra(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]


def test_vllm_tenants_authenticate_at_the_router_with_a_key_up_writes_itself(tmp_path, monkeypatch):
    """Fails when up refuses --api-key / --tenant-header with vLLM replicas, or leaves the router unaware of
    the engine behind it (it would not salt the tenants' requests) or without the account key."""
    monkeypatch.delenv("KVSHARE_ACCOUNT_KEY", raising=False)
    cluster = _vllm_cluster(tmp_path, host="0.0.0.0", api_keys=("key-a-0123456789",), tenant_header="X-Tenant")
    try:
        path = cluster.account_key_file
        assert path.startswith(cluster._tmp.name + os.sep)  # the cluster's private directory, removed on stop
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        with open(path) as f:
            key = f.read()
        assert len(key) >= 32
        router = cluster._router_command([])
        flags = {router[i]: router[i + 1] for i in range(len(router) - 1) if router[i].startswith("--")}
        assert flags["--api-key"] == "key-a-0123456789" and flags["--tenant-header"] == "X-Tenant"
        assert flags["--engine"] == "vllm" and flags["--account-key-file"] == path
        assert flags["--host"] == "0.0.0.0"  # the router faces the clients ...
        for i in range(2):
            argv, env = cluster._replica_command(i, [])
            assert argv[argv.index("--host") + 1] == "127.0.0.1"  # ... the replicas only it
            assert _connector_extra(argv)["account_key_file"] == path
            assert "key-a-0123456789" not in argv and key not in " ".join(argv + router)  # never a command line
            assert key not in env.values()
        assert cluster.replica_urls[0].startswith("http://127.0.0.1:")
    finally:
        cluster.stop()
    assert not os.path.exists(path)


def test_a_users_account_key_wins_over_the_one_up_writes(tmp_path, monkeypatch):
    import pytest

    monkeypatch.delenv("KVSHARE_ACCOUNT_KEY", raising=False)
    given = tmp_path / "account.key"
    given.write_text("a-key-the-user-chose-0123")
    cluster = _vllm_cluster(tmp_path, account_key_file=str(given))
    assert cluster.account_key_file == str(given) and cluster._tmp is None  # nothing written
    assert _connector_extra(cluster._replica_command(0, [])[0])["account_key_file"] == str(given)
    router = cluster._router_command([])
    assert router[router.index("--account-key-file") + 1] == str(given)
    cluster.stop()
    monkeypatch.setenv("KVSHARE_ACCOUNT_KEY", "a-key-in-the-environment-01")  # every child inherits it
    from_env = _vllm_cluster(tmp_path)
    assert from_env.account_key_file == "" and "--account-key-file" not in from_env._router_command([])
    assert "account_key_file" not in _connector_extra(from_env._replica_command(0, [])[0])
    from_env.stop()
    with pytest.raises(ValueError, match="--account-key-file: vLLM replicas"):
        ClusterConfig(account_key_file=str(given))
    builtin = Cluster(ClusterConfig(api_keys=("key-a-0123456789",)))
    assert "--engine" not in builtin._router_command([])  # built-in replicas salt themselves


def test_up_with_vllm_takes_api_keys_and_a_tenant_header(tmp_path, monkeypatch):
    """`kvshare up --engine vllm --api-key K --tenant-header H` parses and reaches the cluster as given."""
    import pytest

    import kvshare.launch
    from kvshare.cli import build_parser
    from kvshare.commands import up
    from kvshare.errors import UserError

    seen = []

    class _Stop(Cluster):
        def start(self, progress=None):
            seen.append(self.config)
            raise RuntimeError("not started in this test")

    monkeypatch.setattr(kvshare.launch, "Cluster", _Stop)
    monkeypatch.setattr("signal.signal", lambda *_: None)  # up's Ctrl-C handler would outlive the test
    args = build_parser().parse_args(
        [
            "up",
            "--engine",
            "vllm",
            "--model",
            str(tmp_path),
            "--api-key",
            "key-a-0123456789",
            "--tenant-header",
            "X-Tenant",
            "--port",
            "18080",
        ]
    )
    with pytest.raises(UserError, match="not started in this test"):
        up.run(args)
    assert seen[0].api_keys == ("key-a-0123456789",) and seen[0].tenant_header == "X-Tenant"


def test_vllm_replicas_take_prefetch_hints_from_the_router_on_private_sockets(tmp_path, monkeypatch):
    """Fails when up leaves the router without each replica's hint address (or the tokenizer for text prompts'
    hints), or a replica's connector without its own; --no-hints (ClusterConfig.hints) and TP > 1 send none."""
    monkeypatch.delenv("KVSHARE_ACCOUNT_KEY", raising=False)
    (tmp_path / "config.json").write_text("{}")
    cluster = _vllm_cluster(tmp_path)
    try:
        addresses = [_connector_extra(cluster._replica_command(i, [])[0])["hint_address"] for i in range(2)]
        assert len(set(addresses)) == 2 and all(a.startswith(cluster._tmp.name + os.sep) for a in addresses)
        assert oct(os.stat(os.path.dirname(addresses[0])).st_mode & 0o777) == "0o700"
        router = cluster._router_command([])
        assert [router[i + 1] for i, flag in enumerate(router) if flag == "--hint-address"] == addresses
        assert router[router.index("--model") + 1] == str(tmp_path)
    finally:
        cluster.stop()
    assert ClusterConfig(engine="vllm", pool_size=None, pool_socket="/run/x/pool.sock").has_hints  # a running pool
    assert not ClusterConfig(engine="vllm", pool_size=None).has_hints  # no pool: nothing to copy ahead
    for fields in ({"hints": False}, {"tensor_parallel_size": 2}):
        quiet = _vllm_cluster(tmp_path, **fields)
        assert "--hint-address" not in quiet._router_command([])
        assert "hint_address" not in _connector_extra(quiet._replica_command(0, [])[0])
        quiet.stop()


def test_up_with_vllm_places_cache_aware_by_default(monkeypatch, tmp_path):
    import pytest

    import kvshare.launch
    from kvshare.cli import build_parser
    from kvshare.commands import up
    from kvshare.errors import UserError

    seen = []

    class _Stop(Cluster):
        def start(self, progress=None):
            seen.append(self.config)
            raise RuntimeError("not started in this test")

    monkeypatch.setattr(kvshare.launch, "Cluster", _Stop)
    monkeypatch.setattr("signal.signal", lambda *_: None)
    for argv, policy, hints in (
        (["--engine", "vllm"], "cache_aware", True),
        (["--engine", "vllm", "--policy", "round_robin", "--no-hints"], "round_robin", False),
        ([], "round_robin", True),
    ):
        with pytest.raises(UserError, match="not started"):
            up.run(build_parser().parse_args(["up", "--model", str(tmp_path), "--port", "18090", *argv]))
        assert (seen[-1].policy, seen[-1].hints) == (policy, hints)


def test_hint_sockets_named_before_the_start_are_the_ones_the_replicas_bind(tmp_path, monkeypatch):
    """bench routing gives a hinting router, started beside the cluster, the replicas' hint sockets before the
    cluster starts. Fails when the start makes a new private directory for the pool's socket (the router then
    names sockets nobody binds: every hint dropped)."""
    import kvshare.launch

    monkeypatch.setenv("KVSHARE_ACCOUNT_KEY", "a-key-in-the-environment-01")
    (tmp_path / "config.json").write_text("{}")
    cluster = Cluster(ClusterConfig(engine="vllm", model=str(tmp_path), pool_size="64MiB", vllm_python="/x/python"))
    named = [cluster.hint_address(i) for i in range(2)]
    spawned = []
    for name in ("_preflight", "_wait_pool", "_wait_http"):
        monkeypatch.setattr(cluster, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(cluster, "_spawn", spawned.append)
    monkeypatch.setattr(kvshare.launch, "point_to_pool", lambda *args: None)
    try:
        cluster.start()
        replicas = [spec for spec in spawned if spec.name.startswith("replica")]
        assert [_connector_extra(list(spec.argv))["hint_address"] for spec in replicas] == named
        assert cluster.pool_socket.startswith(os.path.dirname(os.path.dirname(named[0])))
    finally:
        cluster.stop()
