"""TTFT experiment: cold, local reuse and cross-replica reuse of the same prompt, per context length.

For each context length, ``repetitions`` fresh prompts (unique heads), in this order::

    replica A:  cold(P1) local(P1)  cold(P2) local(P2) ...     cold: nothing cached anywhere
    replica B:  cross(P1) cross(P2) ...                        B never saw P: its prefix comes from the pool

The cold request's output is the reference: local and cross outputs must equal it
(token ids at temperature 0). With ``SequentialReplicas`` A is stopped before B starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kvshare.bench.client import BenchRequest
from kvshare.bench.records import Record
from kvshare.bench.runner import BenchContext, Unit, mark_matches

EXPERIMENT = "ttft"
CONDITIONS = ("cold", "local", "cross")


@dataclass(frozen=True)
class TTFTConfig:
    contexts: tuple[int, ...]
    repetitions: int = 3
    max_tokens: int = 16
    replica_a: int = 0
    replica_b: int = 1

    def __post_init__(self) -> None:
        if not self.contexts or min(self.contexts) < 2:
            raise ValueError("give context lengths of at least 2 tokens")
        if self.repetitions < 1 or self.max_tokens < 1:
            raise ValueError("repetitions and max_tokens must be at least 1")
        if self.replica_a == self.replica_b:
            raise ValueError("cross-replica reuse needs two different replicas")


def units(config: TTFTConfig, num_replicas: int) -> list[Unit]:
    if max(config.replica_a, config.replica_b) >= num_replicas:
        raise ValueError(f"ttft measures cross-replica reuse on replicas {config.replica_a} and {config.replica_b}; "
                         f"give at least {max(config.replica_a, config.replica_b) + 1} replicas (got {num_replicas})")
    return [Unit(f"{EXPERIMENT}/L={n}", f"{EXPERIMENT}/L={n}", 3 * config.repetitions, partial(run_context, config, n))
            for n in config.contexts]


async def run_context(config: TTFTConfig, num_tokens: int, ctx: BenchContext) -> list[Record]:
    prompts = [ctx.factory.completion_prompt(num_tokens, f"{EXPERIMENT}/{num_tokens}/{r}") for r in range(config.repetitions)]
    unit = f"{EXPERIMENT}/L={num_tokens}"
    records: list[Record] = []

    async def one(prompt: list[int], replica: int, condition: str, position: int) -> Record:
        url, use_pool = ctx.replica_for(replica, use_pool=True)
        request = BenchRequest(url, "completion", ctx.model, prompt=prompt, max_tokens=config.max_tokens, use_pool=use_pool)
        record = await ctx.measure(request, experiment=EXPERIMENT, unit=unit, condition=condition,
                                   role="measure", context_tokens=num_tokens, position=position)
        records.append(record)
        return record

    cold = []
    for r, prompt in enumerate(prompts):
        cold.append(await one(prompt, config.replica_a, "cold", r))
        mark_matches([await one(prompt, config.replica_a, "local", r)], cold[r])
    for r, prompt in enumerate(prompts):
        mark_matches([await one(prompt, config.replica_b, "cross", r)], cold[r])
    return records
