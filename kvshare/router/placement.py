"""What the placer expected of one request on each replica, and what that lets a response's counts say (pure).

pool_aware ranks a request (kvshare.router.pool_aware) and keeps its ``Placement``: the work it expected on each
replica (the backlog's entry of the request where it is sent: kvshare.router.backlog), what this router had sent
each replica of its prefix (kvshare.router.sent_memory) and what the pool and each replica's own events held of
it. A vLLM replica reports only how many prompt tokens it did not compute; ``split_cached`` tells its own GPU
prefix from the pool's pages by that record.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """What the placer expected of one request on each replica: the backlog's entry of the request where it is sent,
    and what its response's counts say."""

    work_s: list[float]  # its expected service time on each replica (kvshare.router.backlog)
    depths: list[list[int]]  # per replica: the depths of the chunks of its prefix this router had sent there
    chunk_tokens: int
    num_tokens: int = 0  # the prompt's tokens as this router counted them
    pool_tokens: int | None = None  # its prefix the pool held by its KV events; None: not known (not live, salted)
    own_tokens: list[int | None] | None = None  # per replica: its GPU prefix by its own live KV events; None: not known
    first_token_s: list[float] | None = None  # per replica: the part of work_s before its first token (None: all)

    def entry_s(self, replica: int) -> tuple[float, float | None]:
        """(work_s, first_token_s) on ``replica``: what the backlog's entry of this request expects."""
        return self.work_s[replica], None if self.first_token_s is None else self.first_token_s[replica]


def split_cached(placement: Placement, replica: int, prompt_tokens: int, cached_tokens: int) -> tuple[int, int] | None:
    """(computed, pool) tokens of a response that tells only how many prompt tokens its replica did not compute
    (vLLM's ``cached_tokens``: its GPU prefix cache's hits and the connector's pool loads together), told apart
    by what this router knew when it placed the request; None where they cannot be (the sample is not fitted)::

        cached = own + loaded    own: the replica's GPU prefix cache; loaded: the pool's pages after it
        own < sent + 1 chunk     sent: the whole chunks of this prompt this router had sent that replica

    Nothing cached: all computed. Where the replica's own KV events told its GPU prefix: up to it, its own; the
    rest up to what the pool held, loaded (more than both: an event not yet seen, not fitted). Else, by what this
    router sent: more cached than the pool held, within what the replica can hold, is its own; never sent a whole
    chunk of it, from a chunk up to what the pool held cached is the pool's (a sub-chunk head the replica held
    itself, a chat template's, counts as loaded: less than one chunk over). That assumes the replicas serve this
    router's requests only (``kvshare up``): a replica another client fed holds more."""
    if prompt_tokens != placement.num_tokens or not 0 <= cached_tokens <= prompt_tokens:
        return None  # the router's token ids are not the prompt the replica counted: its record does not apply
    computed, sent = prompt_tokens - cached_tokens, len(placement.depths[replica]) * placement.chunk_tokens
    if cached_tokens == 0:
        return computed, 0
    pool = placement.pool_tokens
    own = None if placement.own_tokens is None else placement.own_tokens[replica]
    if own is not None and pool is not None:
        if cached_tokens <= own:
            return computed, 0
        return (computed, cached_tokens - own) if cached_tokens <= pool else None
    if pool is not None and pool < cached_tokens < sent + placement.chunk_tokens:
        return computed, 0
    if sent == 0 and pool is not None and placement.chunk_tokens <= cached_tokens <= pool:
        return computed, cached_tokens
    return None
