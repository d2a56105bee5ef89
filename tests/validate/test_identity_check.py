"""kvshare validate's model-identity check (helpers level), with a negative control that makes it fail."""

from __future__ import annotations

import hashlib
import os

import pytest

import kvshare.validate.identity_check as identity_check
from kvshare.validate.report import CAUGHT, FAIL, PASS


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kvshare" / "weights"


def test_the_identity_check_passes_and_leaves_no_cache_entries(private_cache):
    rows = identity_check.identity_rows()
    assert [r.status for r in rows] == [PASS, PASS, PASS, CAUGHT], rows
    assert os.listdir(private_cache) == []  # its temporary files' entries are removed


def test_the_identity_check_fails_on_a_header_only_identity(monkeypatch):
    """Negative control: the fingerprint of config.json and safetensors headers (the identity before the
    weights' bytes were hashed) gives the changed checkpoint the namespace of the original."""

    def header_only(model_dir: str) -> str:
        h = hashlib.blake2b(digest_size=16)
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            h.update(f.read())
        h.update(identity_check.read_safetensors_header(os.path.join(model_dir, "model.safetensors")))
        return h.hexdigest()

    monkeypatch.setattr(identity_check, "model_fingerprint", header_only)
    rows = identity_check.identity_rows()
    assert rows[0].status == FAIL and "changed weight" in rows[0].name
    assert rows[1].status == PASS  # a copy still shares


def test_the_helpers_level_reports_the_identity_rows(monkeypatch):
    from kvshare.validate import helpers_level

    monkeypatch.setattr(helpers_level, "_families", lambda: ([], ""))  # the converters have their own tests
    result = helpers_level.run_helpers_level("cpu")
    assert sum(r.name.startswith("identity") for r in result.rows) == 4 and result.status == PASS
