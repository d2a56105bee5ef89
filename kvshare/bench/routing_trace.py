"""The routing workload's plan: sessions over shared system prompts, Poisson arrivals, the conditions (pure).

One trace (from the seed) is replayed under every condition and rate::

    session s:  arrives at start_s / rate   [system prompt p(s)] [user 0] -> answer 0 [user 1] -> answer 1 ...
                turn k+1 is sent when turn k's answer has streamed in (a closed loop per session)

Sessions arrive as a Poisson process (exponential gaps at 1 session/s, divided by the rate); each is given
one of ``num_prompts`` system prompts (as evenly as the count allows, in a shuffled order), so sessions of
one prompt share its chunks across replicas: what the pool can carry from one replica to another.

A condition is a placement policy with the pool on or off, or a control:

- ``no_shared_prefix``: pool_aware, but every request's prompt starts with its own head (nothing is shared:
  no chunk can be loaded from the pool, so no policy can gain);
- ``events_dropped``: pool_aware whose router never receives a KV event: it must place round robin
  (every request counted as a fallback), never on a stale or empty index.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

ROUTER_POLICIES = ("round_robin", "alternate", "sticky", "cache_aware", "pool_aware", "pool_aware_gpu")
CONTROLS = ("no_shared_prefix", "events_dropped")
HINTED = "+hints"  # a router's name: the policy's router, sending the vLLM replicas prefetch hints
DEFAULT_CONDITIONS = (
    "round_robin/off",
    "round_robin/on",
    "alternate/on",
    "sticky/on",
    "cache_aware/on",
    "pool_aware/on",
    "pool_aware_gpu/on",
)


@dataclass(frozen=True)
class Condition:
    """How one replay of the trace is placed and served."""

    name: str  # "<policy>/<on|off|hints>", or a control's name
    # which router places it: a policy, "<policy>+hints" (the policy, sending the vLLM replicas prefetch hints), or
    # "pool_aware_dropped" (a pool_aware router without events)
    router: str
    use_pool: bool
    is_shared: bool = True  # False: every request has its own head (no prefix is shared)


def parse_condition(name: str) -> Condition:
    """'pool_aware/on' -> Condition; 'cache_aware/hints': the pool on, and the router tells each vLLM replica the
    prompt it places there (kvshare.router.hints); controls by name. A clear error for anything else."""
    if name == "no_shared_prefix":
        return Condition(name, "pool_aware", True, is_shared=False)
    if name == "events_dropped":
        return Condition(name, "pool_aware_dropped", True)
    policy, sep, pool = name.partition("/")
    if not sep or policy not in ROUTER_POLICIES or pool not in ("on", "off", "hints"):
        raise ValueError(
            f"unknown condition {name!r}: give POLICY/on, POLICY/off or POLICY/hints with a policy of "
            f"{', '.join(ROUTER_POLICIES)}, or a control: {', '.join(CONTROLS)}"
        )
    if pool == "hints":
        return Condition(name, f"{policy}{HINTED}", True)
    return Condition(name, policy, pool == "on")


def _token_range(name: str, value: tuple[int, int]) -> None:
    if len(value) != 2 or value[0] < 1 or value[1] < value[0]:
        raise ValueError(f"{name}: give a range LOW-HIGH of positive token counts, got {value}")


@dataclass(frozen=True)
class RoutingConfig:
    num_sessions: int = 64
    num_prompts: int = 8  # shared system prompts
    num_turns: int = 6
    system_tokens: tuple[int, int] = (4000, 6000)  # each system prompt's length is drawn from this range
    user_tokens: tuple[int, int] = (200, 1200)  # each user turn's length
    answer_tokens: tuple[int, int] = (100, 300)  # each reply's length (generated tokens)
    rates: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)  # session arrivals per second, swept
    conditions: tuple[str, ...] = DEFAULT_CONDITIONS + CONTROLS
    num_runs: int = 3  # the whole sweep this many times, each on a fresh cluster
    gpu_share: float = 2.5  # the working set over one replica's local (GPU) KV cache
    pool_share: float = 2.0  # the pool's size over the working set
    num_verify: int = 2  # per replay: last turns re-sent with every cache off; their outputs must be equal
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.num_sessions, self.num_prompts, self.num_turns, self.num_runs) < 1:
            raise ValueError("sessions, prompts, turns and runs must be at least 1")
        for name in ("system_tokens", "user_tokens", "answer_tokens"):
            _token_range(name, getattr(self, name))
        if not self.rates or min(self.rates) <= 0:
            raise ValueError("give arrival rates (sessions per second) above 0")
        if not self.conditions:
            raise ValueError("give at least one condition")
        for name in self.conditions:
            parse_condition(name)
        if self.gpu_share < 1 or self.pool_share < 1:
            raise ValueError(
                "the working set must exceed one replica's cache (--gpu-share >= 1) and fit the pool "
                "(--pool-share >= 1)"
            )
        if self.num_verify < 0:
            raise ValueError("--verify must be >= 0")


def scaled(low_high: tuple[int, int], scale: float) -> tuple[int, int]:
    """A token range times ``scale`` (at least 1 token each)."""
    return max(1, round(low_high[0] * scale)), max(1, round(low_high[1] * scale))


@dataclass(frozen=True)
class SessionPlan:
    index: int
    prompt: int  # which shared system prompt
    start_s: float  # arrival at 1 session/s; at rate r it arrives at start_s / r
    user_tokens: tuple[int, ...]  # per turn
    answer_tokens: tuple[int, ...]  # per turn


@dataclass(frozen=True)
class Trace:
    system_tokens: tuple[int, ...]  # per shared system prompt
    sessions: tuple[SessionPlan, ...]

    @property
    def num_requests(self) -> int:
        return sum(len(s.user_tokens) for s in self.sessions)

    def longest_request_tokens(self) -> int:
        """The most tokens one request of the trace holds: its last turn's prompt and its answer."""
        return max(self.system_tokens[s.prompt] + sum(s.user_tokens) + sum(s.answer_tokens) for s in self.sessions)

    def working_set_tokens(self) -> int:
        """Distinct prompt tokens the trace makes a cache hold: the system prompts once, every session's turns."""
        return sum(self.system_tokens) + sum(sum(s.user_tokens) + sum(s.answer_tokens) for s in self.sessions)


def make_trace(config: RoutingConfig) -> Trace:
    """The sessions, their prompts, lengths and arrivals: a function of the config alone."""
    rng = random.Random(config.seed)
    system = tuple(rng.randint(*config.system_tokens) for _ in range(config.num_prompts))
    prompts = [s % config.num_prompts for s in range(config.num_sessions)]
    rng.shuffle(prompts)
    sessions, start = [], 0.0
    for s in range(config.num_sessions):
        if s:
            start += rng.expovariate(1.0)
        users = tuple(rng.randint(*config.user_tokens) for _ in range(config.num_turns))
        answers = tuple(rng.randint(*config.answer_tokens) for _ in range(config.num_turns))
        sessions.append(SessionPlan(s, prompts[s], start, users, answers))
    return Trace(system, tuple(sessions))
