"""A prompt's KV published after its prefill: its full chunks offered to the local prefix cache and the pool
(each keeps what it lacks), side by side on threads of their own, beside the request's decode steps. Both only
read the request's KV; the request holds the engine until its publish is done (``wait_for``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from kvshare.engine.kv_cache import KVBuffer
from kvshare.engine.pool_kv import PoolKV
from kvshare.engine.prefix_cache import LocalPrefixCache
from kvshare.engine.request import RequestOptions


class PromptPublisher:
    """The publish threads of one engine: one stores each prompt, one makes the local cache's copies."""

    def __init__(self, local: LocalPrefixCache, kv_buffer: KVBuffer, pool: PoolKV | None, device: torch.device):
        self._local, self._kv, self._pool, self.device = local, kv_buffer, pool, device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshare-publish")
        # the local cache's copies, beside the pool's store (in a row they outlasted a 128k prompt's decode)
        self._local_inserter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvshare-local-insert")

    def submit(self, publish: Callable[..., None], *args: Any) -> Future:
        """Run ``publish(*args)`` on the publish thread (beside the decode); wait with ``wait_for``."""
        return self._executor.submit(publish, *args)

    @torch.inference_mode()
    def publish(
        self,
        kv: torch.Tensor,
        keys: list[bytes],
        digest: bytes,
        account: bytes,
        options: RequestOptions,
        ids,
        cold_seconds: float | None = None,
        checkpoints: Sequence[tuple[bytes, torch.Tensor]] = (),
    ) -> None:
        """Offer the prompt's full chunks to the local cache and the pool (each keeps what it lacks), side by side:
        both only read ``kv``; the request's lock is held until both are done. ``account``: whose pool quota;
        ``cold_seconds``: the prompt's prefill time when it reused nothing (the pool weighs it); ``checkpoints``:
        a hybrid model's states at chunk ends, (chunk key, bytes), for the local cache."""
        # the request's stream: the local copies go on it (after the prefill, before kv is written next)
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        announced = None if options.tenant else ids  # a tenant's ids: never announced
        local = (
            self._local_inserter.submit(self._insert_locally, kv, keys, stream, announced, checkpoints)
            if options.use_local_cache and self._local.capacity_bytes > 0
            else None
        )
        try:
            if options.use_pool and self._pool is not None:
                self._pool.store(kv, keys, digest, stream, announced, account, cold_seconds=cold_seconds)
        finally:
            if local is not None:
                wait_for(local)
        if options.timeline is not None:
            options.timeline.mark("published")

    def close(self) -> None:
        """Wait for what was submitted, then end the threads."""
        self._executor.shutdown(wait=True)
        self._local_inserter.shutdown(wait=True)

    @torch.inference_mode()
    def _insert_locally(self, kv: torch.Tensor, keys: list[bytes], stream, ids, checkpoints=()) -> None:
        with torch.cuda.stream(stream):  # None (CPU): no stream
            self._local.insert_prompt(keys, lambda i: self._kv.chunk(kv, i), ids)
            for key, data in checkpoints:  # after the chunks: the most recently used, as a lookup leaves them
                self._local.insert_checkpoint(key, data)


def wait_for(publishing: Future) -> None:
    """Wait for a publish; its error is the request's."""
    if (error := publishing.exception()) is not None:
        raise error
