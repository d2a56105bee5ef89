"""What each replica still has to do: the requests this router has in flight on it, each with its expected
service time (pure).

pool_aware's queue term is the wait a new request can expect on a replica before its own prefill starts. A
count of requests in flight times a mean service time cannot tell a replica behind two long prompts from one
behind two short ones. The backlog keeps, for every request the router sent, what was expected of it when it
was placed on that replica (by the measured rates): its time to first token (its own prefill and load) and its
whole service time (that plus the replica's measured decode time).

A replica that serves one request at a time in order (the built-in engine)::

    wait(r) = sum of the expected service of r's requests in flight

A request is in it from the moment the router sends it until its response has ended, failed or was given up:
requests just placed count at once. The one being served counts whole, not less the time it has had: its
decode length is not known ahead, and crediting its progress sent new requests behind requests that then ran
long (in a replay of the routing workload's arrivals against one-request-at-a-time replicas with the
measured service times, that raised p99 TTFT; kept whole, the replicas already idle win those requests).

A replica that batches (vLLM: continuous batching, chunked prefill) decodes its running requests beside a new
one's prefill, so a request's decode does not hold back the next one's first token; what does is the prefill
still ahead of it::

    wait(r) = sum of the expected time to first token of r's requests in flight that have not sent a byte

Counting decodes there made the wait of a replica with ten requests decoding ~50 s (answers of 100-300 tokens),
so pool_aware balanced request counts like round robin and moved sessions away from the replica holding their
prefix (routing workload, vLLM replicas on one H100, 2026-12-06).

A request whose prefill overlapped another's on the same replica (either was sent while the other had not sent
its first byte) is marked ``is_shared``: on a batching replica its time to first token is its own prefill and
part of the others', so it tells nothing of the replica's rates (kvshare.router.calibration fits only the requests
that ran alone).

A response that is not a stream shows nothing before its end (vLLM writes its headers with its body), so its
first byte marks no prefill's end. Such an entry (``is_blind``) counts as prefill ahead until it is due: the wait
ahead of it when it was sent plus its own expected time to first token; then as decoding (counted until its
end, it would hold its replica's wait at its prefill for the whole of its decode).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(eq=False)
class BacklogEntry:
    """One request in flight on ``replica``; ``work_s``: its expected service time when it was placed;
    ``first_token_s``: the part of it before its first token (its prefill and load)."""

    replica: int
    work_s: float
    first_token_s: float = 0.0
    is_started: bool = False  # its first byte came back
    is_done: bool = False
    is_shared: bool = False  # its prefill overlapped another request's on the same replica
    due_s: float = math.inf  # a blind entry's (no first byte before its end): when its prefill is expected done

    def is_in_prefill(self, now: float) -> bool:
        """Its prefill is still ahead or running, as far as the router can tell at ``now``."""
        return not self.is_started and now < self.due_s


class Backlog:
    """Every replica's requests in flight, an entry each, oldest first; ``is_batching``: the replicas batch (see
    the module)."""

    def __init__(self, num_replicas: int, is_batching: bool = False) -> None:
        self.is_batching = is_batching
        self._entries: list[list[BacklogEntry]] = [[] for _ in range(num_replicas)]

    def begin(
        self,
        replica: int,
        work_s: float,
        first_token_s: float | None = None,
        now: float = -math.inf,
        is_blind: bool = False,
    ) -> BacklogEntry:
        """A request sent to ``replica`` at ``now``, expected to hold it ``work_s`` seconds, ``first_token_s`` of
        them before its first token (None: all of them); ``is_blind``: its response shows no first byte before its
        end (not a stream), so it is due at ``now`` + the wait ahead of it + ``first_token_s``."""
        work_s = max(0.0, work_s)
        before = work_s if first_token_s is None else min(work_s, max(0.0, first_token_s))
        entry = BacklogEntry(replica, work_s, before)
        if is_blind:
            entry.due_s = now + self.wait_s(replica, now) + before
        for other in self._entries[replica]:
            if other.is_in_prefill(now):
                other.is_shared = entry.is_shared = True
        self._entries[replica].append(entry)
        return entry

    def started(self, entry: BacklogEntry) -> None:
        """Its request's first byte came back: its prefill is done."""
        entry.is_started = True

    def finish(self, entry: BacklogEntry) -> None:
        """Its request's response ended (or failed, or was given up); a second call does nothing."""
        if not entry.is_done:
            entry.is_done = True
            self._entries[entry.replica].remove(entry)

    def num_entries(self, replica: int) -> int:
        return len(self._entries[replica])

    def wait_s(self, replica: int, now: float = -math.inf) -> float:
        """Expected seconds until ``replica`` starts a new request's prefill (``now``: on the clock of ``begin``'s)."""
        if self.is_batching:
            return sum(entry.first_token_s for entry in self._entries[replica] if entry.is_in_prefill(now))
        return sum(entry.work_s for entry in self._entries[replica])
