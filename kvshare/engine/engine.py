"""The built-in engine: one request at a time, prefix reuse from the local cache and the pool.

A request, in order::

    keys      chained keys of the prompt's full chunks (kvshare.keys; namespace salted by tenant)
    in place  the last request's tokens still in kv, where they outreach whole chunks (kv_cache.HeldSequence)
    local     longest prefix of chunks held in the local prefix cache -> copied into kv
    pool      longest run after it that the pool holds -> leased, loaded layer by layer
    prefill   the rest of the prompt (at least its last token: its logits pick the first token)
    stream    first token; then decode, while a thread publishes (local cache + pool store of the chunks the
              pool lacks); the last token waits for the publish (a response that ended has its prompt stored)

    prompt    |== local ==|==== pool ====|------ computed ------|
              0        local_len     cached_len               n
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import replace

import numpy as np
import torch

from kvshare.engine.config import EngineConfig, kv_precision, kv_storage_dtype
from kvshare.engine.decode_graph import DecodeGraphs
from kvshare.engine.flash import AttentionChoice, use_attention
from kvshare.engine.fused import use_fused
from kvshare.engine.gdn_kernels import use_gdn_kernels
from kvshare.engine.grid import grid_forward
from kvshare.engine.grid_check import start_grid
from kvshare.engine.hybrid_decode_graph import HybridDecodeGraphs
from kvshare.engine.hybrid_grid_check import check_hybrid_grid
from kvshare.engine.hybrid_prefill import HybridPrefill
from kvshare.engine.hybrid_tail_graph import TailGraphSet
from kvshare.engine.kv_cache import KVBuffer
from kvshare.engine.loader import LoadedModel, load_model, resolve_device
from kvshare.engine.pool_kv import PoolKV, PoolLoad
from kvshare.engine.pool_states import PoolStates
from kvshare.engine.prefix_cache import LocalPrefixCache
from kvshare.engine.publish import PromptPublisher, wait_for

# a request's types and SamplingParams live in their own modules and are re-exported: callers build them as
# kvshare.engine.engine.RequestOptions and kvshare.engine.engine.SamplingParams
from kvshare.engine.request import Provenance, RequestOptions, TokenEvent, cancellable
from kvshare.engine.sampler import SamplingParams, TokenCounts, make_generator, sample
from kvshare.engine.stats import REQUEST_COUNTERS, EngineStats
from kvshare.engine.timeline import active
from kvshare.keys import Namespace, chunk_keys, namespace_digest, state_key
from kvshare.layout import KVLayout
from kvshare.transfer import TransferConfig

MAX_CACHED_DIGESTS = 4096  # namespace digests kept (one per tenant and cache_salt seen lately)
log = logging.getLogger(__name__)


def _max_model_len(requested: int | None, max_position_embeddings: int) -> int:
    """The context a sequence may fill: the configured one, within the model's positions (its default)."""
    if requested is not None and requested > max_position_embeddings:
        raise ValueError(
            f"max_model_len {requested} exceeds the model's max_position_embeddings {max_position_embeddings}"
        )
    return requested or max_position_embeddings


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        loaded = load_model(config.model, self.device, config.dtype, config.model_name, config.model_revision)
        self.model, self.model_config, self.tokenizer = loaded.model, loaded.config, loaded.tokenizer
        self.model_name, mc = loaded.name, self.model_config
        self.max_model_len = _max_model_len(config.max_model_len, mc.max_position_embeddings)
        kv_dtype = kv_storage_dtype(config.kv_dtype, mc.dtype)  # the KV's dtype, so the pool pages'
        # the attention layers' KV (a hybrid's Gated DeltaNet layers keep a state instead: kvshare.engine.gdn_state)
        self.layout = KVLayout(mc.num_kv_layers, mc.num_kv_heads, mc.head_dim, kv_dtype, config.chunk_tokens)
        self._choose_kernels()
        self.namespace = self._namespace(loaded, kv_dtype)
        self._digests: OrderedDict[str, bytes] = OrderedDict()  # namespace salt -> digest, LRU
        self._kv = KVBuffer(self.layout, self.device, self.max_model_len)
        # CUDA: decode steps replay graphs (kvshare.engine.decode_graph) captured with the KV, else at the first step
        self._graphs: DecodeGraphs | None = None
        self._use_graphs = self.device.type == "cuda" and not config.enforce_eager
        if config.preallocate_kv if config.preallocate_kv is not None else self.device.type == "cuda":
            kv = self._kv.ensure(self.max_model_len)
            if self._use_graphs:
                self._decode_graphs(kv)
        self._local = LocalPrefixCache(config.local_cache_bytes, config.kv_events)  # kv_events: announce it
        self._stats = EngineStats()
        self._lock = threading.Lock()  # one request at a time owns the sequence KV
        self._pool: PoolKV | None = self._connect_pool() if config.pool_socket else None
        # a hybrid's prefill resumes only where it reaches a state (kvshare.engine.hybrid_prefill): in the pool too,
        # whose checkpoints are pages of their own beside the KV pages (kvshare.engine.pool_states)
        self.hybrid: HybridPrefill | None = None
        self._tails: TailGraphSet | None = None  # a hybrid's resumed tails as CUDA graphs, over the preallocated KV
        states = None
        if mc.is_hybrid:
            if self._pool is not None:
                states = PoolStates(self._pool, self.model.state.layout.checkpoint_bytes)
            self.hybrid = self._hybrid_prefill(states)
        # stores each prompt (local cache, pool) beside its decode steps; a request's last token waits for it
        self._publisher = PromptPublisher(self._local, self._kv, self._pool, self.device, states)

    def _hybrid_prefill(self, states: PoolStates | None) -> HybridPrefill:
        """A hybrid's prefill, with the tail graphs where the KV was preallocated with graphs: captured now (their
        warm-up writes the KV's last positions, and no sequence is in it yet)."""
        if self._use_graphs and self._graphs is not None and self.grid is None:
            self._tails = TailGraphSet(self.model, self._graphs.kv)
            with torch.inference_mode():
                self._tails.capture()
        tails = self._tail_graphs if self._tails is not None else None
        return HybridPrefill(self.model, self._kv, self._local, self.config, self.grid, states, tails)

    def _tail_graphs(self, kv: torch.Tensor) -> TailGraphSet | None:
        return self._tails if self._tails is not None and self._tails.kv is kv else None

    def _choose_kernels(self) -> None:
        """The fused ops, prefill's attention, a hybrid's delta-rule kernels and, in the deterministic mode, the
        grid; in that order: the grid's self-test runs with the kernels chosen before it."""
        config, is_hybrid = self.config, self.model_config.is_hybrid
        self.fused = use_fused(self.model, self.device)  # norms, RoPE, SiLU: one pass each (before the grid's test)
        self.attention = use_attention(self.model, config.attention, self.device, config.deterministic)  # prefill's
        self.gdn_kernels = use_gdn_kernels(self.model, self.device) if is_hybrid else None  # the delta rule's
        # the deterministic mode: its self-test refuses it (GridCheckFailed) where this device's kernels are not exact
        check = check_hybrid_grid if is_hybrid else None  # None: the attention models' (grid_check.check_grid)
        self.grid = (
            start_grid(self.model, self.device, config.grid_len, config.chunk_tokens, check)
            if config.deterministic
            else None
        )
        if self.attention.prefill is not None and self.model.prefill_attention is None:  # the grid's test left it
            self.attention = AttentionChoice("sdpa", None, f"{self.attention.name} is not exact here on the grid")

    def _namespace(self, loaded: LoadedModel, kv_dtype: str) -> Namespace:
        """What a page's KV depends on: the model, the KV's layout and precision, the grid (keys are salted by it)."""
        mc = self.model_config
        return Namespace(
            **loaded.identity(self.config.model_revision),
            kv_dtype=kv_dtype,
            kv_precision=kv_precision(kv_dtype),
            num_layers=self.layout.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            chunk_tokens=self.config.chunk_tokens,
            engine_family="builtin",
            state_layout_id=self.model.state.layout.fingerprint() if mc.is_hybrid else "",
            **(self.grid.namespace_fields() if self.grid is not None else {}),
        )

    def _connect_pool(self) -> PoolKV:
        config = self.config
        pool = PoolKV(
            config.pool_socket,
            self.layout,
            self.device,
            self._stats,
            verify_checksums=config.verify_checksums,
            transfer_config=TransferConfig(
                verify_fraction=config.verify_fraction,
                producer_delay_cycles=config.producer_delay_cycles,
                staging_buffers=config.staging_buffers,
            ),
            retry_s=config.pool_retry_s,
            retry_max_s=config.pool_retry_max_s,
            name=f"engine:{self.model_name}",
        )
        # connect (and register the arena) now, and reconnect while no request runs when the pool goes away
        pool.start(idle_lock=self._lock)
        return pool

    # -- public API ------------------------------------------------------------------

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams = SamplingParams(),
        options: RequestOptions = RequestOptions(),
    ) -> Iterator[TokenEvent]:
        """Stream the continuation of ``prompt_ids``; blocking. Exhaust or close() the iterator."""
        ids = np.asarray(prompt_ids)  # checked as one array: a long prompt's list passes cost milliseconds of TTFT
        if ids.size == 0:
            raise ValueError("the prompt has no tokens")
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(
                f"the prompt must be a flat sequence of integer token ids, got {ids.dtype} of shape {ids.shape}"
            )
        vocab = self.model_config.vocab_size
        if ids.min() < 0 or ids.max() >= vocab:
            bad = ids[(ids < 0) | (ids >= vocab)]
            raise ValueError(f"token id {int(bad[0])} lies outside the vocabulary 0..{vocab - 1}")
        if ids.size >= self.max_model_len:
            raise ValueError(
                f"the prompt has {ids.size} tokens; max_model_len {self.max_model_len} leaves no room to generate"
            )
        return self._stream(ids.astype(np.int64, copy=False), params, options)

    def stats(self) -> EngineStats:
        counters = self._local.counters
        return replace(
            self._stats,
            local_hit_chunks=counters.hit_chunks,
            local_miss_chunks=counters.miss_chunks,
            local_inserted_chunks=counters.inserted_chunks,
            local_evicted_chunks=counters.evicted_chunks,
            local_cache_chunks=len(self._local),
            local_cache_bytes=self._local.num_bytes,
            local_cache_capacity_bytes=self._local.capacity_bytes,
            local_out_of_memory=counters.out_of_memory,
            is_pool_connected=self._pool is not None and self._pool.is_connected,
        )

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Requests run inside are left out of the request counters of stats() (the replica's warm-up)."""
        before = replace(self._stats)
        try:
            yield
        finally:
            for name in REQUEST_COUNTERS:
                setattr(self._stats, name, getattr(before, name))

    # -- used by the replica's audit (kvshare.serve.audit) ------------------------------------

    def prompt_chunk_keys(self, prompt_ids: Sequence[int], tenant: str = "") -> list[bytes]:
        """Chained keys of the prompt's full chunks, as a request of ``tenant`` looks them up."""
        return chunk_keys(self._digest(tenant), [int(t) for t in prompt_ids], self.layout.chunk_tokens)

    def drop_chunks(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """Forget chunks found wrong: remove them from the local cache and the pool. (local, pool) counts removed."""
        with self._lock:
            self._kv.held.forget()  # it may hold the chunks found wrong
            if self.hybrid is not None:
                self.hybrid.forget()
            num_local = self._local.discard(keys)
            num_pool = self._pool.drop(list(keys)) if self._pool is not None else 0
            if self.hybrid is not None and self._pool is not None:  # and the states at their ends
                self._pool.drop([state_key(key) for key in keys])
            return num_local, num_pool

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
            self._local.close()
            self._graphs = None  # they hold the KV tensor
            self._kv.release()
        self._publisher.close()

    # -- one request -----------------------------------------------------------------

    def _digest(self, tenant: str) -> bytes:
        digest = self._digests.get(tenant)
        if digest is None:
            digest = self._digests[tenant] = namespace_digest(self.namespace.with_tenant(tenant))
            if len(self._digests) > MAX_CACHED_DIGESTS:  # bounded: every cache_salt makes a namespace
                self._digests.popitem(last=False)
        self._digests.move_to_end(tenant)
        return digest

    def _stream(self, ids: np.ndarray, params: SamplingParams, options: RequestOptions) -> Iterator[TokenEvent]:
        with self._lock:  # held across yields: no other request may touch the sequence KV meanwhile
            n = len(ids)
            digest = self._digest(options.tenant)
            # the last request's tokens still in kv are reused in place (not in the deterministic mode: its grid)
            reuses = options.use_local_cache and self.grid is None and self.config.reuse_in_place
            kv, in_place = self._claim_kv(ids, min(n + params.max_tokens, self.max_model_len), digest, reuses)
            keys = chunk_keys(digest, ids, self.layout.chunk_tokens)  # the array itself: no list round trip
            account = digest if options.account is None else self._digest(options.account)
            if options.timeline is not None:
                options.timeline.mark("hashing")
            started = time.perf_counter()
            logits, provenance, cold_seconds = self._prefill_prompt(kv, ids, keys, options, in_place, digest)
            self._count_prompt(provenance)
            generator, counts, stop_ids = self._sampling_state(ids, params)
            position = n  # tokens whose KV is in kv
            fed: list[int] = []  # generated tokens whose KV is in kv (after the prompt's)
            num_generated = 0
            publishing: Future | None = None
            try:
                while True:
                    token = sample(logits[-1], params, generator, counts)
                    if num_generated == 0 and options.timeline is not None:
                        options.timeline.mark("first_token_sampled")
                    if counts is not None:
                        counts.add(token.token_id)
                    num_generated += 1
                    self._stats.generated_tokens += 1
                    if num_generated == 1:
                        self._stats.prefill_seconds += time.perf_counter() - started
                        started = time.perf_counter()
                    finish = None
                    if token.token_id in stop_ids:
                        finish = "stop"
                    elif num_generated >= params.max_tokens or position + 1 >= self.max_model_len:
                        finish = "length"
                    if finish is not None and publishing is not None:
                        # a response's last token says its prompt is stored (the next turn's lookup)
                        wait_for(publishing)
                    yield TokenEvent(token.token_id, token.logprob, token.top_logprobs, finish, provenance)
                    if publishing is None:  # after the first token, and beside the decode: it delays no other
                        publishing = self._publisher.submit(
                            self._publish, kv, keys, digest, account, options, ids, cold_seconds
                        )
                    if finish is not None:
                        break
                    logits = self._decode_step(kv, token.token_id, position)  # writes only positions >= n
                    fed.append(token.token_id)
                    position += 1
            finally:
                # a consumer that closes the stream after the first token still leaves the prompt's chunks
                if num_generated and publishing is None:
                    self._publish(kv, keys, digest, account, options, ids, cold_seconds)
                if publishing is not None:  # the stream ends, and the next request may reuse kv, once it is stored
                    wait_for(publishing)
                if num_generated and reuses:  # the prompt's KV is complete, and every fed token's; like the
                    self._kv.held.hold(digest, ids, fed)  # local cache, only a request that reuses leaves it
                self._stats.decode_seconds += time.perf_counter() - started

    def _claim_kv(self, ids: np.ndarray, needed: int, digest: bytes, reuses: bool) -> tuple[torch.Tensor, int]:
        """The sequence KV, grown to ``needed`` positions, and the prompt's leading tokens it still holds from the
        last request (when ``reuses`` and it did not grow). Called under the request lock; from here kv holds
        nothing reusable again until this request ends."""
        grows = self._kv.capacity < needed
        if grows:  # the graphs hold the KV tensor, which must go before a larger one comes
            self._graphs = self._tails = None
        in_place = (
            self._kv.held.reusable(digest, ids, len(ids) - 1, self.layout.chunk_tokens) if reuses and not grows else 0
        )
        return self._kv.ensure(needed), in_place

    def _prefill_prompt(
        self, kv: torch.Tensor, ids: np.ndarray, keys: list[bytes], options: RequestOptions, in_place: int, digest
    ) -> tuple[torch.Tensor, Provenance, float | None]:
        """(last-token logits, provenance, the seconds of a prefill that reused nothing, else None): a hybrid's
        prefill resumes from its states (kvshare.engine.hybrid_prefill), an attention model's from its KV."""
        if self.hybrid is None:
            return self._prefill(kv, ids, keys, options, in_place)
        logits, provenance = self.hybrid.prefill(kv, ids, keys, options, in_place, digest)
        return logits, provenance, None

    def _sampling_state(self, ids: np.ndarray, params: SamplingParams):
        """(generator, penalty counts or None, stop token ids) of one request's sampling."""
        generator = make_generator(params.seed)
        counts = TokenCounts(self.model_config.vocab_size, torch.from_numpy(ids)) if params.has_penalties else None
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.tokenizer.eos_token_ids))
        return generator, counts, stop_ids

    def _count_prompt(self, provenance: Provenance) -> None:
        self._stats.num_requests += 1
        self._stats.prompt_tokens_local += provenance.local_tokens
        self._stats.prompt_tokens_pool += provenance.pool_tokens
        self._stats.prompt_tokens_computed += provenance.computed_tokens

    @torch.inference_mode()
    def _decode_step(self, kv: torch.Tensor, token_id: int, position: int) -> torch.Tensor:
        """Logits [1, V] of the token after ``token_id`` at ``position`` (from graphs: valid until the next step)."""
        if self._use_graphs:
            return self._decode_graphs(kv).run(token_id, position)
        step = torch.tensor([token_id], device=self.device)
        return self.model(step, kv, position, self.config.prefill_chunk_tokens)

    @torch.inference_mode()
    def _decode_graphs(self, kv: torch.Tensor) -> DecodeGraphs:
        if self._graphs is None or self._graphs.kv is not kv:
            self._graphs = None
            graphs = (HybridDecodeGraphs if self.model_config.is_hybrid else DecodeGraphs)(self.model, kv)
            graphs.capture()
            self._graphs = graphs
        return self._graphs

    @torch.inference_mode()
    def _prefill(self, kv: torch.Tensor, ids: np.ndarray, keys: list[bytes], options: RequestOptions, in_place: int):
        """Reuse what can be reused, compute the rest; returns (last-token logits [1, V], provenance). ``in_place``:
        the prompt's leading tokens whose KV kv already holds (the last request's); the local cache's and the
        pool's chunks go on from the chunk it ends in (that chunk's tokens the same: its KV is overwritten)."""
        c = self.layout.chunk_tokens
        n = len(ids)
        reusable = min(len(keys), (n - 1) // c)  # always leave at least one token to compute
        if self.grid is not None:
            reusable = self.grid.reusable_chunks(reusable)  # the deterministic mode reuses up to a grid boundary
        # the prompt goes to the device before the load is enqueued: a pageable host->device copy queued
        # behind the load's copies on the copy engine would hold the host (and the compute) until they end
        prompt_ids = torch.from_numpy(ids).to(self.device)
        timeline = options.timeline
        if timeline is not None:
            timeline.start_device(self.device)
        local_chunks = first = in_place // c  # chunks [0, first) are in place
        if options.use_local_cache:
            local_chunks += self._copy_local(kv, keys[first:reusable], first, timeline)
        load, before_layer = self._start_load(kv, keys[local_chunks:reusable], local_chunks, options)
        try:
            if self._pool is not None and self.config.producer_delay_cycles:
                self._pool.inject_producer_delay()  # validation: the store must still wait for this prefill
            pool_chunks = load.num_chunks
            if self.grid is None:
                cached_len = max(in_place, (local_chunks + pool_chunks) * c)
                logits = self._forward_rest(kv, ids, prompt_ids, cached_len, pool_chunks, before_layer)
            else:
                local_chunks, pool_chunks = self.grid.usable_prefix(local_chunks, load)
                cached_len = (local_chunks + pool_chunks) * c
                logits = grid_forward(
                    self.model,
                    prompt_ids[cached_len:],
                    kv,
                    cached_len,
                    self.grid.grid_tokens,
                    before_layer=before_layer,
                )
            if timeline is not None:
                timeline.mark_device("forward_end", self.device)
        finally:
            verified_chunks = self._pool.finish_load(load) if self._pool is not None else 0
            if timeline is not None and load.num_chunks:
                timeline.mark("load_checked")  # the host knows every loaded page passed (or which did not)
        if verified_chunks < pool_chunks:  # a page failed the check that ran beside its copy: computed again
            local_chunks, pool_chunks = self._reusable_after_check(local_chunks, verified_chunks)
            cached_len = (local_chunks + pool_chunks) * c
            if self.grid is None:
                logits = self.model(prompt_ids[cached_len:], kv, cached_len, self.config.prefill_chunk_tokens)
            else:
                logits = grid_forward(self.model, prompt_ids[cached_len:], kv, cached_len, self.grid.grid_tokens)
        provenance = Provenance(
            cached_len - pool_chunks * c,
            pool_chunks * c,
            n - cached_len,
            self.grid is not None,
            pool_kv_bytes=pool_chunks * self.layout.page_bytes,
        )
        return logits, provenance, load.cold_seconds

    def _copy_local(self, kv: torch.Tensor, keys: list[bytes], first: int, timeline) -> int:
        """Copy the longest prefix of ``keys`` the local cache holds into kv's chunks from ``first``; how many."""
        held = self._local.longest_prefix(keys)
        for i, chunk in enumerate(held):
            self._kv.chunk(kv, first + i).copy_(chunk)
        if timeline is not None and held:
            timeline.mark_device("local_copied", self.device)
        return len(held)

    def _start_load(self, kv: torch.Tensor, keys: list[bytes], first_chunk: int, options: RequestOptions):
        """(the pool load of the longest run of ``keys`` the pool holds into kv's chunks from ``first_chunk``, the
        hook the forward calls before each layer: it waits for that layer's pages). The load is under way on
        return: whatever follows must end it with ``PoolKV.finish_load``."""
        timeline = options.timeline
        load = PoolLoad()
        if options.use_pool and self._pool is not None:
            with active(timeline):  # the pool link marks the lease
                load = self._pool.load_prefix(kv, keys, first_chunk=first_chunk)
        before_layer = load.before_layer
        if timeline is not None:
            if load.handle is not None:
                timeline.record_load(load.handle)
            before_layer = timeline.layer_hook(before_layer, self.device)
        if options.is_cancelled is not None:
            before_layer = cancellable(before_layer, options.is_cancelled)
        return load, before_layer

    def _forward_rest(self, kv, ids: np.ndarray, prompt_ids: torch.Tensor, cached_len: int, pool_chunks: int, hook):
        """Logits [1, V] of the prompt's last token, computing its tokens from ``cached_len`` (attention models)."""
        if cached_len == len(ids) - 1 and self._use_graphs and not pool_chunks:  # one token: a decode step's graphs
            return self._decode_step(kv, int(ids[-1]), cached_len)  # (an eager forward is launch-bound)
        return self.model(
            prompt_ids[cached_len:],
            kv,
            cached_len,
            self.config.prefill_chunk_tokens,
            before_layer=hook,
        )

    def _reusable_after_check(self, local_chunks: int, verified_chunks: int) -> tuple[int, int]:
        """(local, pool) chunks still reused when only the load's first ``verified_chunks`` passed their check.

        On CUDA the pages are checked beside the copies (kvshare.transfer.verify), so the forward has already read
        a bad page when the check ends; the prefill runs again from it (in the deterministic mode: from the grid
        boundary before it)::

            loaded   |== local ==|== pool ok ==|X bad|== pool ==|---- computed ----|
            again    |== local ==|== pool ok ==|---------- computed again ---------|
        """
        used = local_chunks + verified_chunks
        if self.grid is not None:
            used = self.grid.reusable_chunks(used)
        return min(local_chunks, used), max(0, used - local_chunks)

    def _publish(
        self,
        kv: torch.Tensor,
        keys: list[bytes],
        digest: bytes,
        account: bytes,
        options: RequestOptions,
        ids,
        cold_seconds: float | None,
    ) -> None:
        """The prompt's full chunks to the local cache and the pool (kvshare.engine.publish); a hybrid's state
        checkpoints at chunk ends to both."""
        checkpoints = self.hybrid.taken_checkpoints() if self.hybrid is not None else []
        self._publisher.publish(kv, keys, digest, account, options, ids, cold_seconds, checkpoints)
