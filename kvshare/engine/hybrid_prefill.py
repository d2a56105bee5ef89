"""A hybrid model's prefill in the engine: resume where a state is held, never beyond it; compute the rest.

A Gated DeltaNet layer's state sums up every token before it and cannot be rewound, so a prefix is reusable
only up to a position where the engine can reach the state, and there only with the attention KV of every token
before it. The states it reaches::

    live        the state after the last request's prompt and fed answer (the model's own), when the sequence KV
                still holds that request (in place): a chat's next turn resumes at its end
    prompt end  a checkpoint of the state after the last prompt's first n-1 tokens, with the in-place KV: the same
                prompt again computes its last token alone
    local       checkpoints in the local prefix cache at chunk boundaries (the prompt's last whole chunk, and every
                ``state_checkpoint_chunks`` chunks), with the KV chunks before them (kvshare.engine.prefix_cache)
    pool        checkpoints at the same boundaries in the pool, found by one lookup with the run of KV pages before
                them (kvshare.engine.pool_states; the hit rule: kvshare.engine.hybrid_resume)

    held KV    |==== in place ====|=== local chunks ===|== pool pages ==|=====|   KV past the deepest state is not
    resumed    |==================== KV ============================|S|-- computed --  used (S: the state there)

The deepest of them wins; its state is loaded (the model refuses a forward that does not start where its state
ends) and everything after it is computed, overwriting any KV held beyond it. A state or KV page from the pool
that fails its check is dropped there and the prefill runs again from a shallower state (the last attempt without
the pool). The deterministic mode resumes on its grid only (kvshare.engine.hybrid_grid). The checkpoints a
prefill takes go to the local cache and the pool when the prompt is published (kvshare.engine.publish).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvshare.engine import timeline
from kvshare.engine.config import EngineConfig
from kvshare.engine.gdn_state import Checkpoint
from kvshare.engine.grid import Grid
from kvshare.engine.hybrid_grid import hybrid_grid_forward
from kvshare.engine.hybrid_resume import Resume, ResumeQuery, find_resume
from kvshare.engine.hybrid_tail_graph import TailGraphSet
from kvshare.engine.kv_cache import KVBuffer
from kvshare.engine.pool_states import PoolStates, StatefulLoad
from kvshare.engine.prefix_cache import LocalPrefixCache
from kvshare.engine.request import Provenance, RequestOptions, cancellable
from kvshare.keys import state_key

# a prefill whose pool state or pages failed their checks runs again; its last attempt without the pool
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class PromptEnd:
    """The state after a prompt's first n-1 tokens, for the same namespace (``digest``) and tokens (``ids``)."""

    digest: bytes
    ids: np.ndarray
    checkpoint: Checkpoint


class HybridPrefill:
    """The prefill of a hybrid model's requests (Engine delegates to it), and the checkpoints each one takes."""

    def __init__(
        self,
        model,
        kv_buffer: KVBuffer,
        local: LocalPrefixCache,
        config: EngineConfig,
        grid: Grid | None,
        pool: PoolStates | None = None,
        tails: Callable[[torch.Tensor], TailGraphSet | None] | None = None,
    ) -> None:
        self.model, self._kv, self._local, self.config, self.grid = model, kv_buffer, local, config, grid
        # the engine's tail graphs for a KV tensor (CUDA): a prefill of up to their rows runs them (an eager forward
        # of a few hundred tokens is launch-bound); not in the deterministic mode, which computes on its grid
        self.tails = tails
        self.pool = pool
        self._prompt_end: PromptEnd | None = None
        self._taken: list[tuple[bytes, torch.Tensor]] = []  # (chunk key, checkpoint bytes) the last prefill took

    @torch.inference_mode()
    def prefill(
        self,
        kv: torch.Tensor,
        ids: np.ndarray,
        keys: list[bytes],
        options: RequestOptions,
        in_place: int,
        digest: bytes,
    ) -> tuple[torch.Tensor, Provenance]:
        """Reuse the deepest reachable state and the KV before it, compute the rest; (last-token logits [1, V],
        provenance). ``in_place``: the prompt's leading tokens whose KV the sequence KV holds (the last request's)."""
        for attempt in range(MAX_ATTEMPTS):
            uses_pool = self.pool is not None and options.use_pool and attempt < MAX_ATTEMPTS - 1
            if options.timeline is not None:
                options.timeline.start_device(kv.device)
            with timeline.active(options.timeline):  # the pool lookup marks the lease
                resume = self._resume(ids, keys, options, in_place, digest, uses_pool)
            # the tokens go to the device before the load is enqueued: a pageable host->device copy queued behind
            # the load's copies on the copy engine would hold the host (and the compute) until they end
            tokens = torch.from_numpy(ids[resume.position :]).to(kv.device)
            load = self._load(kv, keys, resume)
            if options.timeline is not None:
                _mark_load(options.timeline, load, bool(resume.chunks), kv.device)
            if load is not None and not self._is_complete(load):  # a page found bad before its copy (CPU)
                self.pool.finish(load)
            else:
                try:
                    logits = self._compute(kv, ids, tokens, keys, options, resume, load, digest)
                finally:
                    is_good = load is None or self.pool.finish(load)
                    if options.timeline is not None and load is not None:
                        options.timeline.mark("load_checked")  # the host knows whether the state and pages passed
                if is_good:
                    break
            # the state or pages found bad were dropped from the pool; what the forward wrote from them is not
            # reused in place: the next attempt resumes from the local cache and the pool only
            in_place, self._prompt_end = 0, None
        part, layout = resume.pool, self._kv.layout
        pool_chunks = part.num_chunks if part is not None else 0
        state_bytes = self.model.state.layout.checkpoint_bytes if part is not None and part.has_state else 0
        pool_tokens, computed_tokens = pool_chunks * layout.chunk_tokens, len(ids) - resume.position
        return logits, Provenance(
            resume.position - pool_tokens,
            pool_tokens,
            computed_tokens,
            self.grid is not None,
            pool_kv_bytes=pool_chunks * layout.page_bytes,
            pool_state_bytes=state_bytes,
        )

    def taken_checkpoints(self) -> list[tuple[bytes, torch.Tensor]]:
        """The checkpoints the last prefill took at chunk ends, handed to the publish (the local cache and the pool):
        (chunk key, bytes). Not kept here after: at the 27B shape each is 147 MiB of device memory."""
        taken, self._taken = self._taken, []
        return taken

    def forget(self) -> None:
        """Drop the prompt-end checkpoint (its chunks were found wrong, or the model's state was reused)."""
        self._prompt_end = None

    def _resume(self, ids, keys: list[bytes], options: RequestOptions, in_place: int, digest: bytes, uses_pool: bool):
        """The deepest state a prefill of ``ids`` may start from (module docstring), never past n-1 tokens."""
        n, c = len(ids), self._kv.layout.chunk_tokens
        best = Resume()
        if in_place and in_place == self.model.state.position:  # the live state: the held sequence's end
            best = Resume(in_place)
        end = self._prompt_end
        if end is not None and end.digest == digest and best.position < len(end.ids) <= in_place:
            if np.array_equal(end.ids, ids[: len(end.ids)]):
                best = Resume(len(end.ids), end.checkpoint)
        if not options.use_local_cache and not uses_pool:
            return best
        reusable = min(len(keys), (n - 1) // c)
        resumable = (lambda m: m * c % self.grid.grid_tokens == 0) if self.grid else (lambda m: True)
        # chunks [0, first) are in place: a checkpoint among them needs no copy
        query = ResumeQuery(keys[:reusable], min(in_place // c, reusable), best, c, resumable)
        local = self._local if options.use_local_cache else None
        return find_resume(query, local, self.pool if uses_pool else None)

    def _load(self, kv: torch.Tensor, keys: list[bytes], resume: Resume) -> StatefulLoad | None:
        """The resume's state and KV into place: the pool's state first, then its pages (on CUDA both enqueued on
        the copy stream), the local cache's chunks and checkpoint. The pool's load, None when none."""
        load = None
        part = resume.pool
        if part is not None:
            state_into = self.model.state.buffer if part.has_state else None
            load = self.pool.load(kv, part.hit, keys, part.first_chunk, part.num_chunks, state_into, part.state_at)
        for i, chunk in enumerate(resume.chunks):
            self._kv.chunk(kv, resume.first_chunk + i).copy_(chunk)
        if resume.checkpoint is not None:
            self.model.state.restore(resume.checkpoint)
        elif part is not None and part.has_state:  # its bytes are the pool's checkpoint (being copied in): the state
            # after that many chunks, so the model refuses a forward from anywhere else
            self.model.state.position = part.state_at * self._kv.layout.chunk_tokens
        return load

    def _is_complete(self, load: StatefulLoad) -> bool:
        """Whether every part of the resume was loaded (a transfer that checks before it copies may end short)."""
        return load.is_state_good and load.num_chunks >= load.num_wanted

    def _compute(
        self, kv, ids: np.ndarray, tokens, keys: list[bytes], options: RequestOptions, resume: Resume, load, digest
    ):
        """The forward of ``tokens`` (``ids`` from the resume's position, on the device), taking the checkpoints
        this prompt keeps; its logits."""
        n, c = len(ids), self._kv.layout.chunk_tokens
        start = resume.position
        if load is not None:
            self.pool.wait_state(load, kv.device)  # the first (GDN) layer reads the state
        wanted = self._checkpoint_chunks(keys, n, start, options)
        checkpoints = {b * c: self.model.state.empty_checkpoint(b * c) for b in wanted}
        keeps_prompt_end = options.use_local_cache and self.grid is None and self.config.reuse_in_place
        if keeps_prompt_end and n - 1 > start:
            checkpoints.setdefault(n - 1, self.model.state.empty_checkpoint(n - 1))
        at_start = self.model.state.snapshot() if keeps_prompt_end and n - 1 == start > 0 else None
        wait = load.before_layer if load else None
        logits = self._graph_forward(tokens, kv, start, checkpoints, options, wait)
        if logits is None:
            logits = self._forward(tokens, kv, start, checkpoints, options, wait)
        self._taken = [(keys[b - 1], checkpoints[b * c].data) for b in wanted]
        end = at_start or checkpoints.get(n - 1)
        self._prompt_end = PromptEnd(digest, ids[: n - 1].copy(), end) if keeps_prompt_end and end else None
        return logits

    def _checkpoint_chunks(self, keys: list[bytes], n: int, start: int, options: RequestOptions) -> list[int]:
        """The chunk boundaries (in chunks) past ``start`` where this prefill of ``n`` tokens keeps the state for the
        local cache and the pool: the prompt's last whole chunk (where its next turn resumes), the last before its
        last token (where the same prompt resumes, on another replica too: one chunk earlier when the prompt is
        whole chunks) and every ``state_checkpoint_chunks`` chunks, on the grid in its mode; for the local cache
        alone only where it does not hold one yet."""
        to_local = options.use_local_cache and self._local.capacity_bytes > 0
        to_pool = options.use_pool and self.pool is not None
        if not to_local and not to_pool:
            return []
        c, every = self._kv.layout.chunk_tokens, self.config.state_checkpoint_chunks
        ends = {len(keys), min(len(keys), (n - 1) // c)}
        if self.grid is not None:
            ends = {self.grid.reusable_chunks(b) for b in ends}
        wanted = ends | ({b for b in range(every, max(ends), every)} if every else set())
        if self.grid is not None:
            wanted = {b for b in wanted if b % self.grid.chunks_per_grid == 0}
        held = (lambda b: False) if to_pool else (lambda b: state_key(keys[b - 1]) in self._local)
        return sorted(b for b in wanted if 0 < b and b * c > start and not held(b))

    def _graph_forward(self, tokens, kv, start: int, checkpoints, options: RequestOptions, wait):
        """The forward through the tail graphs where they hold it: one run up to each checkpoint before the prompt's
        last token, the last run through it (the state before it is the run's ``before_last``). Its logits, or None
        (run it eagerly: a run longer than the tails' rows, the deterministic mode, no graphs)::

            tokens   start |== tail ==|======= tail ======| n
            state            checkpoint ^   n-1 checkpoint ^ ^ checkpoint n
        """
        if self.tails is None or self.grid is not None:
            return None
        end = start + tokens.shape[0]
        cuts = sorted({p for p in checkpoints if p < end - 1} | {end})
        runs = list(zip([start, *cuts[:-1]], cuts))  # [a, b): positions of one tail run
        tails = self.tails(kv)
        if tails is None or not all(tails.holds(b - a, a) for a, b in runs):
            return None
        before_layer = self._hooks(wait, kv, options)
        for a, b in runs:  # the hooks run with the first (the later ones read KV the stream already waited for)
            logits = tails.run(tokens[a - start : b - start], a, before_layer)
            before_layer = None
            if b in checkpoints:
                checkpoints[b].data.copy_(self.model.state.buffer)
        if end - 1 in checkpoints:
            checkpoints[end - 1].data.copy_(tails.before_last)
        if options.timeline is not None:
            options.timeline.mark_device("forward_end", kv.device)
        return logits

    def _hooks(self, wait, kv: torch.Tensor, options: RequestOptions):
        """``wait`` with the request's timeline marks and cancellation, run before each attention layer (or None)."""
        before_layer = wait
        if options.timeline is not None:
            before_layer = options.timeline.layer_hook(wait or (lambda _layer: None), kv.device)
        if options.is_cancelled is not None:
            before_layer = cancellable(before_layer or (lambda _layer: None), options.is_cancelled)
        return before_layer

    def _forward(self, tokens: torch.Tensor, kv: torch.Tensor, start: int, checkpoints, options: RequestOptions, wait):
        """The model's forward (the grid's in its mode); ``wait(layer)``: before attention layer ``layer`` reads
        its KV (a pool load's copies), or None."""
        before_layer = self._hooks(wait, kv, options)
        if self.grid is None:
            chunk = self.config.prefill_chunk_tokens
            logits = self.model(tokens, kv, start, chunk, before_layer=before_layer, checkpoints=checkpoints)
        else:
            logits = hybrid_grid_forward(
                self.model, tokens, kv, start, self.grid.grid_tokens, before_layer, checkpoints=checkpoints
            )
        if options.timeline is not None:
            options.timeline.mark_device("forward_end", kv.device)
        return logits


def _mark_load(steps, load: StatefulLoad | None, copied_local: bool, device) -> None:
    """A request's timeline: the local cache's copies and the pool load, as the dense prefill marks them."""
    if copied_local:
        steps.mark_device("local_copied", device)
    if load is not None and load.handle is not None:
        steps.record_load(load.handle)
