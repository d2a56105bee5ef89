"""The version adapter (kvshare.integrations.vllm.compat): vLLM 0.26-shaped objects, and the installed vLLM."""

import importlib.util
from types import SimpleNamespace

import pytest

from kvshare.integrations.vllm import compat
from kvshare.integrations.vllm.compat import BlockTables, UntestedVllm, block_ids_source, check_version


def test_untested_vllm_is_refused_unless_allowed(monkeypatch):
    """Fails when check_version only warns (as the connector did before it refused)."""
    monkeypatch.delenv(compat.ALLOW_ENV, raising=False)
    assert check_version("0.26.0") == "0.26"
    assert check_version("0.32.0+cpu") == "0.32"
    with pytest.raises(UntestedVllm, match="not 0.33.1.*allow_untested_vllm.*KVSHARE_ALLOW_UNTESTED_VLLM=1"):
        check_version("0.33.1")
    with pytest.raises(UntestedVllm):
        check_version("0.25.2")
    assert check_version("0.33.1", allow_untested=True) == "0.33"
    monkeypatch.setenv(compat.ALLOW_ENV, "0")
    with pytest.raises(UntestedVllm):
        check_version("0.33.1")
    monkeypatch.setenv(compat.ALLOW_ENV, "1")
    assert check_version("0.33.1") == "0.33"


def test_the_override_is_a_connector_setting():
    from kvshare.integrations.vllm.options import ConnectorConfig

    assert ConnectorConfig.from_extra_config({}).allow_untested_vllm is False
    assert ConnectorConfig.from_extra_config({"allow_untested_vllm": True}).allow_untested_vllm is True


def _output(new=(), cached=(), resumed=()):
    """A vLLM 0.26 SchedulerOutput as far as the connector reads it (no kv_connector_block_state)."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),)) for r, b in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            resumed_req_ids=set(resumed),
            new_block_ids=[None if b is None else (list(b),) for _, b in cached],
        ),
    )


def test_block_tables_follow_vllm_026_scheduler_outputs():
    """Fails when a resumed request's new_block_ids are appended instead of replacing its table."""
    tables = BlockTables()
    connector = SimpleNamespace()  # 0.26: no _kv_cache_manager
    get = block_ids_source(connector, _output(new=[("a", [3, 4]), ("b", [7])]), tables)
    assert get("a") == [[3, 4]] and get("b") == [[7]]
    get = block_ids_source(connector, _output(cached=[("a", [9]), ("b", None)]), tables)  # a chunk, a decode step
    assert get("a") == [[3, 4, 9]] and get("b") == [[7]]
    get = block_ids_source(connector, _output(cached=[("a", [1, 2, 5])], resumed=["a"]), tables)  # after preemption
    assert get("a") == [[1, 2, 5]]
    tables.forget("a")
    with pytest.raises(KeyError):
        tables.get("a")


def test_vllm_032_block_state_is_preferred():
    state = SimpleNamespace(get_block_ids=lambda req_id: ([5, 6],) if req_id == "a" else None)
    manager = SimpleNamespace(get_block_ids=lambda req_id: ([8],))
    output = SimpleNamespace(kv_connector_block_state=state, scheduled_new_reqs=[], scheduled_cached_reqs=None)
    tables = BlockTables()
    get = block_ids_source(SimpleNamespace(_kv_cache_manager=manager), output, tables)
    assert get("a") == ([5, 6],) and get("b") == ([8],)
    with pytest.raises(KeyError):
        tables.get("a")  # the tables are not kept where vLLM gives block tables


def test_kv_cache_layout_of_both_shapes():
    assert compat.kv_cache_layout(SimpleNamespace(kv_cache_layout="HND")) == "HND"  # 0.32's KVCacheConfig
    assert compat.kv_cache_layout(SimpleNamespace(kv_cache_layout=None)) == ""
    layout = compat.kv_cache_layout(SimpleNamespace())  # 0.26's KVCacheConfig has no such field
    assert layout in ("", "NHD", "HND")


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM")
def test_against_the_installed_vllm():
    import vllm
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    assert check_version(vllm.__version__) in compat.TESTED_VLLM
    assert compat.HOST_HIT_SOURCE is CacheHitSource.HOST
    from kvshare.integrations.vllm.connector import KVShareConnector

    assert KVShareConnector._cache_hit_source is CacheHitSource.HOST
