"""Placement policies: pure functions of the request's routing facts and the replicas' states.

- ``round_robin``: in turn, ignoring sessions.
- ``alternate``: turn k of a session goes to replica k mod N (the study's alternating
  placement). For chat requests k is the number of assistant messages in the request;
  otherwise the router counts the session's requests.
- ``sticky``: a session stays on the replica it started on (fixed placement).
- ``cache_aware``: the replica that most likely holds the prompt's prefix in its local
  cache (the longest run of prompt blocks it was sent before), unless it is much busier
  than the least loaded one.
- ``pool_aware``: the least expected time to first token from what the pool really holds (its KV
  events) and what each replica was sent (kvshare.router.pool_aware); round robin while the events
  are not live.

Each policy returns replica indices in order of preference; the relay tries them in
that order, so a replica that is down is skipped.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvshare.router.pool_aware import PoolAwarePlacer

POLICIES = ("round_robin", "alternate", "sticky", "cache_aware", "pool_aware")
PREFIX_BLOCK_CHARS = 512  # cache_aware compares prompts in blocks of this many characters


@dataclass(frozen=True)
class RouteFacts:
    """What the router reads from a request to place it."""

    session_id: str | None = None
    chat_turn: int | None = None  # assistant messages in a chat request
    prefix_blocks: tuple[bytes, ...] = ()  # chained hashes of the prompt's text blocks
    # pool_aware: the prompt's token ids (a list or an int array), None: unknown; a PromptText until encoded, then
    # a KnownPrefix where only its tail is still encoding (kvshare.router.prompt_ids)
    prompt_ids: object = None
    cache_salt: str | None = None  # pool_aware: the request's cache_salt
    is_stream: bool = True  # pool_aware: False where the body asks no stream (no first byte before the end)


@dataclass(frozen=True)
class ReplicaView:
    index: int
    is_available: bool  # healthy and not draining
    num_in_flight: int


class SessionTable:
    """Bounded LRU of per-session values with a TTL; ``now`` is passed in (pure)."""

    def __init__(self, max_sessions: int = 100_000, ttl_s: float = 3600.0) -> None:
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._items: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def get(self, session_id: str, now: float) -> int | None:
        item = self._items.get(session_id)
        if item is None or now - item[0] > self.ttl_s:
            self._items.pop(session_id, None)
            return None
        return item[1]

    def put(self, session_id: str, value: int, now: float) -> None:
        self._items[session_id] = (now, value)
        self._items.move_to_end(session_id)
        while len(self._items) > self.max_sessions:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


def prefix_blocks(
    text: str, block_chars: int = PREFIX_BLOCK_CHARS, max_blocks: int = 512, salt: str = ""
) -> tuple[bytes, ...]:
    """Chained hashes of the full ``block_chars`` blocks of ``text`` (like the pool's chunk keys).

    ``salt`` is the request's namespace salt (kvshare.serve.tenancy.namespace_salt: its tenant identity, split
    by its cache_salt), the one that salts the replicas' keys; it seeds the chain, so requests of two salts
    never match: where one tenant's prefix went never steers (nor, through a replica header, shows) another's.
    """
    blocks, previous = [], b""
    if salt:
        seed = salt.encode("utf-8", "surrogatepass")  # any JSON string, lone surrogates too
        previous = hashlib.blake2b(b"namespace_salt\0" + seed, digest_size=8).digest()
    for start in range(0, min(len(text), block_chars * max_blocks) - block_chars + 1, block_chars):
        previous = hashlib.blake2b(previous + text[start : start + block_chars].encode(), digest_size=8).digest()
        blocks.append(previous)
    return tuple(blocks)


def _rotate(order: list[int], first: int) -> list[int]:
    return order[first:] + order[:first]


def _available_first(preferred: list[int], replicas: list[ReplicaView]) -> list[int]:
    up = [i for i in preferred if replicas[i].is_available]
    return up + [i for i in preferred if not replicas[i].is_available]


@dataclass
class Router:
    """Policy state (a counter, session tables, per-replica prefix memory)."""

    policy: str
    num_replicas: int
    sessions: SessionTable = field(default_factory=SessionTable)
    max_imbalance: int = 4  # cache_aware: in-flight requests above the least loaded it accepts for a hit
    prefix_memory_blocks: int = 200_000
    _next: int = 0
    _prefixes: list[OrderedDict] = field(default_factory=list)
    pool_aware: PoolAwarePlacer | None = None  # the pool_aware policy's placer, given at construction

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.num_replicas <= 0:
            raise ValueError("a router needs at least one replica")
        self._prefixes = [OrderedDict() for _ in range(self.num_replicas)]

    def choose(self, facts: RouteFacts, replicas: list[ReplicaView], now: float) -> list[int]:
        """Replica indices in order of preference for this request (mutates the policy's state)."""
        n = self.num_replicas
        everyone = list(range(n))
        if self.policy == "alternate" and facts.session_id is not None:
            turn = facts.chat_turn
            if turn is None:
                turn = self.sessions.get(facts.session_id, now) or 0
                self.sessions.put(facts.session_id, turn + 1, now)
            order = _rotate(everyone, turn % n)
        elif self.policy == "sticky" and facts.session_id is not None:
            home = self.sessions.get(facts.session_id, now)
            if home is None:
                home = min(
                    everyone,
                    key=lambda i: (not replicas[i].is_available, replicas[i].num_in_flight, (i - self._next) % n),
                )
                self._next = (self._next + 1) % n
            self.sessions.put(facts.session_id, home, now)
            order = _rotate(everyone, home)
        elif self.policy == "cache_aware":
            order = self._cache_aware(facts, replicas)
        elif self.policy == "pool_aware" and self.pool_aware is not None:
            order = self.pool_aware.order(
                facts.prompt_ids,
                facts.cache_salt,
                [r.num_in_flight for r in replicas],
                [r.is_available for r in replicas],
                self._next,
                now,
            )
            self._next = (self._next + 1) % n
        else:
            order = _rotate(everyone, self._next)
            self._next = (self._next + 1) % n
        order = _available_first(order, replicas)
        if self.policy == "cache_aware":
            self._remember(order[0], facts.prefix_blocks)
        return order

    def _cache_aware(self, facts: RouteFacts, replicas: list[ReplicaView]) -> list[int]:
        matched = [self._matched_blocks(i, facts.prefix_blocks) for i in range(self.num_replicas)]
        least = min((r.num_in_flight for r in replicas if r.is_available), default=0)

        def score(i: int) -> tuple:
            too_busy = replicas[i].num_in_flight - least > self.max_imbalance
            return (too_busy, -matched[i], replicas[i].num_in_flight, (i - self._next) % self.num_replicas)

        order = sorted(range(self.num_replicas), key=score)
        self._next = (self._next + 1) % self.num_replicas
        return order

    def _matched_blocks(self, i: int, blocks: tuple[bytes, ...]) -> int:
        memory = self._prefixes[i]
        count = 0
        for block in blocks:
            if block not in memory:
                break
            count += 1
        return count

    def _remember(self, i: int, blocks: tuple[bytes, ...]) -> None:
        memory = self._prefixes[i]
        for block in blocks:
            memory[block] = None
            memory.move_to_end(block)
        while len(memory) > self.prefix_memory_blocks:
            memory.popitem(last=False)
