"""The vLLM connector's namespace: the weights' bytes, the configuration vLLM runs, LoRA adapters by bytes.

No vLLM needed: vLLM's config is stood in for by objects with the attributes the connector reads
(tests/integrations/vllm/test_identity_vllm.py builds real ones); pages go through a real pool
with the connector's scheduler and worker (pool_replicas' Replica).
"""

from __future__ import annotations

import os
import struct
from types import SimpleNamespace

import pytest

import tests.integrations.vllm.pool_replicas as shared
from kvshare.integrations.vllm.identity import LoraIdentities, vllm_namespace
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.keys import namespace_digest
from tests.integrations.vllm.pool_replicas import LAYOUT, PROMPT, Replica, pool_fixture  # noqa: F401
from tests.integrations.vllm.test_cache_salt import matched, prefill
from tests.test_identity import one_byte_changed, write_checkpoint

REUSABLE = 256  # PROMPT's four full chunks


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


class HfConfig(dict):
    def to_dict(self) -> dict:
        return dict(self)


def vllm_config(
    model_dir: str,
    dtype: str = "torch.float32",
    quantization=None,
    kv_cache_dtype: str = "auto",
    max_model_len: int = 4096,
    **hf,
) -> SimpleNamespace:
    """What the connector reads of vLLM's config (hf_config as vLLM resolved it, after --hf-overrides)."""
    hf_config = HfConfig(
        {"model_type": "llama", "rope_theta": 1e6, "_name_or_path": model_dir, "transformers_version": "4.57.0", **hf}
    )
    model = SimpleNamespace(
        model=model_dir, hf_config=hf_config, dtype=dtype, quantization=quantization, max_model_len=max_model_len
    )
    return SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype=kv_cache_dtype))


def digest(config) -> bytes:
    return namespace_digest(vllm_namespace(config, LAYOUT, "vllm"))


def test_two_checkpoints_called_model_never_share_a_page_a_renamed_copy_does(tmp_path, pool, monkeypatch):  # noqa: F811
    """Fails on the directory-name model_id with the header-only fingerprint: B's namespace was A's."""
    a = write_checkpoint(tmp_path / "one" / "model")
    b = write_checkpoint(tmp_path / "two" / "model", one_byte_changed())
    copy = write_checkpoint(tmp_path / "copy-of-one")
    namespaces = {
        name: vllm_namespace(vllm_config(path), LAYOUT, "vllm") for name, path in (("A", a), ("B", b), ("copy", copy))
    }
    replicas = {}
    for name, namespace in namespaces.items():
        monkeypatch.setattr(shared, "NAMESPACE", namespace)  # what Replica's scheduler keys its requests by
        replicas[name] = Replica(pool, name, seed=len(replicas) + 1)
    try:
        assert prefill(replicas["A"], "r1", PROMPT, None) == 0
        assert matched(replicas["B"], "q1", PROMPT, None) == 0
        assert matched(replicas["copy"], "q2", PROMPT, None) == REUSABLE
    finally:
        for replica in replicas.values():
            replica.close()


def test_what_vllm_runs_the_weights_with_is_part_of_the_namespace(tmp_path):
    a = write_checkpoint(tmp_path / "model")
    base = digest(vllm_config(a))
    assert digest(vllm_config(a, transformers_version="4.58.0")) == base  # provenance, not configuration
    changed = {
        "hf-overrides rope": vllm_config(a, rope_theta=5e5),
        "rope scaling": vllm_config(a, rope_parameters={"rope_type": "yarn", "factor": 4.0}),
        "dtype": vllm_config(a, dtype="torch.bfloat16"),
        "quantization": vllm_config(a, quantization="fp8"),
        "kv cache dtype": vllm_config(a, kv_cache_dtype="fp8_e4m3"),
    }
    digests = {name: digest(config) for name, config in changed.items()}
    assert base not in digests.values() and len(set(digests.values())) == len(digests)
    # max_model_len enters only where the rope is scaled (where it may change the rope)
    assert digest(vllm_config(a, max_model_len=2048)) == base
    yarn = {"rope_type": "yarn", "factor": 4.0}
    assert digest(vllm_config(a, max_model_len=2048, rope_parameters=yarn)) != digests["rope scaling"]


def test_a_model_revision_names_identity_without_reading_the_weights(tmp_path):
    config = vllm_config(str(tmp_path / "not-downloaded"))
    ns = vllm_namespace(config, LAYOUT, "vllm", model_revision="0123abcd")
    assert ns.model_id == "0123abcd" and ns.weights_fingerprint == ""
    assert ConnectorConfig.from_extra_config({"model_revision": "0123abcd"}).model_revision == "0123abcd"
    with pytest.raises(ValueError, match="model_revision"):
        ConnectorConfig.from_extra_config({"model_id": "my-model"})


def write_adapter(path, payload: bytes) -> str:
    os.makedirs(path)
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        f.write('{"r": 8, "lora_alpha": 16}')
    with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", 2) + b"{}" + payload)
    return str(path)


def lora(name: str, path: str, int_id: int = 1) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_path=path, lora_int_id=int_id)


def test_lora_adapters_share_by_bytes_not_by_name(tmp_path, pool):  # noqa: F811
    """Fails on the name-keyed lora_id: the renamed adapter misses, the other adapter of one name hits."""
    one = write_adapter(tmp_path / "one", bytes(64))
    renamed = write_adapter(tmp_path / "renamed", bytes(64))
    other = write_adapter(tmp_path / "other", b"\x01" + bytes(63))
    ids = LoraIdentities()
    a, b = Replica(pool, "A", seed=1), Replica(pool, "B", seed=2)
    try:
        s = a.scheduler
        s.add_request("r1", PROMPT, None, None, lora_id=ids.of(lora("support", one)))
        external = s.match("r1", 0)
        s.allocated("r1", external, 0)
        plan = s.plan_step([shared.ScheduledRequest("r1", external, len(PROMPT), shared.BLOCKS_A)])
        for spec in plan.stores:
            a.worker.store(spec)
        s.finish("r1")

        def hits(request) -> int:
            b.scheduler.add_request("q", PROMPT, None, None, lora_id=ids.of(request))
            try:
                return b.scheduler.match("q", 0)
            finally:
                b.scheduler.finish("q")

        assert hits(lora("support-v2", renamed, int_id=2)) == REUSABLE  # same bytes, another name: shares
        assert hits(lora("support", other, int_id=3)) == 0  # same name, other bytes: never
        assert hits(None) == 0  # the base model never reads an adapter's pages
    finally:
        a.close(), b.close()


def test_an_adapter_that_cannot_be_read_is_never_shared(tmp_path):
    ids = LoraIdentities()
    assert ids.of(None) == ""
    assert ids.of(lora("hub-adapter", "some-org/some-adapter")) is None  # not a local directory
    assert ids.of(lora("missing", str(tmp_path / "gone"))) is None
