import dataclasses
import hashlib
import struct

import pytest

from kvshare.keys import (
    KEY_BYTES,
    Namespace,
    chunk_keys,
    config_fingerprint,
    extend_chunk_keys,
    namespace_digest,
    num_full_chunks,
    weights_fingerprint,
)

NS = Namespace(model_id="m", weights_fingerprint="w", kv_dtype="float32", num_layers=4, num_kv_heads=2, head_dim=64)


def test_chain_matches_the_definition():
    digest = namespace_digest(NS)
    tokens = list(range(600))
    keys = chunk_keys(digest, tokens, chunk_tokens=256)
    assert len(keys) == 2  # 600 tokens: two full chunks, the tail of 88 is not a chunk
    k0 = hashlib.blake2b(digest + struct.pack("<256I", *tokens[:256]), digest_size=16).digest()
    k1 = hashlib.blake2b(k0 + struct.pack("<256I", *tokens[256:512]), digest_size=16).digest()
    assert keys == [k0, k1]
    assert all(len(k) == KEY_BYTES for k in keys)


def test_prefix_property_and_divergence():
    digest = namespace_digest(NS)
    a = list(range(1024))
    b = a[:512] + [7] * 512
    ka, kb = chunk_keys(digest, a, 256), chunk_keys(digest, b, 256)
    assert ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]
    c = [1] + a[1:]  # changing one early token changes every later key
    assert all(x != y for x, y in zip(ka, chunk_keys(digest, c, 256)))


def test_extend_reuses_computed_keys():
    digest = namespace_digest(NS)
    tokens = list(range(2000))
    full = chunk_keys(digest, tokens, 256)
    assert extend_chunk_keys(full[:3], digest, tokens, 256) == full
    assert extend_chunk_keys([], digest, tokens, 256) == full


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "other"},
        {"weights_fingerprint": "x"},
        {"kv_dtype": "bfloat16"},
        {"num_layers": 5},
        {"num_kv_heads": 4},
        {"head_dim": 128},
        {"chunk_tokens": 512},
        {"kv_precision": "fp8"},
        {"engine_family": "vllm"},
        {"tp_rank": 1, "tp_size": 2},
        {"lora_id": "adapter"},
        {"tenant_salt": "tenant-b"},
        {"config_id": "rope-theta-5e5"},
    ],
)
def test_every_namespace_field_changes_the_digest(change):
    fields = NS.__dict__ | change
    assert namespace_digest(Namespace(**fields)) != namespace_digest(NS)


def test_namespace_digest_is_stable():
    # a fixed value: a change of encoding would silently orphan every stored chunk
    assert namespace_digest(NS) == namespace_digest(Namespace(**NS.__dict__))
    assert NS.with_tenant("t").tenant_salt == "t"


def test_bad_inputs():
    with pytest.raises(ValueError):
        chunk_keys(b"short", [1] * 256)
    with pytest.raises(ValueError):
        chunk_keys(namespace_digest(NS), [-1] * 256)
    with pytest.raises(ValueError):
        Namespace(model_id="m", weights_fingerprint="w", kv_dtype="f", num_layers=0, num_kv_heads=1, head_dim=1)
    assert num_full_chunks(255) == 0 and num_full_chunks(512) == 2 and num_full_chunks(0) == 0


def test_weights_fingerprint_depends_on_config_and_file_digests():
    base = weights_fingerprint(b"{}", [b"d1", b"d2"])
    assert base != weights_fingerprint(b"{ }", [b"d1", b"d2"])
    assert base != weights_fingerprint(b"{}", [b"d1", b"d3"])
    assert base != weights_fingerprint(b"{}", [b"d1d2"])  # length-prefixed: no ambiguity
    assert base != weights_fingerprint(b"{}d", [b"1", b"d2"])


def test_config_fingerprint_is_canonical_and_sees_every_value():
    base = config_fingerprint({"rope_theta": 1e6, "dtype": "bfloat16"})
    assert base == config_fingerprint({"dtype": "bfloat16", "rope_theta": 1e6})  # key order is not identity
    assert base != config_fingerprint({"rope_theta": 5e5, "dtype": "bfloat16"})
    assert config_fingerprint({"x": object}) != config_fingerprint({"x": None})  # unknown values still count


DET = {"is_deterministic": True, "grid_tokens": 256, "kernel_build": "cuda|NVIDIA H200|sm_90"}


def test_the_deterministic_mode_keeps_its_pages_apart():
    det = Namespace(**(NS.__dict__ | DET))
    assert namespace_digest(det) != namespace_digest(NS)
    for change in ({"grid_tokens": 512}, {"kernel_build": "cuda|NVIDIA A100|sm_80"}):  # another grid, another build
        assert namespace_digest(Namespace(**(det.__dict__ | change))) != namespace_digest(det)
    assert namespace_digest(det.with_tenant("t")) != namespace_digest(det)


def test_the_default_mode_digest_is_what_it_was_before_the_mode_existed():
    import hashlib
    import json

    # nor before kv_layout_id, config_id and state_layout_id existed (a namespace without them keeps its digests)
    later = ("kv_layout_id", "config_id", "state_layout_id")
    fields = {k: v for k, v in NS.__dict__.items() if k not in DET and k not in later}
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    before = hashlib.blake2b(b"kvshare-ns-v1\0" + canonical.encode(), digest_size=16).digest()
    assert namespace_digest(NS) == before
    assert namespace_digest(dataclasses.replace(NS, kv_layout_id="vllm0.32|cpu")) != before


def test_another_state_layout_is_another_namespace():
    """A hybrid model's checkpoints are read only by a replica whose GDN state has the same layout (dtypes, conv)."""
    from kvshare.state_layout import StateLayout

    shape = dict(num_layers=6, num_value_heads=4, key_head_dim=32, value_head_dim=32, conv_dim=256, conv_kernel=4)
    bf16, fp32 = StateLayout(**shape).fingerprint(), StateLayout(**shape, conv_dtype="float32").fingerprint()
    shorter_conv = StateLayout(**(shape | {"conv_kernel": 3})).fingerprint()
    digests = {namespace_digest(dataclasses.replace(NS, state_layout_id=f)) for f in ("", bf16, fp32, shorter_conv)}
    assert len(digests) == 4


@pytest.mark.parametrize(
    "fields",
    [
        {"is_deterministic": True},  # no grid
        {"is_deterministic": True, "grid_tokens": 300, "kernel_build": "x"},  # not a multiple of the chunk
        {"is_deterministic": True, "grid_tokens": 256},  # no kernel build
        {"grid_tokens": 256},  # a grid outside the mode
    ],
)
def test_a_deterministic_namespace_is_checked(fields):
    with pytest.raises(ValueError):
        Namespace(**(NS.__dict__ | fields))


def test_a_numpy_array_of_ids_gives_the_keys_of_the_list_and_its_range_is_checked():
    import numpy as np

    ids = list(range(1000, 1000 + 5 * 16 + 3))
    digest = bytes(KEY_BYTES)
    for dtype in (np.int64, np.int32, np.uint32):
        assert chunk_keys(digest, np.asarray(ids, dtype=dtype), 16) == chunk_keys(digest, ids, 16)
    with pytest.raises(ValueError, match="token ids must lie in"):
        chunk_keys(digest, np.asarray([5] * 16 + [-1] * 16, dtype=np.int64), 16)
