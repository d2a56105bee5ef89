"""kvshare's KV connector for vLLM: load it with ``kv_connector_module_path`` ``kvshare.integrations.vllm``.

vLLM's hooks, in the order it calls them, through four files (connector, then one side, then the device)::

    get_num_new_matched_tokens, update_state_after_alloc,   connector -> scheduler
    build_connector_meta, request_finished
    start_load_kv, wait_for_layer_load, save_kv_layer,      connector -> worker -> gpu (vLLM on CUDA)
    wait_for_save, get_block_ids_with_load_errors                              -> cpu (vLLM on CPU)

    connector   KVShareConnector, the KVConnectorBase_V1 face vLLM loads (imports vLLM); picks the worker
    scheduler   the scheduler side: lookups, leases, each step's loads and stores (no vLLM)
    worker      the worker side: the per-step hooks (WorkerHooks) over KVWorker, the interface of the two
                implementations below, and what they share: a step's loads and stores in flight (StepLoads,
                StepStores), loads beside vLLM's steps (asynchronous, polled in get_finished), a load's end
                (finish_load: its pages' verdicts) (no vLLM)
    gpu         GpuKVWorker: a step's loads per layer group on its own streams, vLLM's stream waiting per layer,
                verified on the GPU, reading copies ahead where a hint brought them; its stores through gpu_stores
    cpu         CpuKVWorker: loads verified then copied before the forward (or beside it: cpu_overlap; or beside
                vLLM's steps on the loader thread: an asynchronous load), stores after it

Beneath them, plain modules:

    gpu_stores  on a GPU: a step's stores, each layer group copied out after the kernels that wrote it
    gpu_states  on a GPU: a hybrid's GDN checkpoints between the pool and vLLM's blocks, through a device buffer
    prefetch    copies ahead on the router's hints: keys, lease, the book a load takes them from (no torch)
    gpu_prefetch  on a GPU: the prefetch buffer the copies ahead land in, on a stream of their own
    cpu_prefetch  on CPU: the prefetch buffer the copies ahead land in, checked there as they land
    hint_listener  the replica's hint address: the router's signed hints, on a thread of the worker process
    cpu_overlap on CPU: a step's loads copied layer by layer beside the forward, on a helper thread
    paged_destination  on a GPU: vLLM's blocks as kvshare.transfer.pipeline's destination (the scatter/gather)
    block_copy  on CPU: whole-block numpy copies over a few threads
    pool_pages  the worker side's pool calls: lease checks, drops, reserve / commit / abort
    tensor_parallel  a rank's KV heads, its part of a page's checksum, stores committed once all parts are in
    layout      vLLM's KV tensor layouts and token/block views of them
    page_slices which tokens of which leased pages a load copies, runs of adjacent pages (pure)
    prompt_chunks  which of a prompt's chunks the scheduler side looks up, loads and stores (pure)
    leases      the scheduler side's lease per request, from its lookup to the end of its load
    metadata    the specs and reports that pass between the two sides
    counters    the connector's counters and the phase times of its timing lines
    options     the connector's settings (kv_connector_extra_config, per-request params)
    stats       the counters as vLLM's KVConnectorStats and Prometheus metrics (imports vLLM)
    identity    the namespace of a model's KV (weights fingerprint, layout)
    guards      the layout fingerprint, models with other state than attention KV, the KV dtype
    hybrid      a hybrid (Gated DeltaNet) model: its cache groups, guards, block size, which chunks and
                checkpoint a load and a store take (pure)
    hybrid_setup  a hybrid's set-up from vLLM's objects at start: checked, its pages' and checkpoints' layouts,
                its GDN layers' state taken into the worker
    state_blocks  a hybrid's GDN state between vLLM's blocks and one canonical checkpoint page (vLLM CPU's and
                CUDA's memory orders, with vLLM's sources cited)
    compat      what differs between the vLLM versions the connector supports

Beside them, not hooks:

    paged_tensors  vLLM-shaped KV tensors of every accepted memory order (tests, validation, the GPU harness)
    ordercheck  the GPU path's byte and delay-injection ordering checks (kvshare validate --level bytes)
    launch      the vLLM server command line with the connector configured
    cpu_cores   the CPU cores of vLLM CPU replicas: those vLLM keeps off its OpenMP threads, each rank's share
    bench       ``python -m kvshare.integrations.vllm.bench``: TTFT cold, local and cross-replica
    bench_copy  its ``--copy-only``: the connector's store and load of one prompt, without vLLM
    bench_timings  its ``--timings``: the connector's debug timing lines, parsed and summarised (pure)
    gpu_rows    the GPU benchmark's rows (pure)

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
