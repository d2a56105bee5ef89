"""The vLLM connector's worker side: copies between pool pages and vLLM's paged KV.

Independent of vLLM (tested with plain tensors): it is given the per-layer KV tensors in
layer order, their PagedLayout, and the specs the scheduler side planned.

Loads run before the step's forward and are synchronous: each page's checksum is
verified before any of its bytes are used; the first page that fails (checksum, a
lease from another pool, a pool gone) ends the load there, and the tokens from that
point are reported so that vLLM recomputes them. Stores run after the forward: reserve
pages for the chunks, copy each chunk out of vLLM's blocks, checksum, commit. A page is
visible to other replicas only after its commit, and never holds a partial copy.
"""

from __future__ import annotations

import logging
import time

import torch

from kvshare.integrations.pool_link import POOL_DOWN_ERRORS, PoolLink
from kvshare.integrations.vllm_layout import PagedLayout, gather_tokens, scatter_tokens, slot_indices
from kvshare.integrations.vllm_meta import ConnectorCounters, LoadOutcome, LoadSpec, StoreSpec
from kvshare.integrations.vllm_plan import page_slices
from kvshare.layout import KVLayout
from kvshare.pool.checksum import page_checksum
from kvshare.pool.client import PoolRequestError

log = logging.getLogger("kvshare.integrations")


class PoolKVWorker:
    """Moves KV between the pool and one vLLM worker's paged KV tensors."""

    def __init__(self, kv_layout: KVLayout, link: PoolLink, verify_checksums: bool = True) -> None:
        self.kv_layout = kv_layout
        self.link = link
        self.verify_checksums = verify_checksums
        self.counters = ConnectorCounters()
        self.layers: list[torch.Tensor] = []
        self.paged: PagedLayout | None = None

    def register(self, layers: list[torch.Tensor], paged: PagedLayout) -> None:
        """vLLM's KV tensors, one per model layer in layer order, all in layout ``paged``."""
        if len(layers) != self.kv_layout.num_layers:
            raise ValueError(f"vLLM registered {len(layers)} KV layers, the model has {self.kv_layout.num_layers}")
        self.layers = list(layers)
        self.paged = paged

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    def _page_tensor(self, client, offset: int) -> tuple:
        """(numpy bytes view, [L, 2, C, H, D] tensor view) of the page at ``offset`` (zero copy)."""
        view = client.page(offset, self.kv_layout.page_bytes)
        page = torch.from_numpy(view).view(self.paged.dtype).view(self.kv_layout.page_shape)
        return view, page

    # -- loads ---------------------------------------------------------------------

    def load(self, spec: LoadSpec) -> LoadOutcome:
        """Copy the spec's tokens into vLLM's blocks; stops at the first page that cannot be trusted."""
        started = time.perf_counter()
        client, reason = self._client_for(spec.pool_pid) if spec.pages else (None, "no lease backs the load")
        loaded_end = spec.token_start
        if client is not None:
            try:
                loaded_end, reason = self._copy_in(client, spec)
            except Exception as exc:  # a bug or a vanished mapping: recompute, keep serving
                log.error("kvshare: load for request %s failed", spec.req_id, exc_info=True)
                loaded_end, reason = spec.token_start, f"{type(exc).__name__}: {exc}"
        num_loaded = loaded_end - spec.token_start
        self.counters.loaded_tokens += num_loaded
        self.counters.load_bytes += num_loaded * self.kv_layout.bytes_per_token
        self.counters.load_seconds += time.perf_counter() - started
        if loaded_end != spec.token_end:
            self.counters.load_failures += 1
            log.warning("kvshare: load for request %s stopped at token %d of %d..%d: %s; vLLM recomputes the rest",
                        spec.req_id, loaded_end, spec.token_start, spec.token_end, reason)
            return LoadOutcome(spec.req_id, spec.token_start, spec.token_end, loaded_end, reason)
        return LoadOutcome(spec.req_id, spec.token_start, spec.token_end, loaded_end)

    def _copy_in(self, client, spec: LoadSpec) -> tuple[int, str]:
        """Copy page by page; returns (end of the tokens copied, why it stopped early or "")."""
        C = self.kv_layout.chunk_tokens
        loaded_end = spec.token_start
        covered_end = min(spec.token_end, (spec.first_chunk + len(spec.pages)) * C)
        if spec.token_start < spec.first_chunk * C or covered_end <= spec.token_start:
            return loaded_end, "no leased page covers the load"
        for piece in page_slices(spec.token_start, covered_end, spec.first_chunk, len(spec.pages), C):
            ref = spec.pages[piece.page_index]
            if ref.page_bytes != self.kv_layout.page_bytes:
                return loaded_end, f"page of {ref.page_bytes} bytes, this model's pages have {self.kv_layout.page_bytes}"
            view, page = self._page_tensor(client, ref.offset)
            if self.verify_checksums and page_checksum(view) != ref.checksum:
                self.counters.checksum_failures += 1
                self._drop(spec.keys[piece.page_index])
                return loaded_end, f"checksum mismatch in chunk {piece.chunk} (page at offset {ref.offset})"
            position = piece.chunk * C + piece.lo
            src = page[:, :, piece.lo : piece.hi]  # [L, 2, T, H, D]
            if src.device != self.device:
                src = src.to(self.device)
            slots = slot_indices(position, piece.num_tokens, spec.block_ids, self.paged.block_size, self.device)
            for layer, kv in zip(self.layers, src):
                scatter_tokens(layer, self.paged, kv, slots)
            loaded_end = position + piece.num_tokens
        return loaded_end, "" if loaded_end == spec.token_end else "the lease does not cover the whole load"

    def _client_for(self, pool_pid: int):
        """The client mapped onto the arena of the pool ``pool_pid`` (reconnecting once), or (None, why)."""
        client = self.link.client()
        if client is not None and self.link.pool_pid != pool_pid:
            client = self.link.reconnect_now()  # the pool was restarted since our last call
        if client is None:
            return None, "the pool is unreachable"
        if self.link.pool_pid != pool_pid:
            return None, f"lease lost: it came from pool pid {pool_pid}, the pool now is pid {self.link.pool_pid}"
        return client, ""

    def _drop(self, key: bytes) -> None:
        """Remove a chunk found bad from the pool so nobody else loads it."""
        client = self.link.client()
        if client is None:
            return
        try:
            client.drop([key])
        except POOL_DOWN_ERRORS as exc:
            self.counters.pool_errors += 1
            self.link.failed(exc)
        except PoolRequestError as exc:
            self.counters.pool_errors += 1
            log.warning("kvshare: the pool refused to drop a bad chunk: %s", exc)

    # -- stores --------------------------------------------------------------------

    def store(self, spec: StoreSpec) -> int:
        """Reserve, fill and commit pages for the spec's chunks; returns how many were committed."""
        client = self.link.client()
        if client is None or not spec.keys:
            return 0
        started = time.perf_counter()
        C = self.kv_layout.chunk_tokens
        try:
            reservation = client.reserve(spec.namespace, list(spec.keys), self.kv_layout.page_bytes, spec.first_chunk)
        except POOL_DOWN_ERRORS as exc:
            self.counters.pool_errors += 1
            self.link.failed(exc)
            return 0
        except PoolRequestError as exc:
            self.counters.pool_errors += 1
            log.warning("kvshare: the pool refused a reserve: %s", exc)
            return 0
        self.counters.skipped_stores += reservation.num_no_room
        if not reservation.grants:
            return 0
        try:
            checksums = []
            for index, offset in reservation.grants:
                view, page = self._page_tensor(client, offset)
                slots = slot_indices((spec.first_chunk + index) * C, C, spec.block_ids, self.paged.block_size, self.device)
                staging = page if self.device.type == "cpu" else torch.empty(page.shape, dtype=page.dtype, device=self.device)
                for layer, out in zip(self.layers, staging):
                    gather_tokens(layer, self.paged, slots, out)
                if staging is not page:
                    page.copy_(staging)  # device -> host; synchronous, after the forward's kernels
                checksums.append(page_checksum(view))
            committed = client.commit(reservation.reservation_id, checksums)
        except (PoolRequestError, *POOL_DOWN_ERRORS) as exc:
            self._abort(client, reservation.reservation_id, exc)
            return 0
        except Exception as exc:  # a bug in the copy: give the pages back; vLLM keeps serving
            log.error("kvshare: store for request %s failed", spec.req_id, exc_info=True)
            self._abort(client, reservation.reservation_id, exc)
            return 0
        self.counters.stored_chunks += committed
        self.counters.store_bytes += committed * self.kv_layout.page_bytes
        self.counters.store_seconds += time.perf_counter() - started
        return committed

    def _abort(self, client, reservation_id: int, exc: BaseException) -> None:
        self.counters.pool_errors += 1
        log.warning("kvshare: store failed (%s: %s); its pages are aborted", type(exc).__name__, exc)
        if isinstance(exc, POOL_DOWN_ERRORS):
            self.link.failed(exc)
            return  # the daemon aborts a lost client's reservations itself
        try:
            client.abort(reservation_id)
        except POOL_DOWN_ERRORS as abort_exc:
            self.link.failed(abort_exc)
        except PoolRequestError:
            pass
