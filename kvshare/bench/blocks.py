"""The study's blocked design: cross-replica TTFT in blocks OFF-ON-ON-OFF, paired by position.

Each block holds ``per_block`` fresh prompts of one context length. In an ON block each
prompt is first sent to replica A (the *prime*: a cold prefill that stores its chunks in
the pool), then measured on replica B with the pool on. In an OFF block the prompt is
measured on B with the pool off (by the request extension, or on a second cluster that
has no pool), so B recomputes it::

    block      OFF#0          ON#0                     ON#1                     OFF#1
    A          -              prime 0..k-1             prime 0..k-1             -
    B          measure 0..k-1 measure 0..k-1 (pool)    measure 0..k-1 (pool)    measure 0..k-1

Primes are batched per block so that with SequentialReplicas a block needs one switch
A -> B. Where the pool cannot hold a block's primes at once (two 128k prompts of the 32B shape
are 63 GiB; four are more than the H200 machine's 128 GiB of memory), ``prime_batch`` primes
and measures that many at a time (each batch one switch A -> B with SequentialReplicas)::

    prime_batch 2   A prime 0,1 | B measure 0,1 | A prime 2,3 | B measure 2,3

The prime's output (a full recompute) is the reference each measurement must equal; the
first ``verify`` measured ON requests of a context are also re-sent to B with the pool and
the local cache off (a recompute on the measuring replica) and compared.
Statistics: kvshare.stats (k-th OFF block paired with k-th ON block).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kvshare.bench.client import BenchRequest
from kvshare.bench.records import Record
from kvshare.bench.runner import BenchContext, Unit, mark_matches

EXPERIMENT = "blocks"
DESIGN = ("off", "on", "on", "off")


@dataclass(frozen=True)
class BlocksConfig:
    contexts: tuple[int, ...]
    per_block: int = 8
    design: tuple[str, ...] = DESIGN
    max_tokens: int = 16
    prime_off: bool = False  # also prime OFF prompts on A (costs a cold prefill each; changes nothing on B)
    verify: int = 1  # measured ON requests per context re-sent with pool and local cache off
    prime_batch: int | None = None  # primes sent before their measurements (None: the whole block)
    replica_a: int = 0
    replica_b: int = 1

    def __post_init__(self) -> None:
        if not self.contexts or min(self.contexts) < 2:
            raise ValueError("give context lengths of at least 2 tokens")
        if self.per_block < 1:
            raise ValueError("per_block must be at least 1")
        if set(self.design) - {"off", "on"} or "on" not in self.design or "off" not in self.design:
            raise ValueError(f"the design is a sequence of 'off' and 'on' blocks with both, got {self.design}")
        if self.prime_batch is not None and self.prime_batch < 1:
            raise ValueError("prime_batch must be at least 1 (or None: the whole block)")
        if self.replica_a == self.replica_b:
            raise ValueError("cross-replica measurements need two different replicas")


def units(config: BlocksConfig, num_replicas: int) -> list[Unit]:
    if max(config.replica_a, config.replica_b) >= num_replicas:
        raise ValueError(
            f"blocks primes on replica {config.replica_a} and measures on {config.replica_b}; "
            f"give at least {max(config.replica_a, config.replica_b) + 1} replicas (got {num_replicas})"
        )
    out = []
    for n in config.contexts:
        first_on = config.design.index("on")
        for b, condition in enumerate(config.design):
            num_verify = min(config.verify, config.per_block) if b == first_on else 0
            num_requests = config.per_block * (1 + (condition == "on" or config.prime_off)) + num_verify
            out.append(
                Unit(
                    f"{EXPERIMENT}/L={n}/b={b}",
                    f"{EXPERIMENT}/L={n}/{condition}",
                    num_requests,
                    partial(run_block, config, n, b, condition, num_verify),
                )
            )
    return out


async def run_block(
    config: BlocksConfig, num_tokens: int, block: int, condition: str, num_verify: int, ctx: BenchContext
) -> list[Record]:
    is_on = condition == "on"
    unit = f"{EXPERIMENT}/L={num_tokens}/b={block}"
    prompts = [ctx.factory.completion_prompt(num_tokens, f"{unit}/{i}") for i in range(config.per_block)]
    records: list[Record] = []

    async def one(i: int, replica: int, role: str, use_pool: bool, use_local_cache: bool = True) -> Record:
        url, send_pool = ctx.replica_for(replica, use_pool)
        request = BenchRequest(
            url,
            "completion",
            ctx.model,
            prompt=prompts[i],
            max_tokens=config.max_tokens,
            use_pool=send_pool,
            use_local_cache=use_local_cache,
        )
        record = await ctx.measure(
            request,
            experiment=EXPERIMENT,
            unit=unit,
            condition=condition,
            role=role,
            context_tokens=num_tokens,
            block=block,
            position=i,
        )
        records.append(record)
        return record

    primes, measured = [], []
    batch = config.prime_batch or config.per_block
    for start in range(0, config.per_block, batch):
        batch_ids = range(start, min(start + batch, config.per_block))
        if is_on or config.prime_off:
            primes += [await one(i, config.replica_a, "prime", is_on) for i in batch_ids]
        measured += [await one(i, config.replica_b, "measure", is_on) for i in batch_ids]
    verified = [await one(i, config.replica_b, "verify", False, use_local_cache=False) for i in range(num_verify)]
    for i, record in enumerate(measured):
        reference = verified[i] if i < len(verified) else (primes[i] if primes else None)
        mark_matches([record] + ([primes[i]] if primes and reference is not primes[i] else []), reference)
    return records
