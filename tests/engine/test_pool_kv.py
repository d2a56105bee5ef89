"""The engine's loads and stores carry their own state: a prompt's cold prefill time goes with its load to its
store, whatever ran in between."""

from __future__ import annotations

import time

import torch

from kvshare.engine.pool_kv import PoolKV
from kvshare.engine.stats import EngineStats
from kvshare.layout import KVLayout
from kvshare.pool.spawn import running_pool
from tests.pool.conftest import make_keys

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float32", chunk_tokens=16)
NS_A, NS_B = b"a" * 16, b"b" * 16


def test_each_store_reports_the_cold_prefill_of_its_own_load():
    """Prompt A's load, then prompt B's lookup before A is stored. Fails when the time travels in the link's own
    state (set by finish_load, read by store): B's lookup clears it, or B's time is reported as A's."""
    with running_pool("16MiB", ("--extent-size", "4MiB"), quiet=True) as path:
        pool = PoolKV(path, LAYOUT, torch.device("cpu"), EngineStats(), name="engine")
        reports = []
        pool.link.client().report_prefill = lambda *args: reports.append(args)
        kv = torch.zeros(1, 2, 1, 2 * LAYOUT.chunk_tokens, 64)
        keys_a, keys_b = make_keys("a", 2), make_keys("b", 2)
        load_a = pool.load_prefix(kv, keys_a, first_chunk=0)  # nothing held: a cold prefill, timed
        time.sleep(0.05)
        pool.finish_load(load_a)
        load_b = pool.load_prefix(kv, keys_b, first_chunk=0)  # the next prompt's lookup, before A is stored
        pool.store(kv, keys_a, NS_A, cold_seconds=load_a.cold_seconds)
        pool.finish_load(load_b)
        pool.store(kv, keys_b, NS_B, cold_seconds=load_b.cold_seconds)
        assert [(r[0], r[2]) for r in reports] == [(NS_A, 2), (NS_B, 2)]
        assert reports[0][3] >= 0.05 > reports[1][3]  # each its own prefill's time
        assert pool.stats.pool_stored_chunks == 4
        pool.close()
