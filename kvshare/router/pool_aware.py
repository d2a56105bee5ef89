"""The ``pool_aware`` policy: the replica with the least expected time to first token, from what is really held.

For a prompt of ``n`` tokens and each replica ``r``::

    T_r = queue wait on r + (pool tokens not on r's GPU) x KV bytes per token / load bandwidth
          + (n - tokens r or the pool holds) / prefill rate

What the pool holds comes from its KV events (kvshare.pool.events: the pages it committed and has not
evicted, with their token ids); what a replica holds on its GPU is what this router sent it (its own
memory, as ``cache_aware`` keeps). Tenants never see each other's prefixes: every chain of hashes is seeded
by the request's cache_salt, and the pool announces token ids only for pages no tenant salted, so a salted
request finds nothing of the pool here and is placed on queue and prefill alone.

When the events stop (a routed prompt's new chunks are not announced in time), lag, or cannot be decoded,
the policy falls back to round robin until they are live again, with a metric and a log line.

Pure parts (the index, the sent memory, ``expected_ttft``, ``rank``) take ``now`` and need no socket;
``EventFeed`` is the thread with the ZMQ subscription (pyzmq, imported there only).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvshare.keys import DEFAULT_CHUNK_TOKENS
from kvshare.pool import events as E

log = logging.getLogger("kvshare.router.pool_aware")


@dataclass(frozen=True)
class CostModel:
    """The terms of T_r; defaults: the Qwen3-8B shape (bf16 KV) on an H200 through the service."""

    kv_bytes_per_token: int = 147_456  # 36 layers x (K, V) x 8 heads x 128 x 2 bytes
    load_bytes_per_s: float = 20e9
    prefill_tokens_per_s: float = 20_000.0
    queue_s_per_request: float = 0.5  # expected wait behind one request in flight on the replica

    def __post_init__(self) -> None:
        if min(self.kv_bytes_per_token, self.load_bytes_per_s, self.prefill_tokens_per_s) <= 0:
            raise ValueError("KV bytes per token, load bandwidth and prefill rate must be positive")
        if self.queue_s_per_request < 0:
            raise ValueError("the queue wait per request must be >= 0")


def chain_seed(cache_salt: str | None) -> bytes:
    if cache_salt is None:
        return b""
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def chunk_hash(parent: bytes, tokens) -> bytes:
    return hashlib.blake2b(parent + np.asarray(tokens, dtype="<u4").tobytes(), digest_size=8).digest()


def chain(ids, chunk_tokens: int, cache_salt: str | None) -> list[bytes]:
    """Chained hashes of the full chunks of ``ids``, seeded by the salt."""
    hashes, previous = [], chain_seed(cache_salt)
    for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
        previous = chunk_hash(previous, ids[start : start + chunk_tokens])
        hashes.append(previous)
    return hashes


def held_chunks(hashes: list[bytes], held) -> int:
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count


class PoolPrefixIndex:
    """The pool's pages (medium CPU) as chains of token hashes, kept from its KV events."""

    def __init__(self) -> None:
        self.chunk_tokens = DEFAULT_CHUNK_TOKENS
        self._by_block: dict[int | bytes, bytes] = {}  # the event's block hash -> our chain hash
        self._held: set[bytes] = set()

    def __len__(self) -> int:
        return len(self._held)

    def clear(self) -> None:
        self._by_block.clear()
        self._held.clear()

    def apply(self, event) -> None:
        if isinstance(event, (E.AllBlocksCleared, E.PositionalAllBlocksCleared)):
            self.clear()
        elif isinstance(event, (E.BlockRemoved, E.PositionalBlockRemoved)):
            for block in event.block_hashes:
                self._held.discard(self._by_block.pop(block, None))
        elif event.medium == E.MEDIUM_CPU and event.token_ids and event.block_size > 0:
            # no token ids: a salted page (or a foreign one) that a prompt's tokens cannot match
            parent_block = event.parent_block_hash
            parent = chain_seed(None) if parent_block is None else self._by_block.get(parent_block)
            if parent is None or len(event.token_ids) != len(event.block_hashes) * event.block_size:
                return  # its parent is unknown: a chain we cannot extend
            self.chunk_tokens = event.block_size
            for i, block in enumerate(event.block_hashes):
                parent = chunk_hash(parent, event.token_ids[i * event.block_size : (i + 1) * event.block_size])
                self._by_block[block] = parent
                self._held.add(parent)

    def held_tokens(self, ids, cache_salt: str | None) -> int:
        """Tokens of the prompt's longest prefix the pool holds (0 for a salted prompt: see the module)."""
        if cache_salt is not None:
            return 0
        return held_chunks(chain(ids, self.chunk_tokens, None), self._held) * self.chunk_tokens


class SentMemory:
    """What this router sent each replica (its GPU prefix cache, most likely): bounded LRU of chain hashes."""

    def __init__(self, num_replicas: int, max_chunks: int = 200_000) -> None:
        self.max_chunks = max_chunks
        self._sent = [OrderedDict() for _ in range(num_replicas)]

    def held_tokens(self, i: int, hashes: list[bytes], chunk_tokens: int) -> int:
        return held_chunks(hashes, self._sent[i]) * chunk_tokens

    def remember(self, i: int, hashes: list[bytes]) -> None:
        memory = self._sent[i]
        for h in hashes:
            memory[h] = None
            memory.move_to_end(h)
        while len(memory) > self.max_chunks:
            memory.popitem(last=False)


def expected_ttft(cost: CostModel, num_tokens: int, gpu_tokens: int, pool_tokens: int, num_in_flight: int) -> float:
    """T_r in seconds: queue, the load of what only the pool holds, the prefill of what nobody holds."""
    load_tokens = max(0, pool_tokens - gpu_tokens)
    computed = num_tokens - max(gpu_tokens, pool_tokens)
    return (num_in_flight * cost.queue_s_per_request + load_tokens * cost.kv_bytes_per_token / cost.load_bytes_per_s
            + computed / cost.prefill_tokens_per_s)


def rank(times: list[float], is_available: list[bool], rotation: int) -> list[int]:
    """Replica indices, available ones first, least T_r first; ties in turn from ``rotation``."""
    n = len(times)
    return sorted(range(n), key=lambda i: (not is_available[i], times[i], (i - rotation) % n))


class EventFeed:
    """Subscribes to the pool's KV events (one topic) and keeps a PoolPrefixIndex; says whether they are live."""

    def __init__(self, endpoint: str, topic: str, replay_endpoint: str | None = None, encoding: str = "map",
                 max_lag_s: float = 5.0, max_silence_s: float = 30.0) -> None:
        self.endpoint, self.topic, self.replay_endpoint, self.encoding = endpoint, topic, replay_endpoint, encoding
        self.max_lag_s, self.max_silence_s = max_lag_s, max_silence_s
        self.index = PoolPrefixIndex()
        self.lock = threading.Lock()  # the index, between this thread and the router's loop
        self.last_seq = -1
        self.lag_s = 0.0
        self.num_gaps_lost = 0  # gaps replay could not fill: the index was cleared (it may only miss pages)
        self._expected_since: float | None = None  # a routed prompt had chunks the pool did not announce yet
        self._is_stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> "EventFeed":
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
        """None while the events can be trusted; else a one-line reason."""
        if self.last_seq < 0:
            return f"no KV events received from {self.endpoint} yet"
        if self.lag_s > self.max_lag_s:
            return f"KV events lag {self.lag_s:.1f} s (limit {self.max_lag_s:.1f} s)"
        if self._expected_since is not None and now - self._expected_since > self.max_silence_s:
            return f"no KV events for {now - self._expected_since:.0f} s after prompts the pool did not hold"
        return None

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
            log.warning("KV events %d..%d lost (no replay of them): the pool index starts again", self.last_seq + 1,
                        seq - 1)
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


@dataclass(frozen=True)
class PoolAwareConfig:
    """``kvshare route --policy pool_aware --kv-events ENDPOINT [--kv-events-replay ...] --model MODEL``."""

    endpoint: str  # the pool's KV events (its PUB socket), e.g. tcp://127.0.0.1:5557
    model: str  # the replicas' model directory or preset: its tokenizer turns prompts into token ids
    replay_endpoint: str | None = None
    topic: str = "kv@"  # a prefix: the pool publishes each batch on every replica's topic; subscribe to one
    encoding: str = "map"
    cost: CostModel = CostModel()
    max_lag_s: float = 5.0
    max_silence_s: float = 30.0

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events takes tcp://HOST:PORT or ipc://PATH, got {self.endpoint!r}")
        if "*" in self.endpoint:
            raise ValueError(f"--kv-events {self.endpoint}: the router connects; give the pool's host, not *")
        E.check_choice("KV events encoding", self.encoding, E.ENCODINGS)
        if self.max_lag_s <= 0 or self.max_silence_s <= 0:
            raise ValueError("the KV events' lag and silence limits must be positive")


class PoolAwarePlacer:
    """Ranks replicas by T_r while the events are live, in turn (round robin) while they are not."""

    def __init__(self, num_replicas: int, cost: CostModel, feed: EventFeed, tokenizer=None) -> None:
        self.cost = cost
        self.feed = feed
        self.tokenizer = tokenizer
        self.sent = SentMemory(num_replicas)
        self.num_fallbacks = 0
        self.on_fallback = lambda: None  # a metric's inc
        self.fallback_reason: str | None = None  # the last reason, while falling back

    def order(self, prompt_ids, cache_salt: str | None, in_flight: list[int], is_available: list[bool],
              rotation: int, now: float) -> list[int]:
        """Preference order; round robin from ``rotation`` while the events cannot be trusted (each such request
        counted, each outage logged once). Either way the first choice is remembered as holding the prompt."""
        reason = self.feed.why_not_live(now)
        if reason != self.fallback_reason:
            if reason is None:
                log.info("pool_aware: KV events live again; placing by expected TTFT")
            else:
                log.warning("pool_aware: falling back to round robin: %s", reason)
            self.fallback_reason = reason
        ids = list(prompt_ids or ())
        with self.feed.lock:
            chunk_tokens = self.feed.index.chunk_tokens
            pool_tokens = self.feed.index.held_tokens(ids, cache_salt)
        hashes = chain(ids, chunk_tokens, cache_salt)
        if pool_tokens < len(hashes) * chunk_tokens:
            self.feed.expect(now)  # the replica will store the rest: the pool should announce it
        if reason is not None:
            self.num_fallbacks += 1
            self.on_fallback()
            times = [0.0] * len(in_flight)
        else:
            times = [expected_ttft(self.cost, len(ids), self.sent.held_tokens(i, hashes, chunk_tokens), pool_tokens,
                                   q) for i, q in enumerate(in_flight)]
        order = rank(times, is_available, rotation)
        self.sent.remember(order[0], hashes)
        return order

    def prompt_ids(self, prompt, messages) -> list[int] | None:
        """The token ids a replica would compute for the request; None where this router cannot tell."""
        try:
            if messages is not None:
                return list(self.tokenizer.apply_chat_template(messages))
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                return prompt
        except Exception as exc:  # a malformed request: the replica answers it; place it without a prefix
            log.debug("pool_aware: no token ids for a request (%s)", exc)
        return None


def attach_pool_aware(router, config: PoolAwareConfig, registry) -> PoolAwarePlacer:
    """A placer for ``router`` (its feed not started yet), with its metrics in ``registry``."""
    from prometheus_client import Counter, Gauge

    from kvshare.engine.loader import load_tokenizer

    feed = EventFeed(config.endpoint, config.topic, config.replay_endpoint, config.encoding, config.max_lag_s,
                     config.max_silence_s)
    placer = PoolAwarePlacer(router.num_replicas, config.cost, feed, load_tokenizer(config.model))
    router.pool_aware = placer
    fallbacks = Counter("kvshare_router_pool_aware_fallbacks", "Requests placed round robin because the pool's "
                        "KV events were not live", registry=registry)
    placer.on_fallback = fallbacks.inc
    Gauge("kvshare_router_kv_events_live", "1 while the pool's KV events are trusted", registry=registry
          ).set_function(lambda: float(feed.why_not_live(time.monotonic()) is None))
    Gauge("kvshare_router_kv_events_lag_seconds", "Age of the last KV event batch when it arrived",
          registry=registry).set_function(lambda: feed.lag_s)
    Gauge("kvshare_router_pool_index_chunks", "Chunks the pool holds by its KV events (untenanted)",
          registry=registry).set_function(lambda: float(len(feed.index)))
    return placer
