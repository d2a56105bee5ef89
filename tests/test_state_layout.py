"""kvshare.state_layout: the canonical state checkpoint's arithmetic (pure)."""

import pytest

from kvshare.state_layout import ALIGNMENT, StateLayout

QWEN3_5_27B = StateLayout(
    num_layers=48, num_value_heads=48, key_head_dim=128, value_head_dim=128, conv_dim=10240, conv_kernel=4
)


def test_the_27b_state_is_147_mib():
    assert QWEN3_5_27B.recurrent_bytes == 48 * 128 * 128 * 4  # 3 MiB of float32 per layer
    assert QWEN3_5_27B.conv_bytes == 10240 * 3 * 2  # the last 3 inputs of 10240 channels, bf16
    assert QWEN3_5_27B.layer_bytes == QWEN3_5_27B.recurrent_bytes + QWEN3_5_27B.conv_bytes  # already aligned
    assert QWEN3_5_27B.checkpoint_bytes == 153_944_064  # 146.8 MiB
    assert QWEN3_5_27B.recurrent_shape == (48, 128, 128) and QWEN3_5_27B.conv_shape == (10240, 2 + 1)


def test_layers_follow_one_another_aligned_and_sections_do_not_overlap():
    lay = StateLayout(3, 2, 4, 4, conv_dim=10, conv_kernel=4, conv_dtype="float16")  # 128 + 60 bytes a layer
    assert (lay.recurrent_bytes, lay.conv_bytes, lay.layer_bytes) == (128, 60, 192)
    for layer in range(3):
        assert lay.recurrent_offset(layer) == layer * 192 and lay.recurrent_offset(layer) % ALIGNMENT == 0
        assert lay.conv_offset(layer) == lay.recurrent_offset(layer) + 128
        assert lay.conv_offset(layer) + lay.conv_bytes <= lay.recurrent_offset(layer) + lay.layer_bytes
    assert lay.checkpoint_bytes == 3 * 192
    with pytest.raises(IndexError):
        lay.recurrent_offset(3)


def test_validation_and_fingerprint():
    with pytest.raises(ValueError, match="conv_kernel"):
        StateLayout(1, 1, 1, 1, conv_dim=1, conv_kernel=1)
    with pytest.raises(ValueError, match="int3"):
        StateLayout(1, 1, 1, 1, conv_dim=1, conv_kernel=4, conv_dtype="int3")
    with pytest.raises(ValueError, match="num_layers"):
        StateLayout(0, 1, 1, 1, conv_dim=1, conv_kernel=4)
    assert QWEN3_5_27B.fingerprint() == StateLayout(**QWEN3_5_27B.__dict__).fingerprint()
    for change in ({"conv_kernel": 3}, {"conv_dtype": "float16"}, {"recurrent_dtype": "bfloat16"}, {"num_layers": 47}):
        assert StateLayout(**{**QWEN3_5_27B.__dict__, **change}).fingerprint() != QWEN3_5_27B.fingerprint()
