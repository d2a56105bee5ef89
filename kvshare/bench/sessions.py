"""Multi-turn sessions: alternate vs sticky placement, pool on vs off; session time and per-turn TTFT.

A session starts with a chat prompt of exactly ``context`` tokens (unique head); each
next turn appends the previous answer and a new user message of ``turn_tokens`` filler
tokens, so the history grows turn by turn and every turn's prompt extends the last
one's. Turns are placed either

- directly, by the router's own policy code (``kvshare.router.policy.Router``): alternate
  sends turn k to replica k mod N, sticky keeps a session on its first replica; or
- through a router given for that placement (``routers={"alternate": URL}``), with the
  session named by the X-Session-ID header, as a client of a real deployment would.

With placement alternate and the pool OFF, turn k finds on its replica only turn k-2's
prefix (its own local cache); with the pool ON it also loads turn k-1's prompt from
the pool. With sticky placement the local cache already holds everything but the last
answer, so the pool can add little (the study's "fixed placement gained little").
Each (context, placement, pool) session has its own content: no condition warms another.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

from kvshare.bench.client import BenchRequest
from kvshare.bench.records import Record
from kvshare.bench.runner import BenchContext, Unit, mark_matches

EXPERIMENT = "sessions"
PLACEMENTS = ("alternate", "sticky")


@dataclass(frozen=True)
class SessionsConfig:
    contexts: tuple[int, ...]
    num_sessions: int = 2
    num_turns: int = 6
    turn_tokens: int = 256  # new user tokens per turn after the first
    answer_tokens: int = 32  # generated tokens per turn
    placements: tuple[str, ...] = PLACEMENTS
    pools: tuple[str, ...] = ("off", "on")
    verify: int = 1  # ON sessions per (context, placement) whose last turn is re-sent with pool and local cache off
    routers: tuple[tuple[str, str], ...] = ()  # (placement, router URL): send that placement's turns through it

    def __post_init__(self) -> None:
        if not self.contexts or min(self.contexts) < 16:
            raise ValueError("give initial contexts of at least 16 tokens")
        if self.num_sessions < 1 or self.num_turns < 1 or self.turn_tokens < 1 or self.answer_tokens < 1:
            raise ValueError("sessions, turns, turn tokens and answer tokens must be at least 1")
        if set(self.placements) - set(PLACEMENTS):
            raise ValueError(f"placements are {', '.join(PLACEMENTS)}; got {self.placements}")
        if set(self.pools) - {"off", "on"} or not self.pools:
            raise ValueError(f"pools are 'off' and/or 'on'; got {self.pools}")


def units(config: SessionsConfig, num_replicas: int) -> list[Unit]:
    if "alternate" in config.placements and num_replicas < 2 and "alternate" not in dict(config.routers):
        raise ValueError(f"alternate placement needs at least 2 replicas (got {num_replicas})")
    placers = {p: Placer(p, num_replicas, dict(config.routers).get(p)) for p in config.placements}
    out = []
    for n in config.contexts:
        for s in range(config.num_sessions):
            for placement in config.placements:
                for pool in config.pools:
                    key = f"{EXPERIMENT}/L={n}/{placement}/{pool}/s={s}"
                    is_verified = pool == "on" and s < config.verify
                    out.append(
                        Unit(
                            key,
                            f"{EXPERIMENT}/L={n}/{placement}/{pool}",
                            config.num_turns + is_verified,
                            partial(run_session, config, placers[placement], n, pool, s, is_verified),
                        )
                    )
    return out


@dataclass
class Placer:
    """Chooses each turn's endpoint: a router URL, or a replica picked by the router's own policy."""

    placement: str
    num_replicas: int
    router_url: str | None = None
    _policy: object = field(default=None, repr=False)

    def replica(self, session_id: str, turn: int) -> int | None:
        """Replica index for this turn (None: the router decides)."""
        if self.router_url is not None:
            return None
        from kvshare.router.policy import ReplicaView, RouteFacts, Router

        if self._policy is None:
            self._policy = Router(self.placement, self.num_replicas)
        views = [ReplicaView(i, True, 0) for i in range(self.num_replicas)]
        return self._policy.choose(RouteFacts(session_id=session_id, chat_turn=turn), views, time.monotonic())[0]


async def run_session(
    config: SessionsConfig, placer: Placer, num_tokens: int, pool: str, index: int, is_verified: bool, ctx: BenchContext
) -> list[Record]:
    placement = placer.placement
    unit = f"{EXPERIMENT}/L={num_tokens}/{placement}/{pool}/s={index}"
    session_id = f"{ctx.factory.config.nonce}:{unit}"
    use_pool = pool == "on"
    messages = ctx.factory.chat_messages(num_tokens, unit)
    records: list[Record] = []
    fields = dict(
        experiment=EXPERIMENT,
        unit=unit,
        condition=f"{placement}/{pool}",
        context_tokens=num_tokens,
        session=index,
        placement=placement,
    )
    answer, url = "", ""
    for turn in range(config.num_turns):
        if turn:
            messages = messages + [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": ctx.factory.user_text(config.turn_tokens, f"{unit}/{turn}")},
            ]
        replica = placer.replica(session_id, turn)
        if replica is None:
            url, send_pool = placer.router_url, use_pool if ctx.use_extension else None
        else:
            url, send_pool = ctx.replica_for(replica, use_pool)
        request = BenchRequest(
            url,
            "chat",
            ctx.model,
            messages=messages,
            max_tokens=config.answer_tokens,
            use_pool=send_pool,
            session_id=session_id,
        )
        record, response = await ctx.exchange(request, role="measure", turn=turn, **fields)
        records.append(record)
        answer = response.text
    if is_verified:
        # the last turn again where it went (same URL and session: a router places it the same way),
        # recomputed from scratch: its output must equal the measured one
        request = BenchRequest(
            url,
            "chat",
            ctx.model,
            messages=messages,
            max_tokens=config.answer_tokens,
            use_pool=False if ctx.use_extension else None,
            use_local_cache=False,
            session_id=session_id,
        )
        verify = await ctx.measure(request, role="verify", turn=config.num_turns - 1, **fields)
        records.append(verify)
        mark_matches([records[-2]], verify)
    return records
