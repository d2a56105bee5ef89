"""Choosing the next token from a row of logits, with vLLM's semantics for every parameter.

One step, in vLLM's order::

    raw logits  -> logprobs reported to the client (before any processing, vLLM's default "raw_logprobs")
    logit_bias  add the request's bias per token id
    penalties   repetition (prompt and output tokens), then frequency and presence (output tokens only)
    greedy      argmax of the processed logits (top_k, top_p and min_p cannot change an argmax)
    or sample   / temperature -> min_p -> top_k -> top_p -> draw with the request's seeded generator

Greedy steps without a bias or penalties (the common case, and every benchmark's) run where the
logits are: the argmax and the logprobs on the GPU, one small read back (moving the [V] row to the
host and working on it there cost ~2 ms a token on the H200, measured between the forward's end and
the first token). Everything else runs on the CPU with a CPU ``torch.Generator``, so a seed gives
the same tokens on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # temperatures this small are greedy (as in vLLM): logits / t would overflow
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it
_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens; neutral defaults change nothing."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off; else keep the k most likely tokens
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one's probability
    presence_penalty: float = 0.0  # subtracted once from every token generated so far (OpenAI)
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens (OpenAI)
    repetition_penalty: float = 1.0  # logits of prompt and generated tokens: /p when positive, *p otherwise (vLLM)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()  # generating one of these ends the request with finish_reason "stop"
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token (None: none)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (off) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must lie in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if any(not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS for _, bias in self.logit_bias):
            raise ValueError(f"logit_bias values must lie in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must lie in 0..{MAX_LOGPROBS}, got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None  # log-probability of token_id under the model (before any processing)
    top_logprobs: dict[int, float] | None  # the k most likely tokens -> logprob


class TokenCounts:
    """What the penalties look at: which tokens the prompt holds, how often each was generated."""

    def __init__(self, vocab_size: int, prompt_ids: torch.Tensor) -> None:
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
        self.in_prompt[prompt_ids.cpu()] = True
        self.generated = torch.zeros(vocab_size, dtype=torch.float32)  # [V] occurrences in the output

    def add(self, token_id: int) -> None:
        self.generated[token_id] += 1


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()  # non-deterministic
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, counts: TokenCounts | None = None
) -> SampledToken:
    """logits: [V]. Greedy takes the first maximal id on ties; ``counts`` is needed when ``params`` penalise."""
    if params.is_greedy and not params.logit_bias and not params.has_penalties:
        return _greedy_where_logits_are(logits, params.logprobs)
    raw = logits.detach().float().cpu()
    processed = process_logits(raw, params, counts)
    if params.is_greedy:
        token_id = int(torch.argmax(processed))
    else:
        # shifted by its maximum before the temperature divides it, so that no row overflows: a tiny
        # repetition_penalty divides positive logits up to inf, and inf - inf would be NaN
        finite = torch.nan_to_num(processed, posinf=_FLOAT32_MAX, neginf=-_FLOAT32_MAX)
        probs = torch.softmax((finite - finite.max()) / params.temperature, dim=-1)
        if params.min_p > 0:
            probs = _min_p_filter(probs, params.min_p)
        if params.top_k:
            probs = _top_k_filter(probs, params.top_k)
        if params.top_p < 1.0:
            probs = _top_p_filter(probs, params.top_p)
        token_id = int(torch.multinomial(probs, 1, generator=generator))
    return _with_logprobs(raw, token_id, params.logprobs)


def process_logits(logits: torch.Tensor, params: SamplingParams, counts: TokenCounts | None) -> torch.Tensor:
    """The logits after logit_bias and the penalties (a new tensor; ``logits`` [V] float32 is not changed)."""
    if not params.logit_bias and not params.has_penalties:
        return logits
    out = logits.clone()
    if params.logit_bias:
        ids = torch.tensor([i for i, _ in params.logit_bias], dtype=torch.long)
        out.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=out.dtype))
    if params.has_penalties:
        if counts is None:
            raise ValueError("penalties need the request's TokenCounts")
        if params.repetition_penalty != 1:
            seen = counts.in_prompt | (counts.generated > 0)
            penalised = torch.where(out > 0, out / params.repetition_penalty, out * params.repetition_penalty)
            out = torch.where(seen, penalised, out)
        out -= params.frequency_penalty * counts.generated
        out -= params.presence_penalty * (counts.generated > 0).to(out.dtype)
    return out


def _greedy_where_logits_are(logits: torch.Tensor, num_logprobs: int | None) -> SampledToken:
    """The argmax (first maximal id on ties) and its logprobs on the logits' device, read back at once.

    The same operations as the CPU path on a CPU row; ids travel as float64 (exact below 2**53)."""
    raw = logits.detach().float()
    token = torch.argmax(raw)
    if num_logprobs is None:
        return SampledToken(int(token), None, None)
    logprobs = torch.log_softmax(raw, dim=-1)
    values, ids = torch.topk(logprobs, min(num_logprobs, logprobs.shape[0]))
    packed = torch.cat(
        [token.view(1).double(), logprobs[token].view(1).double(), values.double(), ids.double()]
    ).tolist()
    k = len(values)
    top = {int(i): v for i, v in zip(packed[2 + k :], packed[2 : 2 + k])} if num_logprobs > 0 else None
    return SampledToken(int(packed[0]), packed[1], top)


def _with_logprobs(raw: torch.Tensor, token_id: int, num_logprobs: int | None) -> SampledToken:
    if num_logprobs is None:
        return SampledToken(token_id, None, None)
    logprobs = torch.log_softmax(raw, dim=-1)
    top: dict[int, float] | None = None
    if num_logprobs > 0:
        values, ids = torch.topk(logprobs, min(num_logprobs, logprobs.shape[0]))
        top = {int(i): float(v) for i, v in zip(ids, values)}
    return SampledToken(token_id, float(logprobs[token_id]), top)


def _renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum()


def _min_p_filter(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    """Keep the tokens at least min_p times as likely as the most likely one (it always stays)."""
    return _renormalised(probs, probs >= min_p * probs.max())


def _top_k_filter(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the k most likely tokens (ties at the k-th are broken by torch.topk, as in vLLM)."""
    if top_k >= probs.shape[0]:
        return probs
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[torch.topk(probs, top_k).indices] = True
    return _renormalised(probs, keep)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly more likely tokens
    drop = mass_before >= top_p
    drop[0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32 too)
    sorted_probs[drop] = 0.0
    filtered = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return filtered / filtered.sum()
