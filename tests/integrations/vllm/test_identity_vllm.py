"""The connector's namespace from vLLM's own resolved config (suite ``vllm``: run with the vLLM venv's python).

vLLM builds its engine config for each checkpoint (EngineArgs.create_engine_config: the hf config
after --hf-overrides, dtype, KV cache dtype); the connector's namespace of it (vllm_namespace, the
call KVShareConnector makes) keys pages through a real pool with the connector's scheduler and worker.
"""

from __future__ import annotations

import shutil

import pytest

import tests.integrations.vllm.pool_replicas as shared
from kvshare.integrations.vllm.identity import vllm_namespace
from kvshare.integrations.vllm.launch import VllmServerConfig
from kvshare.keys import namespace_digest
from tests.integrations.vllm.pool_replicas import LAYOUT, PROMPT, Replica, pool_fixture  # noqa: F401
from tests.integrations.vllm.servers import (
    complete,
    free_port,
    private_pool,
    provenance,
    running_servers,
    vllm_python,
    vllm_suite_marks,
)
from tests.integrations.vllm.test_cache_salt import matched, prefill
from tests.integrations.vllm.tiny_model import make_model_dir

pytestmark = vllm_suite_marks()
REUSABLE = 256
ROPE_5E5 = {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}


def engine_config(model_dir: str, **args):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=model_dir, dtype=args.pop("dtype", "float32"), max_model_len=4096, **args
    ).create_engine_config()


def checkpoints(work):
    """(A, B, copy): A and B both called ``model``, B with one weight changed; copy: A renamed elsewhere."""
    a = shutil.copytree(make_model_dir(str(work / "tiny")), work / "one" / "model")
    b = shutil.copytree(a, work / "two" / "model")
    with open(b / "model.safetensors", "r+b") as f:  # the lowest byte of the file's last float32
        f.seek(-4, 2)
        byte = f.read(1)
        f.seek(-4, 2)
        f.write(bytes([byte[0] ^ 1]))
    return str(a), str(b), str(shutil.copytree(a, work / "renamed-copy"))


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory):
    """Namespaces of A and B (both called ``model``, B with one weight changed), A's renamed copy, and A
    served with --hf-overrides changing the rope and with another dtype."""
    work = tmp_path_factory.mktemp("identity")
    cache = pytest.MonkeyPatch()
    cache.setenv("XDG_CACHE_HOME", str(work / "cache"))
    a, b, copy = checkpoints(work)
    configs = {
        "A": engine_config(a),
        "B": engine_config(b),
        "copy": engine_config(copy),
        "rope": engine_config(a, hf_overrides=ROPE_5E5),
        "bf16": engine_config(a, dtype="bfloat16"),
    }
    yield {name: vllm_namespace(config, LAYOUT, "vllm") for name, config in configs.items()}
    cache.undo()


def test_changed_weights_never_share_a_page_a_renamed_copy_does(namespaces, pool, monkeypatch):  # noqa: F811
    """Fails on the directory-name model_id with the header-only fingerprint (B matched A's 256 tokens)."""
    replicas = {}
    for seed, name in enumerate(("A", "B", "copy", "rope"), start=1):
        monkeypatch.setattr(shared, "NAMESPACE", namespaces[name])  # what Replica's scheduler keys by
        replicas[name] = Replica(pool, name, seed=seed)
    try:
        assert prefill(replicas["A"], "r1", PROMPT, None) == 0
        assert matched(replicas["B"], "q1", PROMPT, None) == 0
        assert matched(replicas["rope"], "q2", PROMPT, None) == 0  # --hf-overrides changing the rope
        assert matched(replicas["copy"], "q3", PROMPT, None) == REUSABLE
    finally:
        for replica in replicas.values():
            replica.close()


def test_overrides_and_dtype_change_the_namespace_not_the_weights(namespaces):
    digests = {name: namespace_digest(ns) for name, ns in namespaces.items()}
    assert len({digests[n] for n in ("A", "B", "rope", "bf16")}) == 4 and digests["copy"] == digests["A"]
    assert namespaces["rope"].weights_fingerprint == namespaces["A"].weights_fingerprint
    assert namespaces["rope"].config_id != namespaces["A"].config_id != namespaces["bf16"].config_id


def test_vllm_servers_of_changed_weights_never_share_a_renamed_copy_does(tmp_path):
    """Three vLLM servers with the connector on one pool: A computes a prompt; B (also called ``model``, one
    weight changed) takes nothing from the pool; the renamed copy of A takes every full chunk.
    Fails on the directory-name model_id with the header-only fingerprint (B took A's chunks)."""
    a, b, copy = checkpoints(tmp_path)
    prompt = list(range(3, 259)) * 2 + [7] * 20  # two full chunks of 256 and a tail
    with private_pool("kvshare-id", "256MiB", ("--extent-size", "64MiB")) as pool:
        common = dict(
            python=vllm_python(),
            dtype="float32",
            max_model_len=2048,
            kv_cache_gib=1,
            max_num_batched_tokens=256,
            pool_socket=pool.socket_path,
            pool_retry_s=1.0,
        )
        configs = {
            name: VllmServerConfig(model=path, port=free_port(), replica=name, **common)
            for name, path in (("A", a), ("B", b), ("copy", copy))
        }
        with running_servers(configs, str(tmp_path)) as servers:
            assert provenance(complete(servers["A"], prompt, max_tokens=2))["pool_tokens"] == 0
            assert provenance(complete(servers["B"], prompt, max_tokens=2))["pool_tokens"] == 0
            assert provenance(complete(servers["copy"], prompt, max_tokens=2))["pool_tokens"] == 512
