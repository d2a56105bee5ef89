"""What differs between the vLLM releases the connector was tested with (0.26 on CUDA, 0.32 on CPU).

One place for every difference, so the connector itself reads as written for one API:

- ``check_version``: the connector refuses a vLLM minor it was not tested with, since its hooks are an
  experimental vLLM API whose call order and objects change between minors; ``allow_untested_vllm`` in
  ``kv_connector_extra_config`` (or ``KVSHARE_ALLOW_UNTESTED_VLLM=1``) overrides that.
- ``HOST_HIT_SOURCE``: 0.32 labels a connector's hits by source (``vllm.v1.metrics.cache_hit_source``);
  0.26 has no such label.
- ``kv_cache_layout``: 0.32 carries the resolved layout ("NHD"/"HND") in ``KVCacheConfig``; 0.26 keeps it
  in a process-wide setting of its attention backends.
- ``BlockTables``: 0.32 gives the scheduler side each running request's blocks
  (``SchedulerOutput.kv_connector_block_state`` or the bound ``KVCacheManager``); 0.26 gives only the
  blocks a step adds, so the table is kept here from the scheduler output, as vLLM's worker keeps its own.
"""

from __future__ import annotations

import os
from typing import Any

TESTED_VLLM = ("0.26", "0.32")  # major.minor releases the connector was run against end to end
ALLOW_ENV = "KVSHARE_ALLOW_UNTESTED_VLLM"

try:  # vLLM >= 0.32
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    HOST_HIT_SOURCE: Any = CacheHitSource.HOST
except ImportError:  # vLLM 0.26: hits carry no source label
    HOST_HIT_SOURCE = None


try:  # vLLM's marker of a connector that sees every KV cache group (a hybrid model's GDN state among them)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # a vLLM without it runs no hybrid model with a connector
    SupportsHMA = object  # type: ignore[assignment,misc]


class UntestedVllm(RuntimeError):
    """This vLLM's minor release is not one the connector was tested with."""


def check_version(version: str, allow_untested: bool = False) -> str:
    """The major.minor of ``version``; raises UntestedVllm unless it is tested or allowed."""
    minor = ".".join(version.split("+")[0].split(".")[:2])
    allowed = allow_untested or os.environ.get(ALLOW_ENV, "") not in ("", "0")
    if minor not in TESTED_VLLM and not allowed:
        raise UntestedVllm(
            f"kvshare's connector was tested with vLLM {', '.join(TESTED_VLLM)}, not {version}: install one of "
            f'those, or set "allow_untested_vllm": true in kv_connector_extra_config (or {ALLOW_ENV}=1) to run '
            "it anyway (the layout fingerprint names the version, so pages are shared only with the same vLLM)"
        )
    return minor


def kv_cache_layout(kv_cache_config: Any, vllm_config: Any = None) -> str:
    """vLLM's resolved KV cache layout ("NHD", "HND"), or "" where it does not say."""
    if kv_cache_config is not None and hasattr(kv_cache_config, "kv_cache_layout"):
        return kv_cache_config.kv_cache_layout or ""  # vLLM >= 0.32
    try:  # vLLM 0.26: a process-wide setting (the environment, else the connector's preference)
        from vllm.config import get_current_vllm_config_or_none, set_current_vllm_config
        from vllm.v1.attention.backends.utils import get_kv_cache_layout
    except ImportError:
        return ""
    if vllm_config is None or get_current_vllm_config_or_none() is not None:
        return get_kv_cache_layout() or ""
    with set_current_vllm_config(vllm_config):  # it reads the current config; a scheduler process has none set
        return get_kv_cache_layout() or ""


class BlockTables:
    """Each running request's block ids (every KV cache group) from what vLLM's scheduler output says.

    Used where vLLM gives a connector no other way to read them (0.26): ``block_ids_source`` feeds it every
    scheduler output, in order; ``forget`` drops a finished request.
    """

    def __init__(self) -> None:
        self._tables: dict[str, list[list[int]]] = {}

    def update(self, scheduler_output: Any) -> None:
        for new in scheduler_output.scheduled_new_reqs:
            self._tables[new.req_id] = [list(group) for group in new.block_ids]
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set())
        for req_id, groups in zip(cached.req_ids, cached.new_block_ids):
            if req_id in resumed:  # a request back from preemption: new_block_ids is its whole table
                self._tables[req_id] = [list(group) for group in groups] if groups is not None else []
            elif groups is not None:
                tables = self._tables.setdefault(req_id, [[] for _ in groups])
                for table, group in zip(tables, groups):
                    table.extend(group)

    def get(self, req_id: str) -> list[list[int]]:
        return self._tables[req_id]

    def forget(self, req_id: str) -> None:
        self._tables.pop(req_id, None)


def block_ids_source(connector: Any, scheduler_output: Any, tables: BlockTables):
    """A function req_id -> the request's block ids of every cache group for this step, whatever vLLM provides."""
    block_state = getattr(scheduler_output, "kv_connector_block_state", None)
    manager = getattr(connector, "_kv_cache_manager", None)
    if not hasattr(scheduler_output, "kv_connector_block_state") and manager is None:  # vLLM 0.26
        tables.update(scheduler_output)
        return tables.get

    def block_ids_of(req_id: str) -> list[int]:
        groups = block_state.get_block_ids(req_id) if block_state is not None else None
        if groups is None:
            groups = manager.get_block_ids(req_id)
        return groups

    return block_ids_of
