"""kvshare.identity: a model is named by every byte of its weights, cached per file by its stat, failing closed."""

from __future__ import annotations

import json
import os
import shutil
import stat
import struct

import pytest

import kvshare.identity as identity
from kvshare.identity import IdentityError, adapter_fingerprint, file_digest, model_fingerprint

HEADER = json.dumps({"w": {"dtype": "F32", "shape": [256], "data_offsets": [0, 1024]}}).encode()


def write_checkpoint(path, payload: bytes = bytes(range(256)) * 4, config: bytes = b'{"model_type": "llama"}') -> str:
    """A one-tensor safetensors checkpoint: config.json and model.safetensors (header, then ``payload``)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "wb") as f:
        f.write(config)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(HEADER)) + HEADER + payload)
    return str(path)


def one_byte_changed(payload: bytes = bytes(range(256)) * 4, at: int = 517) -> bytes:
    return payload[:at] + bytes([payload[at] ^ 1]) + payload[at + 1 :]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kvshare" / "weights"


@pytest.fixture
def count_hashes(monkeypatch):
    """Counts hash_file calls (reads of a file's bytes); the digests are the real ones."""
    calls = []
    real = identity.hash_file

    def counting(path, *args, **kwargs):
        calls.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(identity, "hash_file", counting)
    return calls


def test_one_changed_weight_changes_the_fingerprint_equal_headers_and_config(tmp_path):
    """Fails on the header-only fingerprint (config.json + safetensors headers), which these two share."""
    a = write_checkpoint(tmp_path / "a" / "model")
    b = write_checkpoint(tmp_path / "b" / "model", one_byte_changed())  # both directories are called `model`
    assert identity.read_safetensors_header(a + "/model.safetensors") == identity.read_safetensors_header(
        b + "/model.safetensors"
    )
    assert model_fingerprint(a) != model_fingerprint(b)


def test_a_copy_or_a_renamed_directory_has_the_same_fingerprint(tmp_path):
    a = write_checkpoint(tmp_path / "a")
    copy = shutil.copytree(a, tmp_path / "elsewhere" / "copy")
    renamed = str(tmp_path / "renamed")
    before = model_fingerprint(a)
    os.rename(a, renamed)
    assert model_fingerprint(copy) == model_fingerprint(renamed) == before


def test_config_json_is_part_of_the_fingerprint(tmp_path):
    a = write_checkpoint(tmp_path / "a")
    b = write_checkpoint(tmp_path / "b", config=b'{"model_type": "llama", "rope_theta": 5e5}')
    assert model_fingerprint(a) != model_fingerprint(b)


def test_a_restart_costs_a_stat_not_a_read(tmp_path, count_hashes):
    a = write_checkpoint(tmp_path / "a")
    first = model_fingerprint(a)
    assert len(count_hashes) == 1
    assert model_fingerprint(a) == first  # what a restarted replica does: the cache on disk answers
    assert len(count_hashes) == 1  # fails when the cache is not consulted (the file is hashed again)


def test_a_changed_mtime_rehashes(tmp_path, count_hashes):
    a = write_checkpoint(tmp_path / "a")
    first = model_fingerprint(a)
    st = os.stat(a + "/model.safetensors")
    os.utime(a + "/model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert model_fingerprint(a) == first and len(count_hashes) == 2  # same bytes, read again


def test_an_edit_in_place_that_keeps_size_and_mtime_is_still_seen(tmp_path):
    """ctime is part of the cache key: an edit that restores the mtime (cp -p, touch -d) still rehashes."""
    a = write_checkpoint(tmp_path / "a")
    path = a + "/model.safetensors"
    first = model_fingerprint(a)
    st = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(8 + len(HEADER) + 3)
        f.write(b"\xff")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_size == st.st_size
    assert model_fingerprint(a) != first


def test_cache_entries_are_private_and_written_whole(tmp_path, private_cache):
    a = write_checkpoint(tmp_path / "a")
    model_fingerprint(a)
    entries = os.listdir(private_cache)
    assert len(entries) == 1 and entries[0].endswith(".json")  # no temporary file left behind
    assert stat.S_IMODE(os.stat(private_cache / entries[0]).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(private_cache).st_mode) == 0o700


@pytest.mark.parametrize("damage", ["garbage", "digest", "foreign", "mode"])
def test_a_corrupt_or_foreign_entry_is_ignored_and_recomputed(tmp_path, private_cache, count_hashes, damage):
    """Fails when read_cached_digest trusts an entry without checking its checksum, key and owner-only mode."""
    a = write_checkpoint(tmp_path / "a")
    b = write_checkpoint(tmp_path / "b", one_byte_changed())
    first = model_fingerprint(a)
    path = identity._entry_path(identity._file_key(os.stat(a + "/model.safetensors")))
    entry = json.loads(open(path).read())
    if damage == "garbage":
        open(path, "w").write("{not json")
    elif damage == "digest":  # a flipped digest without its checksum fixed
        entry["body"]["digest"] = file_digest(b + "/model.safetensors").hex()
        open(path, "w").write(json.dumps(entry))
    elif damage == "foreign":  # another file's whole, valid entry under this file's name
        model_fingerprint(b)
        shutil.copy(identity._entry_path(identity._file_key(os.stat(b + "/model.safetensors"))), path)
    else:
        os.chmod(path, 0o644)  # anyone could have read it; someone else may have written it
    assert model_fingerprint(a) == first
    assert count_hashes.count(a + "/model.safetensors") == 2


def test_a_cache_directory_others_may_write_is_not_used(tmp_path, private_cache, count_hashes):
    os.makedirs(private_cache)
    os.chmod(private_cache, 0o777)
    a = write_checkpoint(tmp_path / "a")
    first = model_fingerprint(a)
    assert model_fingerprint(a) == first and len(count_hashes) == 2
    assert os.listdir(private_cache) == []


def test_ranges_hashed_on_threads_give_one_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(identity, "RANGE_BYTES", 4096)
    monkeypatch.setattr(identity, "READ_BYTES", 1000)  # reads that do not divide a range
    path = tmp_path / "big.bin"
    data = os.urandom(5 * 4096 + 123)
    path.write_bytes(data)
    digests = {identity.hash_file(str(path), num_threads=n) for n in (1, 2, 7)}
    assert len(digests) == 1
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # the last byte of the last, short range
    assert identity.hash_file(str(path)) not in digests
    seen = []
    identity.hash_file(str(path), advance=seen.append)
    assert sum(seen) == len(data)


def test_lora_adapters_are_named_by_their_bytes(tmp_path):
    def adapter(path, payload):
        os.makedirs(path)
        (path / "adapter_config.json").write_text('{"r": 8}')
        (path / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(HEADER)) + HEADER + payload)
        return str(path)

    one = adapter(tmp_path / "one", bytes(1024))
    renamed = adapter(tmp_path / "renamed-copy", bytes(1024))
    other = adapter(tmp_path / "x" / "one", b"\x01" + bytes(1023))  # same directory name, other bytes
    assert adapter_fingerprint(one) == adapter_fingerprint(renamed) != adapter_fingerprint(other)


def test_what_cannot_be_fingerprinted_gets_a_clear_error(tmp_path):
    with pytest.raises(IdentityError, match="as a local directory"):
        model_fingerprint("Qwen/Qwen3-8B")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(IdentityError, match="holds no"):
        model_fingerprint(str(tmp_path / "empty"))
    a = write_checkpoint(tmp_path / "a")
    os.unlink(a + "/config.json")
    with pytest.raises(IdentityError, match="cannot read"):
        model_fingerprint(a)


def test_a_progress_bar_on_stderr_only_when_a_first_hash_takes_a_while(tmp_path, monkeypatch, capsys):
    a = write_checkpoint(tmp_path / "quick")
    model_fingerprint(a)
    assert capsys.readouterr().err == ""  # a fast hash prints nothing
    monkeypatch.setattr(identity, "PROGRESS_AFTER_S", 0.0)  # as if every hash were slow
    b = write_checkpoint(tmp_path / "slow", one_byte_changed())
    model_fingerprint(b)
    captured = capsys.readouterr()
    assert "hashing slow's weights" in captured.err and captured.out == ""
