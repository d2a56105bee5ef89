import pytest

from kvshare.layout import K, KVLayout, V


def test_page_arithmetic():
    lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32", chunk_tokens=256)
    assert lay.slab_bytes == 256 * 2 * 64 * 4
    assert lay.page_bytes == 4 * 2 * lay.slab_bytes
    assert lay.slab_offset(0, K) == 0
    assert lay.slab_offset(0, V) == lay.slab_bytes
    assert lay.slab_offset(3, V) == lay.page_bytes - lay.slab_bytes
    assert lay.bytes_per_token * 256 == lay.page_bytes
    assert lay.page_shape == (4, 2, 256, 2, 64)


def test_real_model_shapes():
    qwen3_32b = KVLayout(num_layers=64, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert qwen3_32b.page_bytes == 64 << 20  # 64 MiB per 256-token chunk
    assert qwen3_32b.slab_bytes == 512 << 10
    qwen3_8b = KVLayout(num_layers=36, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    assert qwen3_8b.page_bytes == 36 << 20


def test_validation_and_fingerprint():
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(1, 1, 1, "int3")
    with pytest.raises(ValueError):
        KVLayout(0, 1, 1, "float32")
    lay = KVLayout(2, 2, 64, "float32")
    with pytest.raises(IndexError):
        lay.slab_offset(2, K)
    assert lay.fingerprint() != KVLayout(2, 2, 64, "bfloat16").fingerprint()
