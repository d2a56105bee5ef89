"""The ZMQ side of ``pool_aware``: a thread per publisher (the pool, or a replica) that keeps its KV events as a
PoolPrefixIndex, fills gaps from the replay socket, and says whether the events can be trusted.

pyzmq is imported in the thread only (the ``events`` extra).
"""

from __future__ import annotations

import logging
import threading
import time

from kvshare.pool import events as E
from kvshare.router.pool_aware import PoolAwareConfig, PoolAwarePlacer, PoolPrefixIndex

log = logging.getLogger("kvshare.router.pool_aware")
# The placer tokenizes every text prompt before its request can be sent. A chat's next turn repeats all but its
# end, so every text is cut into pieces of about this many characters and only pieces no earlier prompt held are
# encoded (kvshare.engine.token_cache); a replica's defaults (one plain encode below 16 KiB, 8 KiB pieces above)
# re-encode all of a prompt under 16 KiB, up to 8 KiB of a longer one. What every placement pays on the loop is
# the look-up; 2 CPU cores, the presets' BPE, 2026-12-06 (benchmarks/router_latency_cpu.py pieces): later turns of
# 6-10k tokens encode in 2.8 ms with 8 KiB pieces, 1.8 with 2 KiB or 1 KiB; a held 128k-token text is looked up
# in 0.5, 1.0 and 2.6 ms.
PLACER_PIECE_CHARS = 2048


class EventFeed:
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

    def start(self) -> EventFeed:
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


def attach_pool_aware(
    router, config: PoolAwareConfig, registry, replica_names: list[str] | None = None, is_batching: bool = False
) -> PoolAwarePlacer:
    """A placer for ``router`` (its feed not started yet), with its metrics in ``registry`` (each replica's
    measured terms labelled by its name in ``replica_names``); ``is_batching``: the replicas batch (vLLM)."""
    from prometheus_client import Counter, Gauge

    from kvshare.engine.loader import load_tokenizer
    from kvshare.engine.token_cache import TokenCacheConfig

    feed = EventFeed(
        config.endpoint, config.topic, config.replay_endpoint, config.encoding, config.max_lag_s, config.max_silence_s
    )
    if config.replica_endpoints and len(config.replica_endpoints) != router.num_replicas:
        raise ValueError(
            f"--replica-kv-events: one per replica ({router.num_replicas}), got {len(config.replica_endpoints)}"
        )
    replica_feeds = [
        EventFeed(e, "", None, config.encoding, config.max_lag_s, config.max_silence_s, media=(E.MEDIUM_GPU, None))
        for e in config.replica_endpoints
    ]
    tokenizer = load_tokenizer(config.model, TokenCacheConfig(piece_chars=PLACER_PIECE_CHARS, min_chars=0))
    placer = PoolAwarePlacer(router.num_replicas, config.cost, feed, tokenizer, replica_feeds, is_batching)
    router.pool_aware = placer
    fallbacks = Counter(
        "kvshare_router_pool_aware_fallbacks",
        "Requests placed round robin because the pool's KV events were not live",
        registry=registry,
    )
    placer.on_fallback = fallbacks.inc
    Gauge("kvshare_router_kv_events_live", "1 while the pool's KV events are trusted", registry=registry).set_function(
        lambda: float(feed.why_not_live(time.monotonic()) is None)
    )
    Gauge(
        "kvshare_router_kv_events_lag_seconds", "Age of the last KV event batch when it arrived", registry=registry
    ).set_function(lambda: feed.lag_s)
    Gauge(
        "kvshare_router_pool_index_chunks", "Chunks the pool holds by its KV events (untenanted)", registry=registry
    ).set_function(lambda: float(len(feed.index)))
    calibration = placer.calibration
    if replica_names is not None:
        calibration.names = [name.rstrip("/") for name in replica_names]
    terms = [
        ("prefill_seconds_per_token", "Measured seconds per prompt token a replica computes", "prefill_s_per_token"),
        (
            "load_seconds_per_token",
            "Measured seconds per prompt token a replica loads from the pool",
            "load_s_per_token",
        ),
        (
            "service_seconds",
            "Measured time a request holds a replica (per request in flight of unknown work)",
            "service_s",
        ),
        ("decode_seconds", "Measured time a request holds a replica after its first token", "decode_s"),
        ("overhead_seconds", "Measured time to first token a replica adds to every request", "overhead_s"),
        ("rate_samples", "Responses behind a replica's measured rates (0: the flags' values)", "num_samples"),
        ("prefill_samples", "Responses in a replica's window with computed and pool tokens known", "num_measured"),
    ]
    for name, help_text, field in terms:
        gauge = Gauge(f"kvshare_router_pool_aware_{name}", help_text, ["replica"], registry=registry)
        for i, replica in enumerate(calibration.names):
            gauge.labels(replica).set_function(lambda i=i, field=field: float(getattr(calibration.rates(i), field)))
    queue = Gauge(
        "kvshare_router_pool_aware_queue_seconds",
        "Expected work ahead on a replica: its requests in flight through this router (kvshare.router.backlog)",
        ["replica"],
        registry=registry,
    )
    depth = Gauge(
        "kvshare_router_pool_aware_local_cache_depth_chunks",
        "New chunks sent to a replica since a chunk was used, below which the chunk is credited as held",
        ["replica"],
        registry=registry,
    )
    for i, replica in enumerate(calibration.names):
        queue.labels(replica).set_function(lambda i=i: placer.backlog.wait_s(i))
        depth.labels(replica).set_function(lambda i=i: float(placer.sent.credited_depth(i)))
    if replica_feeds:
        own = Gauge(
            "kvshare_router_replica_kv_events_live",
            "1 while a replica's own KV events (--replica-kv-events) are trusted for its GPU prefix cache",
            ["replica"],
            registry=registry,
        )
        for replica, replica_feed in zip(calibration.names, replica_feeds):
            own.labels(replica).set_function(lambda f=replica_feed: float(f.why_not_live(time.monotonic()) is None))
    return placer
