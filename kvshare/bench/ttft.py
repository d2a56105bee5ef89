"""TTFT experiment: cold, local reuse and cross-replica reuse of the same prompt, per context length.

For each context length, ``repetitions`` fresh prompts (unique heads), in this order::

    replica A:  cold(P1) local(P1)  cold(P2) local(P2) ...     cold: nothing cached anywhere
    replica B:  cross(P1) cross(P2) ...                        B never saw P: its prefix comes from the pool

The cold request's output is the reference: local and cross outputs must equal it
(token ids at temperature 0). With ``SequentialReplicas`` A is stopped before B starts.

``client``: ``token_ids`` sends each prompt as token ids to /v1/completions (a load generator's view);
``text`` sends it as chat text to /v1/chat/completions through a user's client (kvshare.bench.client:
the openai SDK, the body encoded inside the clock), and pairs every text request with the same
prompt as token ids under the same condition, so each text row carries ``text_overhead`` (its TTFT
over the pair's, minus 1). The pair's second request repeats the first's condition through the
request extension: cold with the pool and the local cache off, cross with the local cache off (its
prefix then comes from the pool again); which client goes first alternates between prompts.
Without the extension text requests go unpaired.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kvshare.bench.client import BenchRequest
from kvshare.bench.records import Record
from kvshare.bench.runner import BenchContext, Unit, mark_matches

EXPERIMENT = "ttft"
CONDITIONS = ("cold", "local", "cross")
CLIENTS = ("token_ids", "text")


@dataclass(frozen=True)
class TTFTConfig:
    contexts: tuple[int, ...]
    repetitions: int = 3
    max_tokens: int = 16
    replica_a: int = 0
    replica_b: int = 1
    client: str = "token_ids"  # token_ids | text (module docstring)

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ValueError(f"--client {self.client}: choose one of {', '.join(CLIENTS)}")
        if not self.contexts or min(self.contexts) < 2:
            raise ValueError("give context lengths of at least 2 tokens")
        if self.repetitions < 1 or self.max_tokens < 1:
            raise ValueError("repetitions and max_tokens must be at least 1")
        if self.replica_a == self.replica_b:
            raise ValueError("cross-replica reuse needs two different replicas")


def units(config: TTFTConfig, num_replicas: int) -> list[Unit]:
    if max(config.replica_a, config.replica_b) >= num_replicas:
        raise ValueError(
            f"ttft measures cross-replica reuse on replicas {config.replica_a} and {config.replica_b}; "
            f"give at least {max(config.replica_a, config.replica_b) + 1} replicas (got {num_replicas})"
        )
    if config.client == "text":
        return [
            Unit(
                f"{EXPERIMENT}/text/L={n}",
                f"{EXPERIMENT}/text/L={n}",
                6 * config.repetitions,
                partial(run_text_context, config, n),
            )
            for n in config.contexts
        ]
    return [
        Unit(f"{EXPERIMENT}/L={n}", f"{EXPERIMENT}/L={n}", 3 * config.repetitions, partial(run_context, config, n))
        for n in config.contexts
    ]


async def run_context(config: TTFTConfig, num_tokens: int, ctx: BenchContext) -> list[Record]:
    prompts = [
        ctx.factory.completion_prompt(num_tokens, f"{EXPERIMENT}/{num_tokens}/{r}") for r in range(config.repetitions)
    ]
    unit = f"{EXPERIMENT}/L={num_tokens}"
    records: list[Record] = []

    async def one(prompt: list[int], replica: int, condition: str, position: int) -> Record:
        url, use_pool = ctx.replica_for(replica, use_pool=True)
        request = BenchRequest(
            url, "completion", ctx.model, prompt=prompt, max_tokens=config.max_tokens, use_pool=use_pool
        )
        record = await ctx.measure(
            request,
            experiment=EXPERIMENT,
            unit=unit,
            condition=condition,
            role="measure",
            context_tokens=num_tokens,
            position=position,
            client="token_ids",
        )
        records.append(record)
        return record

    cold = []
    for r, prompt in enumerate(prompts):
        cold.append(await one(prompt, config.replica_a, "cold", r))
        mark_matches([await one(prompt, config.replica_a, "local", r)], cold[r])
    for r, prompt in enumerate(prompts):
        mark_matches([await one(prompt, config.replica_b, "cross", r)], cold[r])
    return records


async def run_text_context(config: TTFTConfig, num_tokens: int, ctx: BenchContext) -> list[Record]:
    """The ttft order with chat text through a user's client, each request paired with its prompt as token ids."""
    tags = [f"{EXPERIMENT}/text/{num_tokens}/{r}" for r in range(config.repetitions)]
    chats = [ctx.factory.chat_messages(num_tokens, tag) for tag in tags]  # rendered: exactly num_tokens tokens
    prompt_ids = [ctx.factory.tokenizer.apply_chat_template(messages) for messages in chats]
    unit = f"{EXPERIMENT}/text/L={num_tokens}"
    records: list[Record] = []

    async def pair(r: int, replica: int, condition: str) -> dict[str, Record]:
        # without the extension the condition cannot be repeated: no pair
        order = ("text",) if not ctx.use_extension else CLIENTS[::-1] if r % 2 == 0 else CLIENTS
        out: dict[str, Record] = {}
        for client in order:
            request = _paired_request(ctx, config, client, chats[r], prompt_ids[r], replica, condition, bool(out))
            out[client] = await ctx.measure(
                request,
                experiment=EXPERIMENT,
                unit=unit,
                condition=condition,
                role="measure",
                context_tokens=num_tokens,
                position=r,
                client=client,
            )
            records.append(out[client])
        text, ids = out["text"], out.get("token_ids")
        if ids is not None and text.is_ok and ids.is_ok and ids.ttft_s > 0:
            text.text_overhead = text.ttft_s / ids.ttft_s - 1
        return out

    cold = []
    for r in range(config.repetitions):
        cold.append(await pair(r, config.replica_a, "cold"))
        reference = cold[r]["text"]
        mark_matches([*cold[r].values(), *(await pair(r, config.replica_a, "local")).values()], reference)
    for r in range(config.repetitions):
        mark_matches(list((await pair(r, config.replica_b, "cross")).values()), cold[r]["text"])
    return records


def _paired_request(
    ctx: BenchContext,
    config: TTFTConfig,
    client: str,
    messages: list[dict],
    prompt_ids: list[int],
    replica: int,
    condition: str,
    is_second: bool,
) -> BenchRequest:
    """One request of a text / token ids pair: the chat text through a user's client, or its ids to /v1/completions.

    The second of a pair keeps its condition by not reusing what the first left: cold turns every cache
    off, cross the replica's local cache."""
    url, use_pool = ctx.replica_for(replica, use_pool=True)
    use_local_cache = True
    if is_second and condition == "cold":
        use_pool, use_local_cache = False, False
    elif is_second and condition == "cross":
        use_local_cache = False
    if client == "text":
        return BenchRequest(
            url,
            "chat",
            ctx.model,
            messages=messages,
            max_tokens=config.max_tokens,
            use_pool=use_pool,
            use_local_cache=use_local_cache,
            is_user_client=True,
        )
    return BenchRequest(
        url,
        "completion",
        ctx.model,
        prompt=prompt_ids,
        max_tokens=config.max_tokens,
        use_pool=use_pool,
        use_local_cache=use_local_cache,
    )
