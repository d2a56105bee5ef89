"""Choosing the next token from a row of logits: greedy, or temperature + top-p with a seeded generator.

Sampling runs on the CPU (a [V] row per step is cheap to move) with a CPU
``torch.Generator``, so a seed gives the same tokens on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # temperatures this small are greedy (as in vLLM): logits / t would overflow


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None  # log-probability of token_id under the model (before temperature/top-p)
    top_logprobs: dict[int, float] | None  # the k most likely tokens -> logprob


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()  # non-deterministic
    else:
        generator.manual_seed(seed)
    return generator


def sample(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    generator: torch.Generator,
    num_logprobs: int | None = None,
) -> SampledToken:
    """logits: [V] float32. temperature 0 (or below GREEDY_BELOW) is greedy (the first maximal id on ties)."""
    logits = logits.detach().float().cpu()
    if temperature < GREEDY_BELOW:
        token_id = int(torch.argmax(logits))
    else:
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1.0:
            probs = _top_p_filter(probs, top_p)
        token_id = int(torch.multinomial(probs, 1, generator=generator))
    if num_logprobs is None:
        return SampledToken(token_id, None, None)
    logprobs = torch.log_softmax(logits, dim=-1)
    top: dict[int, float] | None = None
    if num_logprobs > 0:
        values, ids = torch.topk(logprobs, min(num_logprobs, logprobs.shape[0]))
        top = {int(i): float(v) for i, v in zip(ids, values)}
    return SampledToken(token_id, float(logprobs[token_id]), top)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly more likely tokens
    drop = mass_before >= top_p
    drop[0] = False  # the most likely token always stays (a top_p that rounds to 0 in float32 too)
    sorted_probs[drop] = 0.0
    filtered = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return filtered / filtered.sum()
