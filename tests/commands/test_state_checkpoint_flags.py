"""--state-checkpoint-chunks on serve and up, and what plan and preflight say of a hybrid's checkpoints in the pool."""

from __future__ import annotations

import argparse

import pytest

from kvshare import preflight
from kvshare.commands import plan, serve
from kvshare.engine.config import DEFAULT_STATE_CHECKPOINT_CHUNKS
from kvshare.engine.preset_table import model_config_of
from kvshare.errors import UserError


def test_serve_maps_the_flag_onto_the_engine_config():
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    assert serve.engine_config(p.parse_args(["--state-checkpoint-chunks", "8"])).state_checkpoint_chunks == 8
    assert serve.engine_config(p.parse_args([])).state_checkpoint_chunks == DEFAULT_STATE_CHECKPOINT_CHUNKS
    with pytest.raises(SystemExit):
        p.parse_args(["--state-checkpoint-chunks", "-1"])


def test_plan_sizes_the_extent_for_a_checkpoint_and_the_pool_for_the_checkpoints():
    config = model_config_of("qwen3.5-27b")
    result = plan.plan(config, 131072, 256, None, 0.95, checkpoint_chunks=64)
    assert result["min_extent_size"] == "146.81 MiB"  # the checkpoint, a page of its own, not the 16 MiB KV page
    assert (result["checkpoints"], result["checkpoint_bytes"]) == (8, 8 * result["state_bytes"])  # 512 chunks / 64
    assert plan.plan(config, 131072 + 256, 256, None, 0.95, checkpoint_chunks=64)["checkpoints"] == 9  # and the end
    assert result["pool_size_bytes"] == int((result["kv_bytes"] + result["checkpoint_bytes"]) / 0.95)
    assert "checkpoints" not in plan.plan(model_config_of("qwen3-32b"), 131072, 256, None, 0.95)


def test_preflight_refuses_an_extent_that_cannot_hold_a_checkpoint():
    layout = preflight.model_layout("qwen3.5-27b", 256)
    state = preflight.model_state_bytes("qwen3.5-27b")
    assert state == 153_944_064 and preflight.model_state_bytes("qwen3-32b") == 0
    preflight.check_pool_holds_a_page(64 << 30, 256 << 20, layout, "qwen3.5-27b", state)
    with pytest.raises(UserError, match="a state checkpoint of qwen3.5-27b is 146.81 MiB"):
        preflight.check_pool_holds_a_page(64 << 30, 128 << 20, layout, "qwen3.5-27b", state)
