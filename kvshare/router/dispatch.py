"""Where placement meets the relay: a placed request's replicas in order, and each send of it to one of them.

``place`` asks the policy for its order (kvshare.router.policy, pure) and, under pool_aware, takes the placer's
record of what it expected of the request on each replica (kvshare.router.placement.Placement) before anything
awaits. The relay (kvshare.router.relay) tries the replicas in that order and calls ``Dispatch.send_to`` just
before it sends the request to one: the one place where a placed request meets the replica it goes to, with what
its placement knew (pool_aware's backlog counts it from there). The relay measures the response with
``Send.timing`` and calls ``Send.end`` once it has ended, failed or was given up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvshare.router.policy import ReplicaView, RouteFacts, Router

if TYPE_CHECKING:
    from kvshare.router.placement import Placement
    from kvshare.router.pool_aware import PoolAwarePlacer
    from kvshare.router.response_timing import ResponseTiming


class Send(Protocol):
    """One send of a request to one replica, as the placement's inputs see it."""

    def timing(self, upstream) -> ResponseTiming | None:
        """The measurement of its response (an aiohttp ClientResponse); None: nothing measures it."""

    def end(self) -> None:
        """Its response ended, failed or was given up."""


class UntrackedSend:
    """A send nothing keeps account of (every policy but pool_aware)."""

    def timing(self, upstream) -> None:
        return None

    def end(self) -> None:
        pass


@dataclass(frozen=True)
class Dispatch:
    """A placed request: the replicas to try, in order; ``is_stream``: it asks a stream (a response that is not one
    shows no first byte before its end); ``is_usage_asked``: the router asked a vLLM stream for its usage chunk;
    ``announce``: tells a replica the request is coming (kvshare.router.prefetch_hints), None: nothing to tell."""

    order: list[int]
    is_stream: bool = True
    is_usage_asked: bool = False
    placer: PoolAwarePlacer | None = None
    placement: Placement | None = None
    announce: Callable[[int], None] | None = None

    def send_to(self, replica: int, now: float) -> Send:
        """The request is sent to ``replica`` at ``now`` (each replica the relay tries, in order)."""
        if self.announce is not None:  # its prefetch hint goes first: the replica's copy starts while it reads it
            self.announce(replica)
        if self.placer is None:
            return UntrackedSend()
        return self.placer.send_to(replica, self.placement, now, self.is_stream, self.is_usage_asked)


def place(
    policy: Router,
    facts: RouteFacts,
    replicas: list[ReplicaView],
    now: float,
    is_draining: list[bool],
    is_usage_asked: bool = False,
) -> Dispatch:
    """The policy's order for a request (draining replicas left out) with, under pool_aware, its placement (taken
    before anything awaits: the placer keeps only its last)."""
    order = [i for i in policy.choose(facts, replicas, now) if not is_draining[i]]
    placer = policy.pool_aware
    placement = placer.last_placement if placer is not None else None
    return Dispatch(order, facts.is_stream, is_usage_asked, placer, placement)
