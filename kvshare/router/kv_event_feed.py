"""One publisher's KV events (the pool's, or a replica's own) as the router keeps them: a thread per subscription
that applies each batch to a PoolPrefixIndex (kvshare.router.prefix_index), fills gaps from the replay socket,
and says whether the events can be trusted.

The feed owns its index: the placer asks it what a prompt's chain holds (``held_tokens_of``), under the feed's
lock. pyzmq is imported in the thread only (the ``events`` extra).
"""

from __future__ import annotations

import logging
import threading
import time

from kvshare.pool import events as E
from kvshare.router.prefix_index import PoolPrefixIndex

log = logging.getLogger("kvshare.router.pool_aware")


class KVEventFeed:
    """Subscribes to the pool's KV events (one topic) and keeps a PoolPrefixIndex; says whether they are live."""

    def __init__(
        self,
        endpoint: str,
        topic: str,
        replay_endpoint: str | None = None,
        encoding: str = "map",
        max_lag_s: float = 5.0,
        max_silence_s: float = 30.0,
        media: tuple[str | None, ...] = (E.MEDIUM_CPU,),
    ) -> None:
        self.endpoint, self.topic, self.replay_endpoint, self.encoding = endpoint, topic, replay_endpoint, encoding
        self.max_lag_s, self.max_silence_s = max_lag_s, max_silence_s
        self.index = PoolPrefixIndex(media)
        self.lock = threading.Lock()  # the index, between this thread and the router's loop
        self.last_seq = -1
        self.lag_s = 0.0
        self.num_gaps_lost = 0  # gaps replay could not fill: the index was cleared (it may only miss pages)
        self.num_batches = 0  # batches applied (received or replayed)
        self.last_batch_at: float | None = None  # time.monotonic() of the last one
        self._expected_since: float | None = None  # a routed prompt had chunks the pool did not announce yet
        self._is_stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> KVEventFeed:
        self._thread = threading.Thread(target=self._run, name="kv-events-feed", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._is_stopping = True
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def expect(self, now: float) -> None:
        """A routed prompt has chunks the pool does not hold: its store should be announced."""
        if self._expected_since is None:
            self._expected_since = now

    def why_not_live(self, now: float) -> str | None:
        """None while the events can be trusted; else a one-line reason, the same through one outage (the
        placer logs each outage once; the lag is a gauge)."""
        if self.last_seq < 0:
            return f"no KV events received from {self.endpoint} yet"
        if self.lag_s > self.max_lag_s:
            return f"KV events lag more than {self.max_lag_s:.1f} s"
        if self._expected_since is not None and now - self._expected_since > self.max_silence_s:
            return f"no KV events for more than {self.max_silence_s:.0f} s after prompts the pool did not hold"
        return None

    def held_tokens_of(self, hashes: list[bytes], cache_salt: str | None) -> int:
        """Tokens of the longest prefix of a prompt whose chain at ``chunk_tokens`` is ``hashes`` this publisher
        holds (kvshare.router.prefix_index)."""
        with self.lock:
            return self.index.held_tokens_of(hashes, cache_salt)

    def held_tokens(self, ids, hashes: list[bytes], chunk_tokens: int, cache_salt: str | None) -> int:
        """``held_tokens_of`` where ``hashes`` is the chain of ``ids`` at ``chunk_tokens``, which may not be this
        publisher's chunk size (then the ids are hashed again at its own)."""
        with self.lock:
            if self.index.chunk_tokens == chunk_tokens:  # the request's chain is this index's: hashed once
                return self.index.held_tokens_of(hashes, cache_salt)
            return self.index.held_tokens(ids, cache_salt)

    @property
    def chunk_tokens(self) -> int:
        """The publisher's page size in tokens: from its first event (the index's default until then)."""
        return self.index.chunk_tokens

    def describe(self, now: float) -> str:
        """What the feed has seen, for a log line: batches, the last sequence number, when the last one came,
        gaps replay could not fill, the index's size."""
        since = "never" if self.last_batch_at is None else f"{now - self.last_batch_at:.1f} s ago"
        return (
            f"{self.num_batches} batches, last seq {self.last_seq} {since}, {self.num_gaps_lost} gaps lost, "
            f"{len(self.index)} chunks indexed"
        )

    def _run(self) -> None:
        import zmq

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.connect(self.endpoint)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        replay = None
        if self.replay_endpoint:
            replay = ctx.socket(zmq.DEALER)  # the ROUTER answers one request with many messages
            replay.connect(self.replay_endpoint)
        try:
            while not self._is_stopping:
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != E.SEQ_BYTES:
                    log.warning("ignored a KV events message of %d frames", len(frames))
                    continue
                self._receive(E.seq_of(frames[1]), frames[2], replay)
        finally:
            for sock in (sub, replay):
                if sock is not None:
                    sock.close(linger=0)
            ctx.term()

    def _receive(self, seq: int, payload: bytes, replay) -> None:
        if seq <= self.last_seq:  # the publisher started again from 0: it begins with AllBlocksCleared
            self.last_seq = seq - 1
        if seq > self.last_seq + 1 and replay is not None:
            for r_seq, r_payload in self._replayed(replay, self.last_seq + 1, seq):
                self._apply(r_seq, r_payload)
        if seq > self.last_seq + 1:
            self.num_gaps_lost += 1
            log.warning(
                "KV events %d..%d lost (no replay of them): the pool index starts again", self.last_seq + 1, seq - 1
            )
            with self.lock:
                self.index.clear()  # what remains can only miss pages, never claim a page the pool lost
        self.last_seq = seq - 1
        self._apply(seq, payload)

    def _replayed(self, replay, start: int, end: int) -> list[tuple[int, bytes]]:
        replay.send_multipart((b"", E.seq_bytes(start)))
        got = []
        while replay.poll(2000):
            frames = replay.recv_multipart()
            if len(frames) != 4:
                continue
            _, topic, seq_frame, payload = frames
            r_seq = E.seq_of(seq_frame)
            if r_seq == E.END_SEQ:
                break
            if topic.decode(errors="replace") == self.topic and start <= r_seq < end:
                got.append((r_seq, payload))
        got.sort()
        contiguous = []
        for r_seq, payload in got:
            if r_seq == start + len(contiguous):
                contiguous.append((r_seq, payload))
        return contiguous

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = E.decode_batch(payload, self.encoding)
        except ValueError as exc:
            log.warning("KV event batch %d: %s; the pool index starts again", seq, exc)
            with self.lock:
                self.index.clear()
            self.last_seq = seq
            return
        with self.lock:
            for event in batch.events:
                self.index.apply(event)
        self.last_seq = seq
        self.lag_s = max(0.0, time.time() - batch.ts)
        self._expected_since = None
        self.num_batches += 1
        self.last_batch_at = time.monotonic()
