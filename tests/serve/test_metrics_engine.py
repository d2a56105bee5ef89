"""The engine's counters and gauges in a replica's /metrics text (read from engine.stats() at each scrape)."""

from prometheus_client import generate_latest

from kvshare.engine.stats import EngineStats
from kvshare.serve.metrics import ReplicaMetrics
from kvshare.serve.server import _as_dict


def scrape(stats: EngineStats) -> dict[str, float]:
    text = generate_latest(ReplicaMetrics(lambda: _as_dict(stats), "tiny").registry).decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            assert 'model_name="tiny"' in name, line  # vLLM's label on every replica metric
            values[name.split("{")[0]] = float(value)
    return values


def test_local_cache_out_of_memory_and_capacity_are_exported():
    values = scrape(
        EngineStats(
            local_out_of_memory=3, local_cache_bytes=2 << 20, local_cache_capacity_bytes=4 << 20, local_hit_chunks=7
        )
    )
    assert values["kvshare_local_cache_out_of_memory_total"] == 3
    assert values["kvshare_local_cache_bytes"] == 2 << 20
    assert values["kvshare_local_cache_capacity_bytes"] == 4 << 20
    assert values["kvshare_local_cache_hit_chunks_total"] == 7
    assert scrape(EngineStats())["kvshare_local_cache_out_of_memory_total"] == 0
