"""The ``pool_aware`` policy: the replica with the least expected time to first token, from what is really held.

For each replica it reckons T_r (kvshare.router.cost_model): the wait ahead of the request there, the load of
what only the pool holds, the prefill of what nobody holds. The load and prefill rates and a request's decode
time are measured per replica from the responses the router relays (kvshare.router.calibration); the flags give
their values until enough responses have been seen. The queue wait is the expected work ahead on r
(kvshare.router.backlog): each request this router has in flight there with the prefill and load it was expected
to need plus r's decode time, so a replica behind long prompts looks as busy as it is. Replicas whose T_r is
within ``NEAR_TIE`` of the least are taken in turn: a difference inside the measurements' noise does not send
every request to the same replica.

What the pool holds comes from its KV events (kvshare.pool.events: the pages it committed and has not evicted,
with their token ids; kvshare.router.kv_event_feed keeps them); what a replica holds on its GPU is its own KV
events where it publishes them, else what this router sent it (its own memory, as ``cache_aware`` keeps,
credited only as deep as the replica's cache was seen to keep: kvshare.router.sent_memory). Tenants never see
each other's prefixes: every chain of hashes is seeded by the request's cache_salt (kvshare.router.chunk_chain),
and the pool announces token ids only for pages no tenant salted, so a salted request finds nothing of the pool
here and is placed on queue and prefill alone.

When the events stop (a routed prompt's new chunks are not announced in time), lag, or cannot be decoded,
the policy falls back to round robin until they are live again, with a metric and a log line.

A chat's next turn is placed on the ids of the text earlier prompts held, its new tail encoded meanwhile
(kvshare.router.prompt_ids): the sent memory takes the tail's chunks when they are in.

The placer owns its inputs: the feeds, the sent memory, the calibration and the backlog. Each ranking is kept
as a ``Placement`` (kvshare.router.placement); each send of a request to a replica is a ``TrackedSend``: in the
backlog from the send until its end, its response measured. Pure but for the feeds' threads: ``order`` and the
inputs take ``now`` and need no socket.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvshare.pool import events as E
from kvshare.router.backlog import Backlog, BacklogEntry
from kvshare.router.calibration import Calibration, Rates
from kvshare.router.chunk_chain import chain
from kvshare.router.cost_model import NEAR_TIE, CostModel, expected_prefill, rank
from kvshare.router.kv_event_feed import KVEventFeed
from kvshare.router.placement import Placement, split_cached
from kvshare.router.prompt_ids import KnownPrefix, encoded, placer_tokenizer, prompt_ids, prompt_of
from kvshare.router.response_timing import ResponseTiming
from kvshare.router.sent_memory import SentMemory

log = logging.getLogger("kvshare.router.pool_aware")


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


@dataclass(frozen=True)
class _Prompt:
    """A request's prompt as the placer reckons with it: its ids (a KnownPrefix's known ones), its length (a
    KnownPrefix's estimated) and its chain at the pool's chunk size, seeded by its salt."""

    ids: object
    num_tokens: int
    hashes: list[bytes]
    chunk_tokens: int
    cache_salt: str | None
    is_known_prefix: bool


class PoolAwarePlacer:
    """Ranks replicas by T_r while the events are live, in turn (round robin) while they are not."""

    def __init__(
        self,
        num_replicas: int,
        cost: CostModel,
        feed: KVEventFeed,
        tokenizer=None,
        replica_feeds: list[KVEventFeed] | None = None,
        is_batching: bool = False,
        replica_names: list[str] | None = None,
    ) -> None:
        """``is_batching``: the replicas decode their running requests beside a new one's prefill (vLLM), so a
        replica's queue is the prefill ahead, not every request's decode (kvshare.router.backlog);
        ``replica_names``: their labels in logs and metrics (default: their indices)."""
        self.cost = cost
        self.feed = feed
        self.replica_feeds = replica_feeds or []  # each replica's GPU events, where it publishes them
        self.tokenizer = tokenizer
        self.sent = SentMemory(num_replicas)
        self.calibration = Calibration(cost.prior_rates(), num_replicas, names=replica_names, is_batching=is_batching)
        self.backlog = Backlog(num_replicas, is_batching)  # an entry per send (TrackedSend), ended at its end
        self.last_placement: Placement | None = None  # the last request ranked (read before the relay awaits)
        self.num_fallbacks = 0
        self.on_fallback = lambda: None  # a metric's inc
        self.fallback_reason: str | None = None  # the last reason, while falling back

    @classmethod
    def from_config(
        cls,
        config: PoolAwareConfig,
        num_replicas: int,
        replica_names: Sequence[str] | None = None,
        is_batching: bool = False,
    ) -> PoolAwarePlacer:
        """The placer of ``config``: its feeds (not started yet) and the replicas' tokenizer (loaded without the
        model's weights); ``replica_names``: the replicas' URLs, their labels."""
        feed = KVEventFeed(
            config.endpoint,
            config.topic,
            config.replay_endpoint,
            config.encoding,
            config.max_lag_s,
            config.max_silence_s,
        )
        if config.replica_endpoints and len(config.replica_endpoints) != num_replicas:
            raise ValueError(
                f"--replica-kv-events: one per replica ({num_replicas}), got {len(config.replica_endpoints)}"
            )
        replica_feeds = [
            KVEventFeed(
                e, "", None, config.encoding, config.max_lag_s, config.max_silence_s, media=(E.MEDIUM_GPU, None)
            )
            for e in config.replica_endpoints
        ]
        names = None if replica_names is None else [name.rstrip("/") for name in replica_names]
        tokenizer = placer_tokenizer(config.model)
        return cls(num_replicas, config.cost, feed, tokenizer, replica_feeds, is_batching, names)

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
        reason = self._why_not_live(now)
        prompt = self._prompt(prompt_ids, cache_salt)
        pool_tokens = self.feed.held_tokens_of(prompt.hashes, cache_salt)
        if pool_tokens < prompt.num_tokens // prompt.chunk_tokens * prompt.chunk_tokens:
            self.feed.expect(now)  # the replica will store the rest: the pool should announce it
        n = len(in_flight)
        rates = [self.calibration.rates(i) for i in range(n)]
        depths = [self.sent.depths(i, prompt.hashes) for i in range(n)]
        if reason is not None:
            self.num_fallbacks += 1
            self.on_fallback()
            times, work, prefill, own = [0.0] * n, [r.service_s for r in rates], None, [None] * n
        else:
            times, work, prefill, own = self._expected(prompt, pool_tokens, in_flight, rates, now)
        # what a vLLM usage's cached tokens are split by: not a salted prompt's (the events name none of its pages)
        # nor one placed on its known prefix: its length is an estimate (-1 matches no usage's prompt tokens)
        known = reason is None and cache_salt is None
        held = (pool_tokens, own) if known else (None, [None] * n)
        num_tokens = -1 if prompt.is_known_prefix else len(prompt.ids)
        self.last_placement = Placement(work, depths, prompt.chunk_tokens, num_tokens, *held, prefill)
        order = rank(times, is_available, rotation, NEAR_TIE)
        self._remember(order[0], prompt, prompt_ids)
        return order

    def _why_not_live(self, now: float) -> str | None:
        """The pool's events' reason not to be trusted (None: live), each change logged once."""
        reason = self.feed.why_not_live(now)
        if reason != self.fallback_reason:
            if reason is None:
                log.info("pool_aware: KV events live again; placing by expected TTFT")
            else:
                log.warning("pool_aware: falling back to round robin: %s (%s)", reason, self.feed.describe(now))
            self.fallback_reason = reason
        return reason

    def _prompt(self, prompt_ids, cache_salt: str | None) -> _Prompt:
        """The prompt of ``prompt_ids`` (ids, None, or a KnownPrefix: placed on its known ids, its length
        estimated: kvshare.router.prompt_ids) hashed once: the one chain of the pool's lookup and the sent memory."""
        is_known = isinstance(prompt_ids, KnownPrefix)
        ids = prompt_ids.ids if is_known else [] if prompt_ids is None else prompt_ids
        num_tokens = prompt_ids.num_tokens if is_known else len(ids)
        chunk_tokens = self.feed.chunk_tokens  # set once, from the first event: the pool's page size
        return _Prompt(ids, num_tokens, chain(ids, chunk_tokens, cache_salt), chunk_tokens, cache_salt, is_known)

    def _expected(self, prompt: _Prompt, pool_tokens: int, in_flight: list[int], rates: list[Rates], now: float):
        """Per replica: (T_r, the request's expected work there, its expected prefill, its GPU prefix by the
        replica's own live events: None where they are not)."""
        own = [self._own_tokens(i, prompt, now) for i in range(len(in_flight))]
        gpu = [
            self.sent.held_tokens(i, prompt.hashes, prompt.chunk_tokens) if o is None else o for i, o in enumerate(own)
        ]
        prefill = [expected_prefill(self.cost, prompt.num_tokens, g, pool_tokens, r) for g, r in zip(gpu, rates)]
        times = [self.queue_s(i, q, r, now) + p for i, (q, r, p) in enumerate(zip(in_flight, rates, prefill))]
        work = [p + r.decode_s for p, r in zip(prefill, rates)]
        return times, work, prefill, own

    def _remember(self, first: int, prompt: _Prompt, prompt_ids) -> None:
        """The sent memory takes the prompt as sent to ``first``: a KnownPrefix's whole chain once its tail is
        encoded (on the loop), its known one if that fails."""
        if not prompt.is_known_prefix:
            self.sent.remember(first, prompt.hashes)
            return
        chunk_tokens, cache_salt, hashes = prompt.chunk_tokens, prompt.cache_salt, prompt.hashes
        prompt_ids.whole.add_done_callback(
            lambda f: self.sent.remember(first, _whole_chain(f, chunk_tokens, cache_salt, hashes))
        )

    def send_to(
        self, replica: int, placement: Placement | None, now: float, is_stream: bool, is_usage_asked: bool = False
    ) -> TrackedSend:
        """The request ranked by ``placement`` sent to ``replica`` at ``now``: in T_r from then on."""
        return TrackedSend(self, replica, placement, now, is_stream, is_usage_asked)

    def queue_s(self, i: int, num_in_flight: int, rates: Rates, now: float) -> float:
        """Expected wait on replica i: the backlog of the requests it knows, the mean service time for each other
        request in flight there (one the relay counts but that was not sent as a TrackedSend)."""
        unknown = max(0, num_in_flight - self.backlog.num_entries(i))
        return self.backlog.wait_s(i, now) + unknown * rates.service_s

    def _own_tokens(self, i: int, prompt: _Prompt, now: float) -> int | None:
        """Replica i's GPU prefix by its own events while they are live; None: else (what this router sent it is
        taken instead)."""
        feed = self.replica_feeds[i] if i < len(self.replica_feeds) else None
        if feed is None or feed.why_not_live(now) is not None:
            return None
        return feed.held_tokens(prompt.ids, prompt.hashes, prompt.chunk_tokens, prompt.cache_salt)

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


class TrackedSend:
    """One request sent to one replica, as pool_aware tracks it: in the backlog from its send until ``end`` (once
    its response ended, failed or was given up), its response measured (``timing``)."""

    def __init__(
        self,
        placer: PoolAwarePlacer,
        replica: int,
        placement: Placement | None,
        sent_s: float,
        is_stream: bool,
        is_usage_asked: bool,
    ) -> None:
        self.placer, self.replica, self.placement, self.sent_s = placer, replica, placement, sent_s
        self.is_usage_asked = is_usage_asked
        self.entry: BacklogEntry | None = None
        if placement is not None:
            work_s, first_token_s = placement.entry_s(replica)
            self.entry = placer.backlog.begin(replica, work_s, first_token_s, sent_s, is_blind=not is_stream)

    def timing(self, upstream) -> ResponseTiming:
        """The measurement of its response (an aiohttp ClientResponse), which also tells the backlog when its
        first byte came and asks it whether its prefill overlapped another's."""
        timing = self.placer.timing(self.replica, self.sent_s, upstream, self.placement, self.is_usage_asked)
        entry, backlog = self.entry, self.placer.backlog
        if entry is not None:
            timing.on_first_byte = lambda: backlog.started(entry)
            timing.is_prefill_shared = lambda: entry.is_shared
        return timing

    def end(self) -> None:
        if self.entry is not None:
            self.placer.backlog.finish(self.entry)


def _whole_chain(whole, chunk_tokens: int, cache_salt: str | None, known: list[bytes]) -> list[bytes]:
    """The chain of a KnownPrefix's whole ids once ``whole`` (their future) is done; ``known`` where it failed."""
    if whole.cancelled() or whole.exception() is not None:
        return known
    return chain(whole.result(), chunk_tokens, cache_salt)
