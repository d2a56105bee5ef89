"""A hybrid model's prefill in the engine: resume where a state is held, never beyond it; compute the rest.

A Gated DeltaNet layer's state sums up every token before it and cannot be rewound, so a prefix is reusable
only up to a position where the engine holds the state, and there only with the attention KV of every token
before it. The engine holds states at three kinds of places::

    live        the state after the last request's prompt and fed answer (the model's own), when the sequence KV
                still holds that request (in place): a chat's next turn resumes at its end
    prompt end  a checkpoint of the state after the last prompt's first n-1 tokens, with the in-place KV: the same
                prompt again computes its last token alone
    local       checkpoints in the local prefix cache at chunk boundaries (the prompt's last whole chunk, and every
                ``state_checkpoint_chunks`` chunks), with the KV chunks before them (kvshare.engine.prefix_cache)

    held KV    |==== in place ====|=== local chunks ===|=====|           a chunk past the last checkpoint
    resumed    |================ KV =================|S|-- computed --  is computed again (S: the state there)

The deepest of them wins; its state is loaded (the model refuses a forward that does not start where its state
ends) and everything after it is computed, overwriting any KV held beyond it. The deterministic mode resumes
on its grid only (kvshare.engine.hybrid_grid). The pool is not used for a hybrid model: its pages would need
the states beside them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvshare.engine.config import EngineConfig
from kvshare.engine.gdn_state import Checkpoint
from kvshare.engine.grid import Grid
from kvshare.engine.hybrid_grid import hybrid_grid_forward
from kvshare.engine.kv_cache import KVBuffer
from kvshare.engine.prefix_cache import LocalPrefixCache
from kvshare.engine.request import Provenance, RequestOptions, cancellable
from kvshare.keys import state_key


@dataclass(frozen=True)
class PromptEnd:
    """The state after a prompt's first n-1 tokens, for the same namespace (``digest``) and tokens (``ids``)."""

    digest: bytes
    ids: np.ndarray
    checkpoint: Checkpoint


@dataclass
class Resume:
    """Where a prefill starts: ``position`` tokens reused, the state there (None: the model's live state, or zeros
    at 0), and the local cache's chunks to copy in first (chunk indices from ``first_chunk``)."""

    position: int = 0
    checkpoint: Checkpoint | None = None
    first_chunk: int = 0
    chunks: list[torch.Tensor] = field(default_factory=list)


class HybridPrefill:
    """The prefill of a hybrid model's requests (Engine delegates to it), and the checkpoints each one takes."""

    def __init__(
        self,
        model,
        kv_buffer: KVBuffer,
        local: LocalPrefixCache,
        config: EngineConfig,
        grid: Grid | None,
        decode_step: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None,
    ) -> None:
        self.model, self._kv, self._local, self.config, self.grid = model, kv_buffer, local, config, grid
        # the engine's decode step (CUDA graphs): a prefill of one token runs it (an eager forward is launch-bound);
        # not in the deterministic mode, whose last token is computed on the grid
        self.decode_step = decode_step
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
        """Reuse the deepest held state and the KV before it, compute the rest; (last-token logits [1, V],
        provenance). ``in_place``: the prompt's leading tokens whose KV the sequence KV holds (the last request's)."""
        n, c = len(ids), self._kv.layout.chunk_tokens
        resume = self._resume(ids, keys, options, in_place, digest)
        for i, chunk in enumerate(resume.chunks):
            self._kv.chunk(kv, resume.first_chunk + i).copy_(chunk)
        if resume.checkpoint is not None:
            self.model.state.restore(resume.checkpoint)
        start = resume.position
        wanted = self._checkpoint_chunks(keys, start, options)
        checkpoints = {b * c: self.model.state.empty_checkpoint(b * c) for b in wanted}
        keeps_prompt_end = options.use_local_cache and self.grid is None and self.config.reuse_in_place
        if keeps_prompt_end and n - 1 > start:
            checkpoints.setdefault(n - 1, self.model.state.empty_checkpoint(n - 1))
        at_start = self.model.state.snapshot() if keeps_prompt_end and n - 1 == start > 0 else None
        if n - start == 1 and self.decode_step is not None and self.grid is None and set(checkpoints) <= {n}:
            logits = self.decode_step(kv, int(ids[-1]), start)  # the state is then the one at n
            for checkpoint in checkpoints.values():
                checkpoint.data.copy_(self.model.state.buffer)
        else:
            logits = self._forward(torch.from_numpy(ids[start:]).to(kv.device), kv, start, checkpoints, options)
        self._taken = [(keys[b - 1], checkpoints[b * c].data) for b in wanted]
        end = at_start or checkpoints.get(n - 1)
        self._prompt_end = PromptEnd(digest, ids[: n - 1].copy(), end) if keeps_prompt_end and end else None
        return logits, Provenance(start, 0, n - start, self.grid is not None)

    def taken_checkpoints(self) -> list[tuple[bytes, torch.Tensor]]:
        """The checkpoints the last prefill took at chunk ends, for the local cache: (chunk key, bytes)."""
        return list(self._taken)

    def forget(self) -> None:
        """Drop the prompt-end checkpoint (its chunks were found wrong, or the model's state was reused)."""
        self._prompt_end = None

    def _resume(self, ids: np.ndarray, keys: list[bytes], options: RequestOptions, in_place: int, digest: bytes):
        """The deepest held state a prefill of ``ids`` may start from (module docstring), never past n-1 tokens."""
        n, c = len(ids), self._kv.layout.chunk_tokens
        best = Resume()
        if in_place and in_place == self.model.state.position:  # the live state: the held sequence's end
            best = Resume(in_place)
        end = self._prompt_end
        if end is not None and end.digest == digest and best.position < len(end.ids) <= in_place:
            if np.array_equal(end.ids, ids[: len(end.ids)]):
                best = Resume(len(end.ids), end.checkpoint)
        if not options.use_local_cache:
            return best
        first = in_place // c  # chunks [0, first) are in place: a checkpoint among them needs no copy
        reusable = min(len(keys), (n - 1) // c)
        resumable = (lambda m: m * c % self.grid.grid_tokens == 0) if self.grid else (lambda m: True)
        used, chunks, data = self._local.longest_resumable(keys[:reusable], min(first, reusable), resumable)
        if data is not None and used * c > best.position:
            best = Resume(used * c, Checkpoint(used * c, data), min(first, reusable), chunks)
        return best

    def _checkpoint_chunks(self, keys: list[bytes], start: int, options: RequestOptions) -> list[int]:
        """The chunk boundaries (in chunks) past ``start`` where this prefill keeps the state for the local cache:
        the prompt's last whole chunk and every ``state_checkpoint_chunks`` chunks, on the grid in its mode, where
        the cache does not hold one yet."""
        if not options.use_local_cache or self._local.capacity_bytes == 0:
            return []
        c, every = self._kv.layout.chunk_tokens, self.config.state_checkpoint_chunks
        last = len(keys) if self.grid is None else self.grid.reusable_chunks(len(keys))
        wanted = {last} | ({b for b in range(every, last, every)} if every else set())
        if self.grid is not None:
            wanted = {b for b in wanted if b % self.grid.chunks_per_grid == 0}
        return sorted(b for b in wanted if b * c > start and state_key(keys[b - 1]) not in self._local)

    def _forward(self, tokens: torch.Tensor, kv: torch.Tensor, start: int, checkpoints, options: RequestOptions):
        before_layer = None
        if options.is_cancelled is not None:
            before_layer = cancellable(lambda _layer: None, options.is_cancelled)
        if options.timeline is not None:
            options.timeline.start_device(kv.device)
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
