"""The vLLM connector's scheduler side: lookups, leases, and each step's load/store plan.

Independent of vLLM's types (the connector class adapts its hooks), so the bookkeeping
runs in tests against a real pool without a vLLM server. Per request::

    add_request -> match (lookup + lease; may repeat) -> allocated -> plan_step (load spec)
                -> on_report (every rank reported the load's end: release the lease) -> finish

A load runs in the step that computes the request's suffix (synchronous: its layers overlap that compute), or
beside vLLM's steps (``is_async``: vLLM parks the request in WAITING_FOR_REMOTE_KVS until the workers name it in
get_finished; the other requests keep decoding meanwhile). ``async_loads`` "auto" chooses asynchronous when
other requests are running on the replica, since a synchronous load stops their decoding for its whole copy.

A hybrid model (``hybrid``: Gated DeltaNet layers beside attention, kvshare.integrations.vllm.hybrid) looks up its
checkpoints with the chunks: a load ends at the deepest checkpoint the pool's run reaches (never past it, nothing
without one) and always runs beside vLLM's steps; a step that ends on a chunk boundary the checkpoint rule keeps
stores the GDN state there after its chunks.

Leases are taken and released by this process's own pool connection (only the
connection that took a lease may release it); the worker only reads the pages. With tensor
parallelism (``tp_size`` > 1) this side also reserves the pages a step stores and commits them
once every rank has reported its part (kvshare.integrations.vllm.tensor_parallel).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvshare.integrations.vllm.counters import ConnectorCounters, PhaseTimes
from kvshare.integrations.vllm.hybrid import HybridGroups, checkpoint_chunks, resume_points
from kvshare.integrations.vllm.leases import HeldLease, LeaseBook, LeaseState
from kvshare.integrations.vllm.metadata import (
    LoadOutcome,
    LoadSpec,
    StateStoreSpec,
    StepPlan,
    StoreSpec,
    WorkerReport,
)
from kvshare.integrations.vllm.options import ConnectorConfig, TransferParams, provenance
from kvshare.integrations.vllm.pool_pages import release_lease
from kvshare.integrations.vllm.prompt_chunks import chunks_completed, load_limit, lookup_window, tokens_to_load
from kvshare.integrations.vllm.tensor_parallel import TensorParallelStores
from kvshare.keys import Namespace, extend_chunk_keys, namespace_digest, state_key
from kvshare.pool import protocol as P
from kvshare.pool.link import PoolLink, guarded

log = logging.getLogger("kvshare.integrations")


@dataclass
class _Request:
    prompt: Sequence[int]
    options: TransferParams
    ns_digest: bytes
    account: bytes  # whose pool quota its stores count against (PoolScheduler._account)
    is_plain: bool = False  # no tenant salt, no adapter: its chunks' token ids may be announced (KV events)
    keys: list[bytes] = field(default_factory=list)  # keys of the prompt's full chunks, filled on demand
    local_tokens: int = 0
    pool_tokens: int = 0  # loaded and verified
    pool_chunks: range = range(0)  # chunks this request found in the pool (never stored again)
    # vLLM allocated its first prefill: a later match/allocated is a resume after preemption, whose hits
    # (its own blocks still cached, a second load) say nothing of where the prompt first came from
    is_admitted: bool = False
    matched_tokens: int = 0  # vLLM's own hit when match() last asked (this attempt's computed tokens)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request in this step: tokens computed before it, tokens it computes, its block table."""

    req_id: str
    computed_before: int
    num_scheduled: int
    block_ids: Sequence[int]  # the full-attention group's
    tables: Sequence[Sequence[int]] = ()  # a hybrid model's: the block ids of every cache group


class PoolScheduler:
    def __init__(
        self,
        config: ConnectorConfig,
        namespace: Namespace,
        page_bytes: int,
        block_size: int,
        link: PoolLink,
        clock: Callable[[], float] = time.monotonic,
        tp_size: int = 1,
        account_key: str = "",
        hybrid: HybridGroups | None = None,
        state_bytes: int = 0,
    ) -> None:
        """``tp_size``: the replica's tensor parallel ranks (above 1: stores are reserved and committed here);
        ``account_key``: the key the router signs each request's account with ("": no account is taken);
        ``hybrid``: a hybrid model's cache groups, whose GDN state moves as checkpoints of ``state_bytes``
        (kvshare.integrations.vllm.hybrid): a load then ends at a checkpoint and runs beside vLLM's steps."""
        config.check_block_size(block_size)
        self.config = config
        self.block_size = block_size
        self.namespace = namespace
        self.page_bytes = page_bytes
        self.link = link
        self.counters = ConnectorCounters()
        self._clock = clock
        self._leases = LeaseBook(config.lease_ttl_s)
        self._requests: dict[str, _Request] = {}
        self._digests: dict[tuple[str, str], bytes] = {}  # (tenant salt, LoRA) -> namespace digest
        self._account_key = account_key
        self._accounts: dict[str, bytes] = {}  # account -> its digest (the pool's Reserve.account)
        self._has_refused_an_account = False  # warned once: a misconfigured key would otherwise go unnoticed
        self.tp_size = tp_size
        self._parted = TensorParallelStores(tp_size, link, self.counters, page_bytes) if tp_size > 1 else None
        self._reported: dict[str, list[LoadOutcome]] = {}  # a load's outcomes from the ranks that reported it
        self.hybrid, self.state_bytes = hybrid, state_bytes

    # -- requests --------------------------------------------------------------------

    def add_request(
        self,
        req_id: str,
        prompt_token_ids: Sequence[int] | None,
        cache_salt: str | None,
        params: Any,
        lora_id: str = "",
        is_text_only: bool = True,
    ) -> None:
        """Track a request. Its keys are salted by tenant and LoRA; a prompt whose KV its token ids do
        not determine (images, audio, prompt embeddings: ``is_text_only`` False) never uses the pool."""
        scope = (cache_salt or "", lora_id)
        if scope not in self._digests:
            fields = dataclasses.replace(self.namespace, tenant_salt=scope[0], lora_id=scope[1])
            self._digests[scope] = namespace_digest(fields)
        options = TransferParams.from_params(params, self._account_key)
        account = self._account(options.account or "")
        if options.is_account_refused and not self._has_refused_an_account:
            self._has_refused_an_account = True
            log.warning(
                "kvshare: a request names a pool account without a valid tag under this replica's account "
                "key (%s); it is charged to the shared account. Give the router and the replicas one key "
                "($KVSHARE_ACCOUNT_KEY)",
                "set" if self._account_key else "none set",
            )
        if not is_text_only or prompt_token_ids is None:
            options = TransferParams(use_pool=False)
        is_plain = scope == ("", "") and not self.namespace.tenant_salt  # keyed by its tokens alone
        self._requests[req_id] = _Request(prompt_token_ids or [], options, self._digests[scope], account, is_plain)

    def _account(self, account: str) -> bytes:
        """The pool account of a request: the digest of the namespace salted by the account alone, never by
        cache_salt or LoRA, which a client chooses (a quota per value would let it hold one per value it sends).
        A request the router did not sign for has account "": the one shared account of this model."""
        if account not in self._accounts:
            self._accounts[account] = namespace_digest(
                dataclasses.replace(self.namespace, tenant_salt=account, lora_id="")
            )
        return self._accounts[account]

    def has_request(self, req_id: str) -> bool:
        return req_id in self._requests

    def uses_pool(self, req_id: str) -> bool:
        request = self._requests.get(req_id)
        return request is not None and request.options.use_pool

    def _keys(self, request: _Request, num_chunks: int) -> list[bytes]:
        if len(request.keys) < num_chunks:
            C = self.config.chunk_tokens
            request.keys = extend_chunk_keys(request.keys, request.ns_digest, request.prompt[: num_chunks * C], C)
        return request.keys[:num_chunks]

    def match(self, req_id: str, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` the pool will supply (a lease holds their pages)."""
        request = self._requests.get(req_id)
        if request is None or not request.options.use_pool or not self.config.load:
            return 0
        C = self.config.chunk_tokens
        request.matched_tokens = num_computed_tokens
        if not request.is_admitted:
            request.local_tokens = num_computed_tokens  # until vLLM says otherwise in allocated()
        window = lookup_window(len(request.prompt), num_computed_tokens, C, self.block_size)
        now = self._clock()
        current = self._leases.get(req_id)
        if current is not None and current.state is not LeaseState.PENDING:
            return 0  # a load for this request is still under way (asked again after a preemption)
        held = self._leases.reusable(req_id, window.first_chunk, now) if window.num_chunks else None
        if held is None:
            self._release(self._leases.pop(req_id))
            if not window.num_chunks:
                return 0
            times = PhaseTimes()
            keys = self._keys(request, window.end_chunk)[window.first_chunk :]
            times.mark("hash")
            points = self._resume_points(request, num_computed_tokens)
            held = self._lookup(req_id, keys, window.first_chunk, now, points)
            times.mark("lookup")
            log.debug(
                "kvshare timing: match %s chunks=%d hit=%d %s",
                req_id,
                len(keys),
                len(held.pages) if held is not None else 0,
                times.line(),
            )
            if held is None:
                return 0
        num_tokens = tokens_to_load(
            len(request.prompt), num_computed_tokens, C, held.first_chunk, len(held.pages), self.block_size
        )
        if num_tokens == 0:
            self._release(self._leases.pop(req_id))
            return 0
        held.token_start, held.token_end = num_computed_tokens, num_computed_tokens + num_tokens
        held.is_async = self._prefers_async(req_id)
        return num_tokens

    def is_async(self, req_id: str) -> bool:
        """Whether the load match() last offered for the request runs beside vLLM's steps (vLLM is told so)."""
        held = self._leases.get(req_id)
        return held is not None and held.state is LeaseState.PENDING and held.is_async

    def _prefers_async(self, req_id: str) -> bool:
        """Asynchronous where other requests run on the replica (admitted, not waiting for a load of their own); a
        hybrid model's always: vLLM copies the GDN state out of its block before the step's loads would start."""
        if self.hybrid is not None:
            return True
        if self.config.async_loads != "auto":
            return self.config.async_loads == "always"
        for other, request in self._requests.items():
            held = self._leases.get(other)
            if other != req_id and request.is_admitted and not (held is not None and held.is_async):
                return True
        return False

    def _resume_points(self, request: _Request, num_computed_tokens: int) -> list[int]:
        """A hybrid model's chunk counts a load may end at (its checkpoints), deepest first; [] for any other."""
        if self.hybrid is None:
            return []
        C, n = self.config.chunk_tokens, len(request.prompt)
        return resume_points(num_computed_tokens, load_limit(n, self.block_size), n // C, C)

    def _lookup(
        self, req_id: str, keys: list[bytes], first_chunk: int, now: float, points: list[int]
    ) -> HeldLease | None:
        """Lease the longest run of ``keys`` (chunks from ``first_chunk``); for a hybrid model only up to the deepest
        checkpoint of ``points`` (chunk counts, deepest first) that the run reaches, with that checkpoint."""
        client = self.link.client()
        if client is None or (self.hybrid is not None and not points):
            return None
        if self.hybrid is None:
            ask = lambda: client.lookup(keys, self.page_bytes)  # noqa: E731
        else:
            states = [
                P.StateCandidate(key=state_key(keys[j - first_chunk - 1]), num_kv=j - first_chunk) for j in points
            ]
            ask = lambda: client.lookup(keys, self.page_bytes, states=states, state_page_bytes=self.state_bytes)  # noqa: E731
        lease = guarded(self.link, self.counters, "a lookup", ask)
        if lease is None:
            return None
        self.counters.lookups += 1
        if not lease.pages:
            return None
        pages = list(lease.pages)
        owner = (self.link.pool_id, self.link.holder)
        held = HeldLease(lease.lease_id, first_chunk, pages, keys[: len(pages)], now, owner)
        if self.hybrid is not None:
            if lease.state is None:  # KV without the state after it is of no use: computed instead
                self._release(held)
                return None
            num_pages = points[lease.state.index] - first_chunk  # never KV beyond the checkpoint
            held.pages, held.keys = pages[:num_pages], keys[:num_pages]
            held.state_page, held.state_key = lease.state.page, state_key(keys[num_pages - 1])
        self._leases.put(req_id, held)
        return held

    def allocated(
        self,
        req_id: str,
        num_external_tokens: int,
        local_tokens: int | None = None,
        block_ids: Sequence[int] | None = None,
        tables: Sequence[Sequence[int]] = (),
    ) -> None:
        """vLLM allocated blocks and loads ``num_external_tokens`` (0: it decided not to) after
        ``local_tokens`` of its own prefix cache (None: unknown, the value match() saw stands). ``block_ids``:
        the request's blocks, which an asynchronous load copies into (no step's scheduler output names them);
        ``tables``: a hybrid model's block ids of every cache group (the GDN state's blocks are among them)."""
        request = self._requests.get(req_id)
        is_resumed = request is not None and request.is_admitted
        if request is not None and not is_resumed:
            request.is_admitted = True
            if local_tokens is not None:
                request.local_tokens = local_tokens
        # where this attempt's blocks start: the first prefill's hit, or what match() saw for the resume
        if request is not None:
            local_tokens = request.matched_tokens if is_resumed else request.local_tokens
        local_tokens = local_tokens or 0
        held = self._leases.get(req_id)
        if held is None or held.state is not LeaseState.PENDING:
            if num_external_tokens:
                # never expected; the worker reports these tokens as failed, so vLLM recomputes them
                log.error(
                    "kvshare: vLLM expects %d pool tokens for %s but no lease backs them", num_external_tokens, req_id
                )
                self._release(self._leases.pop(req_id))
                self._leases.put(
                    req_id,
                    HeldLease(
                        0,
                        0,
                        [],
                        [],
                        self._clock(),
                        (self.link.pool_id, b""),
                        local_tokens,
                        local_tokens + num_external_tokens,
                        LeaseState.SCHEDULED,
                    ),
                )
            return
        if num_external_tokens == 0:
            self._release(self._leases.pop(req_id))
            return
        # more than the lease covers is never expected either: the worker reports the excess as failed
        if self.hybrid is not None:
            held.state_blocks = self._state_blocks(req_id, held, num_external_tokens, tables)
        held.token_end = held.token_start + num_external_tokens
        held.is_resumed = is_resumed
        held.block_ids = tuple(block_ids) if held.is_async and block_ids is not None else ()
        if held.is_async and not held.block_ids:  # never expected: no blocks to copy into, so a load of none
            log.error("kvshare: vLLM allocated an asynchronous load for %s without naming its blocks", req_id)
        self.counters.hit_tokens += num_external_tokens
        self._leases.mark(req_id, LeaseState.SCHEDULED)

    def _state_blocks(
        self, req_id: str, held: HeldLease, num_external_tokens: int, tables: Sequence[Sequence[int]]
    ) -> tuple[int, ...]:
        """Per GDN layer, the block vLLM resumes the request's state from; () where the load cannot end at its
        checkpoint (vLLM allocated another length): the worker then loads nothing and vLLM computes it all."""
        if held.token_start + num_external_tokens != held.token_end or not tables:
            log.error(
                "kvshare: vLLM allocated %d pool tokens for %s, not up to its GDN checkpoint at %d",
                num_external_tokens,
                req_id,
                held.token_end,
            )
            return ()
        return self.hybrid.state_blocks(held.token_end, tables)

    # -- steps -------------------------------------------------------------------------

    def plan_step(self, scheduled: list[ScheduledRequest]) -> StepPlan:
        """This step's loads (for requests just allocated: those scheduled in it, and asynchronous ones, which
        vLLM parks) and stores (chunks the step completes)."""
        for held in self._leases.take_expired(self._clock()):
            self.counters.expired_leases += 1
            self._release(held)
        C = self.config.chunk_tokens
        loads, stores, state_stores = [], [], []
        for step in scheduled:
            request = self._requests.get(step.req_id)
            if request is None:
                continue
            held = self._leases.get(step.req_id)
            if held is not None and held.state is LeaseState.SCHEDULED:
                held.is_async = False  # scheduled in this step: vLLM waits for nothing, the forward reads it
                loads.append(self._load_spec(step.req_id, request, held, tuple(step.block_ids)))
            if self.config.store and request.options.use_pool:
                done = chunks_completed(
                    step.computed_before, step.computed_before + step.num_scheduled, len(request.prompt), C
                )
                stores.extend(self._store_specs(step, request, [c for c in done if c not in request.pool_chunks]))
                state_stores.extend(self._state_store_specs(step, request))
        for req_id, held in self._leases.with_state(LeaseState.SCHEDULED):
            request = self._requests.get(req_id)
            if held.is_async and request is not None:
                loads.append(self._load_spec(req_id, request, held, held.block_ids))
                continue
            log.error("kvshare: request %s was allocated a pool load but not scheduled; releasing its lease", req_id)
            self._release(self._leases.pop(req_id))
        return StepPlan(tuple(loads), tuple(stores), tuple(state_stores))

    def _state_store_specs(self, step: ScheduledRequest, request: _Request) -> list[StateStoreSpec]:
        """A hybrid model's checkpoint where the step ends on a chunk boundary it keeps one at (hybrid.
        checkpoint_chunks) beyond what came from the pool: vLLM holds the state there until its next step."""
        end, C = step.computed_before + step.num_scheduled, self.config.chunk_tokens
        if self.hybrid is None or end % C or not step.tables:
            return []
        num_chunks = end // C
        wanted = checkpoint_chunks(len(request.prompt), C, self.config.state_checkpoint_chunks)
        if num_chunks not in wanted or num_chunks <= request.pool_chunks.stop:
            return []
        key = state_key(self._keys(request, num_chunks)[num_chunks - 1])
        blocks = self.hybrid.state_blocks(end, step.tables)
        return [StateStoreSpec(step.req_id, request.ns_digest, num_chunks, key, blocks, request.account)]

    def _load_spec(self, req_id: str, request: _Request, held: HeldLease, block_ids: tuple[int, ...]) -> LoadSpec:
        """The worker's order for a lease vLLM allocated; the lease is in flight from here on."""
        self._leases.mark(req_id, LeaseState.IN_FLIGHT)
        request.pool_chunks = range(held.first_chunk, held.first_chunk + len(held.pages))
        return LoadSpec(
            req_id,
            held.owner[0],
            held.first_chunk,
            tuple(held.pages),
            tuple(held.keys),
            held.token_start,
            held.token_end,
            block_ids,
            held.is_async,
            held.state_page,
            held.state_key,
            held.state_blocks,
        )

    def _store_specs(self, step: ScheduledRequest, request: _Request, chunks: list[int]) -> list[StoreSpec]:
        if not chunks:
            return []
        keys = self._keys(request, chunks[-1] + 1)
        runs, start = [], chunks[0]
        for previous, chunk in zip(chunks, chunks[1:] + [None]):
            if chunk != previous + 1:
                runs.append(range(start, previous + 1))
                start = chunk
        block_ids = tuple(step.block_ids)
        C, prompt = self.config.chunk_tokens, request.prompt
        announced = request.is_plain and self.link.announces  # tokens an indexer may rehash
        specs = [
            StoreSpec(
                step.req_id,
                request.ns_digest,
                r.start,
                tuple(keys[r.start : r.stop]),
                block_ids,
                account=request.account,
                parent_key=keys[r.start - 1] if r.start else b"",
                token_ids=tuple(prompt[r.start * C : r.stop * C]) if announced else None,
            )
            for r in runs
        ]
        return specs if self._parted is None else [p for p in map(self._parted.reserve, specs) if p is not None]

    def on_report(self, report: WorkerReport) -> None:
        """Ranks report loads that ended: once every rank has, release the lease and record what arrived (the
        tokens every rank loaded). A synchronous load is reported by all ranks in its step's report; an
        asynchronous one by each rank in the pass its copies ended, which may differ between ranks."""
        for part in report.stores:
            if self._parted is not None:
                self._parted.add_part(part)
        for outcome in report.loads:
            self._reported.setdefault(outcome.req_id, []).append(outcome)
        for req_id in [r for r, outcomes in self._reported.items() if len(outcomes) >= self.tp_size]:
            self._load_ended(min(self._reported.pop(req_id), key=lambda outcome: outcome.loaded_end))

    def _load_ended(self, outcome: LoadOutcome) -> None:
        C = self.config.chunk_tokens
        held = self._leases.pop(outcome.req_id)
        self._release(held)
        request = self._requests.get(outcome.req_id)
        if request is None:
            return
        if held is None or not held.is_resumed:
            request.pool_tokens += outcome.num_loaded
        if not outcome.is_complete and held is not None:
            # chunks from the failed one on are recomputed and may be stored again
            request.pool_chunks = range(held.first_chunk, max(outcome.loaded_end // C, held.first_chunk))

    def finish(self, req_id: str) -> dict[str, Any] | None:
        """The request is done: its provenance for kv_transfer_params; leases not yet in flight are released."""
        request = self._requests.pop(req_id, None)
        held = self._leases.get(req_id)
        in_flight = 0
        if held is not None and held.state is LeaseState.IN_FLIGHT:
            # the lease is released by on_report once every rank reported the load's end (the pages may still
            # be copied). vLLM finishes a request in the step that loaded synchronously only when the load
            # succeeded; an asynchronous one still in flight (an aborted request) supplied nothing
            in_flight = held.token_end - held.token_start if not (held.is_resumed or held.is_async) else 0
        elif held is not None:
            self._release(self._leases.pop(req_id))
        if request is None:
            return None
        return provenance(
            self.config.replica,
            len(request.prompt),
            request.local_tokens,
            request.pool_tokens + in_flight,
            request.ns_digest,
        )

    # -- pool --------------------------------------------------------------------------

    def _release(self, held: HeldLease | None) -> None:
        """Release a lease through this link (the holder that took it) while the pool that granted it still runs."""
        if held is None or not held.lease_id or held.owner[1] != self.link.holder:
            return
        release_lease(self.link, held.lease_id, held.owner[0])

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def close(self) -> None:
        if self._parted is not None:
            self._parted.abort_pending()
        self.link.close()
