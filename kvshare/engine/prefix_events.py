"""The local prefix cache's KV events: what a replica's own (GPU) cache holds, in vLLM's wire format.

A replica started with ``kvshare serve --kv-events ENDPOINT`` publishes its local prefix cache as a vLLM
replica publishes its GPU prefix cache (``--kv-events-config``), through the pool's publisher
(kvshare.pool.event_publisher: PUB socket, sequence numbers, replay), on its topic ``kv@<replica>@<model>``::

    request's chunks inserted (tail first) --> announce head first --> BlockStored(medium="GPU", token_ids)
    eviction, an audit's discard          --> BlockRemoved(medium="GPU")
    clear (the engine closes)             --> AllBlocksCleared

The same guarantees as the pool's events: the first batch is ``AllBlocksCleared``; a block is announced once,
only while it is held, and only when it starts a chain or its parent is announced (a subscriber never meets a
parent it has not seen); every announced block that leaves is announced removed. A tenant's chunks (their keys
salted) go out without token ids, so no indexer that rehashes tokens can match them to another tenant's prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvshare.pool import events as E
from kvshare.pool.event_publisher import EventPublisher, KVEventsConfig


class PrefixCacheEvents:
    """The local prefix cache's listener: its inserts and removals as events for a publisher (any thread that
    holds the engine's lock)."""

    def __init__(self, publisher, encoding: str = "map", hash_kind: str = "int", block_size: int = 256) -> None:
        self.publisher = publisher
        self.encoding, self.hash_kind, self.block_size = encoding, hash_kind, block_size
        self._announced: set[bytes] = set()
        publisher.put(E.all_blocks_cleared(encoding))

    def stored(self, keys: Sequence[bytes], ids: Sequence[int] | None, is_held) -> None:
        """A prompt's chunks were offered to the cache: announce, head first, those it holds and has not
        announced, while their parent is announced. ``ids``: the prompt's token ids (None: salted chunks, announced
        without them); chunk i holds ``ids[i * block_size:(i + 1) * block_size]``."""
        c = self.block_size
        for i, key in enumerate(keys):
            parent = keys[i - 1] if i else None
            if key in self._announced or not is_held(key) or (parent is not None and parent not in self._announced):
                continue
            self._announced.add(key)
            tokens = [] if ids is None else [int(t) for t in ids[i * c : (i + 1) * c]]
            self.publisher.put(
                E.block_stored(
                    self.encoding,
                    [E.external_hash(key, self.hash_kind)],
                    None if parent is None else E.external_hash(parent, self.hash_kind),
                    tokens,
                    c,
                    medium=E.MEDIUM_GPU,
                )
            )

    def removed(self, key: bytes) -> None:
        if key in self._announced:
            self._announced.discard(key)
            self.publisher.put(
                E.block_removed(self.encoding, [E.external_hash(key, self.hash_kind)], medium=E.MEDIUM_GPU)
            )

    def cleared(self) -> None:
        if self._announced:
            self._announced.clear()
            self.publisher.put(E.all_blocks_cleared(self.encoding))

    def close(self) -> None:
        self.publisher.close()


def open_prefix_events(config: KVEventsConfig | None) -> PrefixCacheEvents | None:
    """Start publishing a local prefix cache's events; None when they are off."""
    if config is None:
        return None
    return PrefixCacheEvents(EventPublisher(config), config.encoding, config.hash_kind, config.block_size)
