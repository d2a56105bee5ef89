"""Level 4, service: responses with the pool ON equal responses with it OFF, on live replicas.

For each prompt of a set (completions of several lengths, some whole multiples of
the chunk size and some not, and chat conversations), at temperature 0::

    off    replica A, {"use_pool": false, "use_local_cache": false}   the reference: all recomputed
    prime  replica A, pool and cache on                              computes, stores its chunks
    pool   replica B, {"use_local_cache": false}                     must load them from the pool
    local  replica A, {"use_pool": false}                            reuses A's local prefix cache

Each of prime, pool and local must match off by the rule of ``kvshare.outputs``
(identical; on bf16, divergence only at a step whose top-2 gap is below the
threshold, reported with its step and gap; replicas in the deterministic mode, whose
responses say ``"deterministic": true``, by the exact rule: ids and logprobs equal,
any difference a failure with its step and both tokens and logprobs), and the pool run must
show that it really loaded from the pool (``kvshare.pool_tokens`` > 0 where the prompt has a
reusable full chunk). In the deterministic mode reuse is rounded down to the replicas' grid
(``--grid-tokens`` G, a multiple of the chunk), so what is reusable there is counted on the grid::

    prompt  |-- chunk --|-- chunk --|-- chunk --|-- chunk --|-- chunk --|-.|   n tokens
    chunk   |=========================================================|      (n - 1) // chunk chunks
    grid G  |=======================================|                        rounded down to G

and every reuse must end on a grid boundary: a prompt shorter than G + 1 loads nothing, and is
no failure. G comes from ``ServiceConfig.grid_tokens``, else from the replica's
``/admin/namespace`` where it says, else it is the chunk. Every prompt starts with a fresh nonce, so nothing from an
earlier run or another prompt can be reused. Replica A is prompt i's replica
i mod N and B the next one; with a single replica, B is A (the pool run still
reads only the pool).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvshare.outputs import DEFAULT_GAP_THRESHOLD, compare_tokens
from kvshare.validate.report import FAIL, PASS, SKIP, LevelResult, Row, verdict_of
from kvshare.validate.service_http import (
    LOCAL_ONLY,
    POOL_OFF,
    POOL_ONLY,
    Completion,
    ServiceError,
    get_json,
    model_of,
    request,
    tokenize,
)

WORDS = (
    "pool replica chunk page cache prefix token layer stream event commit lease arena extent kernel "
    "copy store load verify router session turn model weight tensor head block table host device "
    "memory latency reuse sharing state right wrong order delay byte check"
).split()


@dataclass(frozen=True)
class ServiceConfig:
    replicas: tuple[str, ...]
    max_tokens: int = 16
    completion_lengths: tuple[int, ...] = (256, 300, 512, 777, 1024, 1300)
    num_chat: int = 2
    chunk_tokens: int = 256  # the replicas' chunk size: full chunks are what the pool can hold
    gap_threshold: float = DEFAULT_GAP_THRESHOLD
    timeout_s: float = 600.0
    seed: int | None = None  # None: a fresh nonce per run
    grid_tokens: int | None = None  # the replicas' deterministic grid; None: /admin/namespace says, else the chunk

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the service level needs at least one replica URL")
        if self.max_tokens < 1 or self.chunk_tokens < 1 or self.gap_threshold < 0:
            raise ValueError("max_tokens and chunk_tokens must be positive, the gap threshold >= 0")
        if self.grid_tokens is not None and (self.grid_tokens < 1 or self.grid_tokens % self.chunk_tokens):
            raise ValueError(
                f"the grid ({self.grid_tokens} tokens) must be a positive multiple of the chunk "
                f"({self.chunk_tokens} tokens)"
            )


def reusable_tokens(prompt_tokens: int, chunk_tokens: int, grid_tokens: int | None = None) -> int:
    """Prompt tokens a reusing run can load: whole chunks before the last token (always computed), rounded
    down to the grid in the deterministic mode."""
    reusable = max(prompt_tokens - 1, 0) // chunk_tokens * chunk_tokens
    return reusable // grid_tokens * grid_tokens if grid_tokens else reusable


@dataclass
class PromptCase:
    name: str
    prompt: list  # token ids, or chat messages
    replica_a: str
    replica_b: str


AfterPrime = Callable[[PromptCase, Completion], None]  # a test's hook between prime and the pool run


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def build_cases(config: ServiceConfig, model: str, max_model_len: int | None) -> list[PromptCase]:
    rng = random.Random(config.seed)
    nonce = f"{rng.getrandbits(64):016x}" if config.seed is not None else os.urandom(8).hex()
    first = config.replicas[0]
    probe = tokenize(first, model, _words(rng, 64), config.timeout_s)
    tokens_per_word = max(len(probe) / 64, 0.5)
    limit = (max_model_len or 1 << 30) - config.max_tokens - 1
    cases, n = [], len(config.replicas)
    for i, length in enumerate(config.completion_lengths):
        if length > limit:
            continue
        text = f"validate {nonce} prompt {i}: " + _words(rng, int(length / tokens_per_word * 1.2) + 16)
        ids = tokenize(first, model, text, config.timeout_s)
        if len(ids) < length:
            raise ServiceError(f"a text of {len(text)} characters gave only {len(ids)} tokens, {length} wanted")
        cases.append(
            PromptCase(f"completion {length} tok", ids[:length], config.replicas[i % n], config.replicas[(i + 1) % n])
        )
    for j in range(config.num_chat):
        k = len(cases)
        words = int(config.chunk_tokens * (1.5 + j) / tokens_per_word)
        messages = [{"role": "user", "content": f"validate {nonce} chat {j}: " + _words(rng, words)}]
        if j % 2:  # a later turn of a conversation
            messages = [
                {"role": "system", "content": "You answer briefly."},
                *messages,
                {"role": "assistant", "content": _words(rng, 24)},
                {"role": "user", "content": "And then? " + _words(rng, 12)},
            ]
        cases.append(
            PromptCase(
                f"chat {j} ({len(messages)} messages)", messages, config.replicas[k % n], config.replicas[(k + 1) % n]
            )
        )
    return cases


def run_service_level(config: ServiceConfig, after_prime: AfterPrime | None = None) -> LevelResult:
    started = time.perf_counter()
    rows: list[Row] = []
    records: list[dict] = []
    try:
        model, max_model_len = model_of(config.replicas[0])
        cases = build_cases(config, model, max_model_len)
    except (ServiceError, KeyError, IndexError) as exc:
        return LevelResult(
            "service", FAIL, error=f"cannot build the prompt set: {exc}", seconds=time.perf_counter() - started
        )
    grid = config.grid_tokens or _grid_of(config.replicas[0], config.timeout_s) or config.chunk_tokens
    expected_pool = loaded_pool = 0
    reuse_rows: list[Row] = []
    for case in cases:
        try:
            runs = _run_case(config, model, case, after_prime)
        except (ServiceError, KeyError, IndexError, ValueError) as exc:
            rows.append(Row(case.name, FAIL, f"request failed: {exc}"))
            continue
        off = runs["off"]
        n_prompt = off.prompt_tokens or len(case.prompt)
        is_exact = _is_deterministic(off)
        reusable = reusable_tokens(n_prompt, config.chunk_tokens, grid if is_exact else None)
        rows.append(_off_row(case, off))
        for run in ("prime", "pool", "local"):
            row, record = _reuse_row(config, case, run, off, runs[run], reusable, grid if is_exact else None)
            rows.append(row)
            reuse_rows.append(row)
            records.append(record)
        if reusable > 0:
            expected_pool += 1
            loaded_pool += int(runs["pool"].reused("pool") > 0)
    status = verdict_of(rows) if rows else SKIP
    if expected_pool == 0 and status == PASS:
        what = (
            f"no prompt reached a grid boundary ({grid} tokens): give --prompt-lengths above it"
            if any(r.figures.get("exact") for r in reuse_rows) and grid > config.chunk_tokens
            else "no prompt had a full chunk to reuse"
        )
        status, rows = FAIL, rows + [Row("pool reuse", FAIL, f"{what}: nothing was tested")]
    num_exact = sum(1 for r in reuse_rows if r.figures.get("exact"))
    summary = _summary(len(cases), len(config.replicas), reuse_rows, num_exact, loaded_pool, expected_pool)
    figures = {
        "model": model,
        "replicas": list(config.replicas),
        "gap_threshold": config.gap_threshold,
        "max_tokens": config.max_tokens,
        "grid_tokens": grid if num_exact else None,
        "requests": records,
    }
    return LevelResult("service", status, summary, rows, figures, time.perf_counter() - started)


def _summary(
    num_cases: int, num_replicas: int, reuse_rows: list[Row], num_exact: int, loaded_pool: int, expected_pool: int
) -> str:
    """How many reuse runs matched pool off (and under which rule), the pool loads seen, and where runs diverged."""
    identical = sum(1 for r in reuse_rows if "divergence_step" not in r.figures)
    diverged = [r for r in reuse_rows if "divergence_step" in r.figures]
    rule = f" (held to the exact rule, ids and logprobs: {num_exact})" if num_exact else ""
    summary = (
        f"{num_cases} prompts x 3 reuse runs on {num_replicas} replica(s): {identical}/{len(reuse_rows)} "
        f"identical to pool off{rule}; pool loads where expected {loaded_pool}/{expected_pool}"
    )
    if diverged:
        summary += "; divergences: " + ", ".join(
            f"{r.name} step {r.figures['divergence_step']} gap {_gap(r.figures.get('gap'))}" for r in diverged
        )
    return summary


def _run_case(
    config: ServiceConfig, model: str, case: PromptCase, after_prime: AfterPrime | None
) -> dict[str, Completion]:
    def call(replica: str, extension: dict | None) -> Completion:
        return request(replica, model, case.prompt, config.max_tokens, extension, config.timeout_s)

    runs = {"off": call(case.replica_a, POOL_OFF), "prime": call(case.replica_a, {})}
    if after_prime is not None:
        after_prime(case, runs["prime"])
    runs["pool"] = call(case.replica_b, POOL_ONLY)
    runs["local"] = call(case.replica_a, LOCAL_ONLY)
    return runs


def _off_row(case: PromptCase, off: Completion) -> Row:
    figures = {"replica": _name(off, case.replica_a), "prompt": off.prompt_tokens, "cached": off.cached_tokens}
    if off.provenance is None:
        return Row(f"{case.name} off", FAIL, "no kvshare provenance in the response: not a kvshare replica?", figures)
    if off.reused("pool") or off.reused("local") or off.cached_tokens:
        return Row(
            f"{case.name} off",
            FAIL,
            "the pool-off request reused KV: the replica ignores the kvshare extension",
            figures,
        )
    return Row(f"{case.name} off", PASS, "reference: every prompt token computed", figures)


def _reuse_row(
    config: ServiceConfig, case: PromptCase, run: str, off: Completion, got: Completion, reusable: int, grid: int | None
):
    is_exact = _is_deterministic(off) and _is_deterministic(got)
    cmp = compare_tokens(
        off.token_ids, got.token_ids, off.top_logprobs, config.gap_threshold, got.top_logprobs, is_exact
    )
    replica = case.replica_b if run == "pool" else case.replica_a
    figures = {
        "replica": _name(got, replica),
        "prompt": got.prompt_tokens,
        "reusable": reusable,
        "pool": got.reused("pool"),
        "local": got.reused("local"),
        "cached": got.cached_tokens,
    }
    if is_exact:
        figures["exact"] = True
    if not cmp.is_identical:
        figures.update(divergence_step=cmp.divergence_step, gap=cmp.gap)
        if is_exact:
            figures.update(
                reference_token=cmp.reference_token,
                token=cmp.candidate_token,
                reference_logprobs=cmp.reference_logprobs,
                logprobs=cmp.candidate_logprobs,
            )
    problems = []
    if len(got.token_ids) != len(off.token_ids):
        problems.append(f"{len(got.token_ids)} tokens generated, the reference {len(off.token_ids)}")
    if not cmp.passed:
        problems.append(cmp.describe())
    elif is_exact and not cmp.is_logprobs_compared:
        problems.append(
            f"the exact rule needs both runs' logprobs; given at {cmp.num_logprob_steps} of {cmp.num_compared} steps"
        )
    reused = got.reused("pool") + got.reused("local")
    if is_exact and grid and (reused % grid or reused > reusable):
        problems.append(f"reused {reused} tokens: not on the grid of {grid} tokens (at most {reusable} here)")
    if run == "pool" and reusable > 0 and got.reused("pool") == 0:
        problems.append(
            f"pool_tokens is 0 although {reusable} prompt tokens were primed on {case.replica_a}: "
            "the run did not load from the pool"
        )
    detail = "; ".join(problems) if problems else cmp.describe()
    record = {
        "case": case.name,
        "run": run,
        "url": replica,
        **figures,
        "divergence_step": cmp.divergence_step,
        "gap": cmp.gap,
        "token_ids": got.token_ids,
        "reference_ids": off.token_ids,
        "identical": cmp.is_identical,
        "passed": not problems,
    }
    return Row(f"{case.name} {run}", FAIL if problems else PASS, detail, figures), record


def _grid_of(replica: str, timeout_s: float) -> int | None:
    """The replica's deterministic grid, where its /admin/namespace says it (None: not said, or no answer)."""
    try:
        grid = get_json(replica.rstrip("/") + "/admin/namespace", timeout_s).get("grid_tokens")
    except ServiceError:
        return None
    return int(grid) if grid else None


def _is_deterministic(got: Completion) -> bool:
    """The replica served it in the deterministic mode (its kvshare object says so)."""
    return (got.provenance or {}).get("deterministic") is True


def _name(got: Completion, url: str) -> str:
    """The replica's own name (its provenance says it), else its URL."""
    return str((got.provenance or {}).get("replica") or url)


def _gap(gap) -> str:
    return "unknown" if gap is None else f"{gap:.3g}"
