"""The pool's KV events: what the index commits and removes, published on ZMQ as vLLM publishes its own.

``PoolEvents`` listens to the index (on the daemon's loop thread) and queues events; a publisher thread
drains the queue into batches, sends each on every topic, and answers replay requests::

    index.commit / evict / drop / flush --> PoolEvents --queue--> thread --> PUB (topic, seq, batch)
                                                                      \\--> ROUTER replay (buffered batches)

Guarantees: a page is announced only after its commit (bytes and checksum in place); every announced page
that leaves the index (eviction, drop, flush) is announced removed; the first batch is ``AllBlocksCleared``.
A page is announced only when it starts a chain or its parent is announced, so a subscriber never sees a
parent it does not know and never learns of a page that a lookup could not reach. Every topic carries the
same batch under the same sequence number, so each topic's stream is gap-free on its own.

pyzmq is imported here only (the ``events`` extra).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from functools import partial

from kvshare.keys import DEFAULT_CHUNK_TOKENS
from kvshare.pool import events as E
from kvshare.pool.entries import Entry

log = logging.getLogger("kvshare.pool.events")

POOL_TOPIC = "kv@kvshare-pool@kvshare"  # one pool topic, where no replica topics are given


@dataclass(frozen=True)
class KVEventsConfig:
    """``kvshare pool --kv-events ENDPOINT [--kv-events-replay ENDPOINT] [--kv-events-topic T ...]``."""

    endpoint: str  # tcp://*:5557 binds; tcp://host:port connects (vLLM's rule); ipc:// binds
    replay_endpoint: str | None = None  # a ROUTER bound here answers replay requests
    topics: tuple[str, ...] = (POOL_TOPIC,)  # each batch goes out on every one (kv@<replica>@<model>)
    encoding: str = "map"  # or "positional" (vLLM before 0.26)
    hash_kind: str = "int"  # block hashes as vLLM's default 64-bit ints, or the chunk keys' bytes
    block_size: int = DEFAULT_CHUNK_TOKENS  # tokens per page, announced when a page carries no token ids
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_events_per_batch: int = 1024

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"a KV events endpoint is tcp://, ipc:// or inproc://, got {self.endpoint!r}")
        if not self.topics or any(not t for t in self.topics):
            raise ValueError("KV events need at least one non-empty topic")
        E.check_choice("KV events encoding", self.encoding, E.ENCODINGS)
        E.check_choice("KV events hash kind", self.hash_kind, E.HASH_KINDS)
        if min(self.block_size, self.buffer_steps, self.hwm, self.max_events_per_batch) <= 0:
            raise ValueError("block_size, buffer_steps, hwm and max_events_per_batch must be positive")


def _is_bind_endpoint(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _built(item):
    """A queued event, or a function that builds it (deferred to this thread)."""
    return item() if callable(item) else item


class EventPublisher:
    """A PUB socket and an optional replay ROUTER, served by one thread; ``put`` never blocks."""

    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import zmq
        except ImportError:
            raise RuntimeError("KV events need pyzmq: pip install 'kvshare[events]'") from None

        self.config = config
        self.num_batches = 0
        self.num_events = 0
        self.num_replays = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topics = [t.encode() for t in config.topics]
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            if _is_bind_endpoint(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise OSError(f"cannot open the KV events socket {config.endpoint}: {exc}") from None
        self._next_seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def put(self, event) -> None:
        self._queue.put(event)

    def close(self) -> None:
        """Send what is queued, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        if self._thread.is_alive():  # still sending: terminating the context now would wait for it
            log.warning("KV events still queued at exit were not sent")
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=200)
        self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            events, is_closing = [], first is None
            if first is not None:
                events.append(_built(first))
            while len(events) < self.config.max_events_per_batch and not is_closing:
                try:
                    event = self._queue.get_nowait()
                except queue.Empty:
                    break
                if event is None:
                    is_closing = True
                else:
                    events.append(_built(event))
            if events:
                self._send(events)
            if is_closing:
                return

    def _send(self, events: list) -> None:
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        payload = E.encode_batch(E.EventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        self._buffer.append((seq, payload))
        for topic in self._topics:
            self._pub.send_multipart((topic, E.seq_bytes(seq), payload))
        self.num_batches += 1
        self.num_events += len(events)

    def _serve_replay(self) -> None:
        """A client's 8-byte start sequence -> every buffered batch from it on (on every topic), then -1."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != E.SEQ_BYTES:
            log.warning("ignored a malformed KV events replay request (%d frames)", len(frames))
            return
        client_id, _, start = frames
        start_seq = E.seq_of(start)
        for seq, payload in self._buffer:
            if seq >= start_seq:
                for topic in self._topics:
                    self._replay.send_multipart((client_id, b"", topic, E.seq_bytes(seq), payload))
        self._replay.send_multipart((client_id, b"", b"", E.seq_bytes(E.END_SEQ), b""))
        self.num_replays += 1


class PoolEvents:
    """The index's listener: turns commits and removals into events for the publisher (daemon thread only)."""

    def __init__(self, config: KVEventsConfig, publisher) -> None:
        self.config = config
        self.publisher = publisher
        self._announced: set[bytes] = set()  # keys announced stored and not removed since
        # committed pages whose named parent was not announced, by that parent: announced once it is (a page
        # stored after its parent was evicted, before the parent was stored again)
        self._waiting: dict[bytes, list[Entry]] = {}
        publisher.put(E.all_blocks_cleared(config.encoding))

    def committed(self, entries: list[Entry]) -> None:
        """Pages just made visible; a chain's pages parent first, each only when its parent is announced (a page
        whose named parent is not waits for it; one whose parent is not named is never announced). A state
        checkpoint is no KV block: never announced."""
        for entry in sorted(entries, key=lambda e: e.depth):
            if entry.is_state:
                continue
            parent = entry.parent_key
            if entry.depth > 0 and (parent is None or parent not in self._announced):
                if parent is not None:
                    self._waiting.setdefault(parent, []).append(entry)
                continue
            self._announce(entry)

    def _announce(self, entry: Entry) -> None:
        """Announce ``entry``, then the pages waiting for it, theirs, ... (each after its parent)."""
        pending = [entry]
        while pending:
            entry = pending.pop()
            self._announced.add(entry.key)
            # built on the publisher's thread: a 128k-token commit's token lists cost the daemon's loop ~3 ms
            self.publisher.put(partial(self._stored, entry, None if entry.depth == 0 else entry.parent_key))
            pending.extend(reversed(self._waiting.pop(entry.key, [])))

    def _stored(self, entry: Entry, parent: bytes | None):
        tokens = entry.token_ids()
        kind = self.config.hash_kind
        return E.block_stored(
            self.config.encoding,
            [E.external_hash(entry.key, kind)],
            None if parent is None else E.external_hash(parent, kind),
            tokens,
            len(tokens) or self.config.block_size,
        )

    def removed(self, entry: Entry) -> None:
        """A page left the index (evicted, dropped, flushed)."""
        waiting = self._waiting.get(entry.parent_key) if entry.parent_key is not None else None
        if waiting is not None and entry in waiting:  # never announced: it no longer waits for its parent
            waiting.remove(entry)
            if not waiting:
                del self._waiting[entry.parent_key]
        if entry.key in self._announced:
            self._announced.discard(entry.key)
            hashes = [E.external_hash(entry.key, self.config.hash_kind)]
            self.publisher.put(E.block_removed(self.config.encoding, hashes))

    def stats(self) -> dict[str, int]:
        """Batches and events sent, replay requests answered (read from the daemon's thread: plain ints)."""
        pub = self.publisher
        return {"batches": pub.num_batches, "events": pub.num_events, "replays": pub.num_replays}

    def close(self) -> None:
        self.publisher.close()


def open_pool_events(config: KVEventsConfig | None, index) -> PoolEvents | None:
    """Start publishing ``index``'s commits and removals; None when events are off."""
    if config is None:
        return None
    events = PoolEvents(config, EventPublisher(config))
    index.listener = events
    log.info(
        "KV events on %s (replay %s), topics %s",
        config.endpoint,
        config.replay_endpoint or "off",
        ", ".join(config.topics),
    )
    return events
