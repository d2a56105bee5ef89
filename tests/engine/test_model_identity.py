"""The pool shares KV between replicas of the same weights only: named by their bytes, never by a directory.

Two checkpoints with equal config.json and equal safetensors headers but one changed weight are
two fine-tunes of one base model as the pool sees them; both directories are called ``model``.
"""

from __future__ import annotations

import os
import shutil

import pytest

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions, SamplingParams
from kvshare.identity import read_safetensors_header
from tests.engine.conftest import ascii_prompt

CHUNK = 16
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True)
STORE = RequestOptions(use_local_cache=False)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def checkpoints(tiny_dir, tmp_path):
    """(a, b, copy): a and b both called ``model``, b with one weight changed; copy: a elsewhere, renamed."""
    a = shutil.copytree(tiny_dir, tmp_path / "one" / "model")
    b = shutil.copytree(tiny_dir, tmp_path / "two" / "model")
    weights = os.path.join(b, "model.safetensors")
    with open(weights, "r+b") as f:  # the lowest byte of the file's last float32: a tiny change of one weight
        f.seek(-4, os.SEEK_END)
        byte = f.read(1)
        f.seek(-4, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    assert read_safetensors_header(weights) == read_safetensors_header(os.path.join(a, "model.safetensors"))
    copy = shutil.copytree(tiny_dir, tmp_path / "elsewhere" / "renamed-checkpoint")
    return str(a), str(b), str(copy)


def pool_tokens(model: str, pool_socket: str, ids: list[int], **config) -> int:
    """Prompt tokens a fresh replica of ``model`` took from the pool (it stores the prompt after)."""
    engine = Engine(EngineConfig(model=model, chunk_tokens=CHUNK, pool_socket=pool_socket, **config))
    try:
        events = list(engine.generate(ids, PARAMS, STORE))
        return events[0].provenance.pool_tokens
    finally:
        engine.close()


def test_changed_weights_never_share_a_copy_or_renamed_directory_does(checkpoints, pool_socket):
    """Fails on the header-and-directory-name identity: b (also called ``model``, equal headers) took a's
    pages, and the renamed copy of a (another directory name) did not."""
    a, b, copy = checkpoints
    ids = [int(c) for c in ascii_prompt(4 * CHUNK + 3, seed=5).encode()]
    assert pool_tokens(a, pool_socket, ids) == 0  # computed and stored
    assert pool_tokens(b, pool_socket, ids) == 0  # another checkpoint: not one page of a's
    assert pool_tokens(copy, pool_socket, ids) == 4 * CHUNK  # the same bytes elsewhere, renamed: shares


def test_a_model_revision_names_identity_instead_of_the_bytes(checkpoints, pool_socket):
    a, b, _copy = checkpoints
    ids = [int(c) for c in ascii_prompt(2 * CHUNK + 1, seed=6).encode()]
    assert pool_tokens(a, pool_socket, ids, model_revision="rev-1") == 0
    assert pool_tokens(a, pool_socket, ids) == 0  # the revision's pages are not the bytes' pages
    # the user's word: replicas with one revision share whatever they loaded (documented as their responsibility)
    assert pool_tokens(b, pool_socket, ids, model_revision="rev-1") == 2 * CHUNK
    assert pool_tokens(b, pool_socket, ids, model_revision="rev-2") == 0


def test_the_effective_configuration_is_part_of_the_namespace(tiny_dir):
    """The dtype a replica runs the weights in changes the namespace, whatever the KV dtype."""
    f32 = Engine(EngineConfig(model=tiny_dir, kv_dtype="bf16")).namespace
    bf16 = Engine(EngineConfig(model=tiny_dir, dtype="bfloat16", kv_dtype="bf16")).namespace
    assert f32.kv_dtype == bf16.kv_dtype and f32.weights_fingerprint == bf16.weights_fingerprint
    assert f32.config_id != bf16.config_id
