"""The ``pool_aware`` policy: the replica with the least expected time to first token, from what is really held.

For a prompt of ``n`` tokens and each replica ``r``::

    T_r = queue wait on r + (pool tokens not on r's GPU) x KV bytes per token / load bandwidth
          + (n - tokens r or the pool holds) / prefill rate

The load and prefill rates and a request's decode time are measured per replica from the responses the router
relays (kvshare.router.calibration); the flags give their values until enough responses have been seen. The
queue wait is the expected work ahead on r (kvshare.router.backlog): each request this router has in flight
there with the prefill and load it was expected to need plus r's decode time, so a replica behind long prompts
looks as busy as it is. Replicas whose T_r is within ``NEAR_TIE`` of the least are taken in turn: a difference
inside the measurements' noise does not send every request to the same replica.

What the pool holds comes from its KV events (kvshare.pool.events: the pages it committed and has not
evicted, with their token ids); what a replica holds on its GPU is what this router sent it (its own
memory, as ``cache_aware`` keeps, credited only as deep as the replica's cache was seen to keep:
kvshare.router.sent_memory). Tenants never see each other's prefixes: every chain of hashes is seeded
by the request's cache_salt, and the pool announces token ids only for pages no tenant salted, so a salted
request finds nothing of the pool here and is placed on queue and prefill alone.

``CostModel(use_pool_term=False)`` (``kvshare route --no-pool-term``) is the GPU-only variant: the pool's pages
are left out of T_r, as a router that sees only the replicas' GPU caches would place.

When the events stop (a routed prompt's new chunks are not announced in time), lag, or cannot be decoded,
the policy falls back to round robin until they are live again, with a metric and a log line.

A chat's next turn is placed on the ids of the text earlier prompts held, its new tail encoded meanwhile
(kvshare.router.prompt_ids): the sent memory takes the tail's chunks when they are in.

Pure: the index, the sent memory, ``expected_ttft``, ``rank`` and the placer take ``now`` and need no socket;
kvshare.router.event_feed is the thread with the ZMQ subscription.
"""

from __future__ import annotations

import array
import hashlib
import logging
import sys
from dataclasses import dataclass

from kvshare.keys import DEFAULT_CHUNK_TOKENS
from kvshare.pool import events as E
from kvshare.router.backlog import Backlog, Job
from kvshare.router.calibration import Calibration, Placement, Rates, ResponseTiming, split_cached
from kvshare.router.prompt_ids import KnownPrefix, encoded, prompt_ids, prompt_of
from kvshare.router.sent_memory import SentMemory

log = logging.getLogger("kvshare.router.pool_aware")
NEAR_TIE = 0.05  # T_r within this fraction of the least: a tie, broken in turn


@dataclass(frozen=True)
class CostModel:
    """The starting terms of T_r (measured ones replace them: kvshare.router.calibration); defaults: the Qwen3-8B
    shape (bf16 KV) on an H200 through the service."""

    kv_bytes_per_token: int = 147_456  # 36 layers x (K, V) x 8 heads x 128 x 2 bytes
    load_bytes_per_s: float = 20e9
    prefill_tokens_per_s: float = 20_000.0
    queue_s_per_request: float = 0.5  # a request's time on a replica after its first token (its decode)
    # False: the GPU-only variant (what llm-d's precise prefix scorer does): a replica is credited only with
    # what its own GPU holds; the pool's pages are invisible, so a prefix only the pool holds counts as prefill
    use_pool_term: bool = True

    def __post_init__(self) -> None:
        if min(self.kv_bytes_per_token, self.load_bytes_per_s, self.prefill_tokens_per_s) <= 0:
            raise ValueError("KV bytes per token, load bandwidth and prefill rate must be positive")
        if self.queue_s_per_request < 0:
            raise ValueError("the queue wait per request must be >= 0")

    def prior_rates(self) -> Rates:
        """These terms as per-token seconds: the calibration's starting values."""
        return Rates(
            overhead_s=0.0,
            prefill_s_per_token=1.0 / self.prefill_tokens_per_s,
            load_s_per_token=self.kv_bytes_per_token / self.load_bytes_per_s,
            service_s=self.queue_s_per_request,
            decode_s=self.queue_s_per_request,
        )


def chain_seed(cache_salt: str | None) -> bytes:
    if cache_salt is None:
        return b""
    return hashlib.blake2b(b"cache_salt\0" + cache_salt.encode("utf-8", "surrogatepass"), digest_size=8).digest()


def le_u32(ids) -> bytes:
    """Token ids as little-endian 4-byte unsigned integers (array's conversion of a list: 5x numpy's; an int
    array, as the tokenizer's ``encode_array`` gives, is converted by numpy). An id outside 0..2**32-1 raises
    OverflowError either way."""
    if hasattr(ids, "dtype"):
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= 1 << 32):
            raise OverflowError("a token id does not fit 4 unsigned bytes")
        return ids.astype("<u4", copy=False).tobytes()
    data = array.array("I", ids)
    if data.itemsize != 4:
        raise RuntimeError("this platform's C unsigned int is not 4 bytes; token ids cannot be hashed here")
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def chunk_hash(parent: bytes, tokens) -> bytes:
    return hashlib.blake2b(parent + le_u32(tokens), digest_size=8).digest()


def chain(ids, chunk_tokens: int, cache_salt: str | None) -> list[bytes]:
    """Chained hashes of the full chunks of ``ids``, seeded by the salt: ``chunk_hash`` of each chunk in turn,
    over the prompt's bytes converted once (converting chunk by chunk cost more than the hashes)."""
    hashes, previous = [], chain_seed(cache_salt)
    data = memoryview(le_u32(ids))
    step = 4 * chunk_tokens
    for start in range(0, len(data) - step + 1, step):
        previous = hashlib.blake2b(previous + data[start : start + step], digest_size=8).digest()
        hashes.append(previous)
    return hashes


def _whole_chain(whole, chunk_tokens: int, cache_salt: str | None, known: list[bytes]) -> list[bytes]:
    """The chain of a KnownPrefix's whole ids once ``whole`` (their future) is done; ``known`` where it failed."""
    if whole.cancelled() or whole.exception() is not None:
        return known
    return chain(whole.result(), chunk_tokens, cache_salt)


def held_chunks(hashes: list[bytes], held) -> int:
    count = 0
    for h in hashes:
        if h not in held:
            break
        count += 1
    return count


class PoolPrefixIndex:
    """The blocks one publisher holds as chains of token hashes, kept from its KV events: the pool's (medium
    CPU), or a replica's GPU prefix cache (medium GPU, or none as older vLLM sends)."""

    def __init__(self, media: tuple[str | None, ...] = (E.MEDIUM_CPU,)) -> None:
        self.media = media
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
        elif event.medium in self.media and event.token_ids and event.block_size > 0 and not _is_keyed(event):
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
        return self.held_tokens_of(chain(ids, self.chunk_tokens, None), cache_salt)

    def held_tokens_of(self, hashes: list[bytes], cache_salt: str | None) -> int:
        """``held_tokens`` of a prompt whose ``chain`` at this index's chunk size is ``hashes``."""
        return 0 if cache_salt is not None else held_chunks(hashes, self._held) * self.chunk_tokens


def _is_keyed(event) -> bool:
    """A block whose hash took more than its tokens (vLLM's extra_keys, one entry a block, None for a plain one: a
    cache_salt, a LoRA, media): a prompt's tokens alone must not match it (another tenant's block would steer)."""
    keys = getattr(event, "extra_keys", None) or ()
    return any(k is not None for k in keys) or bool(getattr(event, "lora_name", None) or event.lora_id)


def expected_ttft(
    cost: CostModel, num_tokens: int, gpu_tokens: int, pool_tokens: int, num_in_flight: int, rates: Rates | None = None
) -> float:
    """T_r in seconds with the queue as ``num_in_flight`` requests of the mean service time each."""
    r = cost.prior_rates() if rates is None else rates
    return num_in_flight * r.service_s + expected_prefill(cost, num_tokens, gpu_tokens, pool_tokens, r)


def expected_prefill(
    cost: CostModel, num_tokens: int, gpu_tokens: int, pool_tokens: int, rates: Rates | None = None
) -> float:
    """T_r less the queue, in seconds: the load of what only the pool holds, the prefill of what nobody holds;
    by the replica's measured ``rates``, else the cost model's own."""
    r = cost.prior_rates() if rates is None else rates
    if not cost.use_pool_term:
        pool_tokens = 0
    load_tokens = max(0, pool_tokens - gpu_tokens)
    computed = num_tokens - max(gpu_tokens, pool_tokens)
    return r.overhead_s + load_tokens * r.load_s_per_token + computed * r.prefill_s_per_token


def rank(times: list[float], is_available: list[bool], rotation: int, near_tie: float = 0.0) -> list[int]:
    """Replica indices, available ones first, least T_r first; those within ``near_tie`` (a fraction) of the
    least available T_r count as tied; ties in turn from ``rotation``."""
    n = len(times)
    best = min((t for t, ok in zip(times, is_available) if ok), default=min(times, default=0.0))
    tied = [ok and t <= best * (1.0 + near_tie) for t, ok in zip(times, is_available)]

    def key(i: int) -> tuple:  # the tied in turn, then the rest by T_r
        return (not is_available[i], not tied[i], 0.0 if tied[i] else times[i], (i - rotation) % n)

    return sorted(range(n), key=key)


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
    replica_endpoints: tuple[str, ...] = ()  # each replica's own KV events (vLLM's --kv-events-config), in order

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

    def __init__(
        self,
        num_replicas: int,
        cost: CostModel,
        feed,
        tokenizer=None,
        replica_feeds: list | None = None,
        is_batching: bool = False,
    ) -> None:
        """``is_batching``: the replicas decode their running requests beside a new one's prefill (vLLM), so a
        replica's queue is the prefill ahead, not every request's decode (kvshare.router.backlog)."""
        self.cost = cost
        self.feed = feed
        self.replica_feeds = replica_feeds or []  # each replica's GPU events, where it publishes them
        self.tokenizer = tokenizer
        self.sent = SentMemory(num_replicas)
        self.calibration = Calibration(cost.prior_rates(), num_replicas, is_batching=is_batching)
        self.backlog = Backlog(num_replicas, is_batching)  # the proxy begins a job where it sends, ends it at the end
        self.last_placement: Placement | None = None  # the last request ranked (read before the proxy awaits)
        self.num_fallbacks = 0
        self.on_fallback = lambda: None  # a metric's inc
        self.fallback_reason: str | None = None  # the last reason, while falling back

    def order(
        self,
        prompt_ids,
        cache_salt: str | None,
        in_flight: list[int],
        is_available: list[bool],
        rotation: int,
        now: float,
    ) -> list[int]:
        """Preference order; round robin from ``rotation`` while the events cannot be trusted (each such request
        counted, each outage logged once). Either way the first choice is remembered as holding the prompt."""
        reason = self.feed.why_not_live(now)
        if reason != self.fallback_reason:
            if reason is None:
                log.info("pool_aware: KV events live again; placing by expected TTFT")
            else:
                log.warning("pool_aware: falling back to round robin: %s (%s)", reason, self.feed.describe(now))
            self.fallback_reason = reason
        # a KnownPrefix: placed on its known ids, its length estimated (kvshare.router.prompt_ids)
        is_known = isinstance(prompt_ids, KnownPrefix)
        ids = prompt_ids.ids if is_known else [] if prompt_ids is None else prompt_ids
        num_tokens = prompt_ids.num_tokens if is_known else len(ids)
        chunk_tokens = self.feed.index.chunk_tokens  # set once, from the first event: the pool's page size
        hashes = chain(ids, chunk_tokens, cache_salt)  # the one chain: the pool's lookup and the sent memory
        with self.feed.lock:
            pool_tokens = self.feed.index.held_tokens_of(hashes, cache_salt)
        if pool_tokens < num_tokens // chunk_tokens * chunk_tokens:
            self.feed.expect(now)  # the replica will store the rest: the pool should announce it
        rates = [self.calibration.rates(i) for i in range(len(in_flight))]
        depths = [self.sent.depths(i, hashes) for i in range(len(in_flight))]
        own = [None] * len(in_flight)  # each replica's GPU prefix by its own live events
        if reason is not None:
            self.num_fallbacks += 1
            self.on_fallback()
            times = [0.0] * len(in_flight)
            work = [r.service_s for r in rates]
            prefill = None
        else:
            own = [self._own_tokens(i, ids, cache_salt, hashes, chunk_tokens, now) for i in range(len(in_flight))]
            gpu = [self.sent.held_tokens(i, hashes, chunk_tokens) if o is None else o for i, o in enumerate(own)]
            prefill = [expected_prefill(self.cost, num_tokens, g, pool_tokens, r) for g, r in zip(gpu, rates)]
            times = [self.queue_s(i, q, r, now) + p for i, (q, r, p) in enumerate(zip(in_flight, rates, prefill))]
            work = [p + r.decode_s for p, r in zip(prefill, rates)]
        # what a vLLM usage's cached tokens are split by: not a salted prompt's (the events name none of its pages)
        # nor one placed on its known prefix: its length is an estimate (-1 matches no usage's prompt tokens)
        known = reason is None and cache_salt is None
        held = (pool_tokens, own) if known else (None, [None] * len(in_flight))
        self.last_placement = Placement(work, depths, chunk_tokens, -1 if is_known else len(ids), *held, prefill)
        order = rank(times, is_available, rotation, NEAR_TIE)
        if is_known:  # the whole chain once the tail is encoded (on the loop); the known one if that fails
            whole = prompt_ids.whole
            whole.add_done_callback(
                lambda f: self.sent.remember(order[0], _whole_chain(f, chunk_tokens, cache_salt, hashes))
            )
        else:
            self.sent.remember(order[0], hashes)
        return order

    def begin(self, i: int, placement: Placement, now: float, is_stream: bool) -> Job:
        """The backlog's job of ``placement`` on replica i, sent at ``now``: in T_r from then on."""
        return self.backlog.begin(i, *placement.job_s(i), now, is_blind=not is_stream)

    def queue_s(self, i: int, num_in_flight: int, rates: Rates, now: float) -> float:
        """Expected wait on replica i: the backlog of the jobs it knows, the mean service time for each other
        request in flight there (one the proxy counts but did not begin as a job)."""
        unknown = max(0, num_in_flight - self.backlog.num_jobs(i))
        return self.backlog.wait_s(i, now) + unknown * rates.service_s

    def _own_tokens(self, i: int, ids, cache_salt, hashes, chunk_tokens: int, now: float) -> int | None:
        """Replica i's GPU prefix by its own events while they are live; None: else (what this router sent it is
        taken instead)."""
        feed = self.replica_feeds[i] if i < len(self.replica_feeds) else None
        if feed is None or feed.why_not_live(now) is not None:
            return None
        with feed.lock:
            if feed.index.chunk_tokens == chunk_tokens:  # the request's chain is this index's: hashed once
                return feed.index.held_tokens_of(hashes, cache_salt)
            return feed.index.held_tokens(ids, cache_salt)

    def timing(
        self, replica: int, sent_s: float, upstream, placement: Placement | None = None, is_usage_asked: bool = False
    ) -> ResponseTiming:
        """The measurement of one relayed response (an aiohttp ClientResponse) for this placer's calibration and,
        with the request's ``placement``, for what its replica's local cache keeps (the sent memory's capacity)
        and how a vLLM usage's cached tokens split; ``is_usage_asked``: the router asked for its usage chunk."""

        def held(local_tokens: int) -> None:
            self.sent.report(replica, placement.depths[replica], local_tokens // placement.chunk_tokens)

        is_stream = upstream.content_type == "text/event-stream"
        if placement is None:
            return ResponseTiming(self.calibration, replica, sent_s, is_stream, is_usage_asked=is_usage_asked)
        split = lambda prompt_tokens, cached_tokens: split_cached(placement, replica, prompt_tokens, cached_tokens)
        return ResponseTiming(self.calibration, replica, sent_s, is_stream, held, split, is_usage_asked)

    def start(self) -> None:
        self.warm_up()
        for feed in (self.feed, *self.replica_feeds):
            feed.start()

    def warm_up(self) -> None:
        """Pay the one-time costs of a placement (the chat template's compile, the tokenizer's first calls) before
        the router serves: on a fresh router they made its first request's placement 100-130 ms on 2 CPU cores."""
        if self.tokenizer is not None:
            if hasattr(self.tokenizer, "warm_up"):  # the engine's Tokenizer: its chat template compiled
                self.tokenizer.warm_up()
            ids = self.prompt_ids("warm up", None)
            chain([] if ids is None else ids, 1, None)

    def stop(self) -> None:
        for feed in (self.feed, *self.replica_feeds):
            feed.stop()

    def prompt_ids(self, prompt, messages):
        """The token ids a replica would compute for the request (kvshare.router.prompt_ids)."""
        return prompt_ids(self.tokenizer, prompt, messages)

    async def encoded(self, facts):
        """``facts`` with a text prompt's ids, or its KnownPrefix (kvshare.router.prompt_ids.encoded)."""
        return await encoded(self.tokenizer, facts)

    def prompt_of(self, prompt, messages):
        """``prompt_ids``, but a text as a PromptText where the tokenizer looks pieces up."""
        return prompt_of(self.tokenizer, prompt, messages)
