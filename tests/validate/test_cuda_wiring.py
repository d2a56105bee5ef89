"""What validate does on CUDA that can be checked without a GPU (the GPU paths themselves run on the H200).

Under the fake CUDA of tests/transfer/fake_cuda.py (cudaHostRegister records ranges): the
full-pool level pins the whole arena in extent pieces between fault-in and write, the
pool holds that one registration for the byte level and releases it at exit; and the
byte level's verdicts for the ordering checks and their deliberately unordered controls.
"""

from __future__ import annotations

import pytest
import torch

from kvshare.transfer.roundtrip import PathResult
from kvshare.validate.bytes_level import _row
from kvshare.validate.checked_pool import CheckedPool, PoolSpec
from kvshare.validate.full_pool_level import run_full_pool_level
from kvshare.validate.report import CAUGHT, FAIL, PASS, SKIP
from tests.transfer import fake_cuda


@pytest.fixture
def fake(monkeypatch):
    fake = fake_cuda.FakeCuda()
    fake_cuda.install(monkeypatch, fake)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    return fake


def test_full_pool_pins_the_arena_in_extent_pieces_once_for_the_command(fake):
    with CheckedPool(PoolSpec(None, 48 << 20, 16 << 20), "cuda") as pool:
        result = run_full_pool_level(pool, 4 << 20, show_progress=False)
        assert result.status == PASS, result.rows
        assert set(result.figures["seconds"]) == {"fault_in", "pin", "write", "verify"}
        assert {r.name: r.status for r in result.rows}["pin"] == PASS
        assert "3 pieces" in result.figures["pinned"]
        base = int(pool.client.arena.ctypes.data)
        assert fake.registered == {base: 16 << 20, base + (16 << 20): 16 << 20, base + (32 << 20): 16 << 20}
        pool.register_arena()  # the byte level asks again: the same registration, nothing new
        assert fake.register_calls == 3
    assert fake.registered == {}  # released when the command ends


def test_a_failed_pin_names_the_memlock_limit(fake):
    from kvshare.transfer.registration import RegistrationError

    fake.fail_register_at = 2
    with CheckedPool(PoolSpec(None, 32 << 20, 16 << 20), "cuda") as pool:
        with pytest.raises(RegistrationError, match="RLIMIT_MEMLOCK"):
            pool.register_arena()
        assert fake.registered == {}  # the piece registered before the failure was undone


def test_ordering_verdicts():
    def result(kind, wrong, skipped=""):
        return PathResult("cuda/memcpy2d store-unordered", kind, 1, 1000, wrong, 0.1, skipped=skipped)

    assert _row("x", result("control", 900)).status == CAUGHT  # the unordered variant came out wrong: good
    assert _row("x", result("control", 0)).status == FAIL  # ... came out right: the check cannot see the bug
    assert _row("x", result("ordering", 0)).status == PASS
    assert _row("x", result("ordering", 3)).status == FAIL
    assert _row("x", result("round_trip", 0, skipped="cuda-bindings missing")).status == SKIP
