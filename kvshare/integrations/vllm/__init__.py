"""kvshare's KV connector for vLLM: load it with ``kv_connector_module_path`` ``kvshare.integrations.vllm``.

    connector   KVShareConnector, the KVConnectorBase_V1 face vLLM loads (imports vLLM)
    scheduler   the scheduler side: lookups, leases, each step's loads and stores (no vLLM)
    hooks       the worker side's per-step hooks in vLLM's call order (what the connector forwards to)
    worker      the worker side: copies between pool pages and vLLM's paged KV (no vLLM)
    pool_pages  the worker side's pool calls: lease checks, drops, reserve / commit / abort
    staging     on a GPU: streams, staging buffers, 2-D copies, the scatter/gather into vLLM's blocks
    staged_loads   on a GPU: a step's loads, per layer group on vLLM's stream, verified on the GPU
    staged_stores  on a GPU: a step's stores, each layer group copied out after the kernels that wrote it
    overlap     on CPU: a step's loads copied layer by layer beside the forward
    paged_tensors  vLLM-shaped KV tensors of every accepted memory order (tests, validation, the GPU harness)
    ordercheck  the GPU path's byte and delay-injection ordering checks (kvshare validate --level bytes)
    layout      vLLM's KV tensor layouts and token/block views of them
    block_copy  whole-block numpy copies over a few threads (CPU)
    plan        chunk/block arithmetic of loads and stores (pure)
    metadata    the specs and reports that pass between the two sides
    options     the connector's settings (kv_connector_extra_config, per-request params)
    stats       the counters as vLLM's KVConnectorStats and Prometheus metrics (imports vLLM)
    identity    the namespace of a model's KV (weights fingerprint, layout)
    guards      the layout fingerprint, models with other state than attention KV, the KV dtype
    tensor_parallel  a rank's KV heads, its part of a page's checksum, stores committed once all parts are in
    launch      the vLLM server command line with the connector configured
    bench       ``python -m kvshare.integrations.vllm.bench``: TTFT cold, local and cross-replica

vLLM loads the class as ``getattr(importlib.import_module(path), "KVShareConnector")``; the
package resolves that name on first access (PEP 562), so importing the package or any of its
vLLM-free modules does not import vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare.integrations.vllm.connector import KVShareConnector

__all__ = ["KVShareConnector"]


def __getattr__(name: str):
    if name == "KVShareConnector":
        connector = importlib.import_module("kvshare.integrations.vllm.connector")
        return connector.KVShareConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
