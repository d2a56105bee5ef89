"""Which of a prompt's chunks the vLLM connector's scheduler side looks up, loads and stores: pure arithmetic.

No vLLM, no torch, no sockets: everything here is a function of its inputs, so the rules are unit-tested
without a server.

A prompt, its chunks (C tokens each) and what the connector loads::

    prompt    |---- chunk 0 ----|---- chunk 1 ----|---- chunk 2 ----|- tail -|
    local     |=========== vLLM's own prefix cache ====|                         num_computed (block aligned,
    lookup                      |-- keys[first_chunk:num_full_chunks] ---------|  not chunk aligned)
    pool hit                    |== leased pages ==================|
    load                                           |= load ========|             start = num_computed,
                                                                                  end = min(hit end, prompt - 1)

The load starts where vLLM's local hit ends (possibly inside a chunk: only the rest of
that chunk is copied) and never covers the last prompt token, which vLLM must compute
to produce the first output token. It also ends on a block boundary: vLLM 0.32 expects
external hits in whole blocks (its ExampleConnector says so), and an external hit that
ended inside a block gave wrong logits on the CPU backend (seen here with 511 of 512).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LookupWindow:
    """Chunks worth asking the pool for: indices ``first_chunk .. end_chunk - 1``."""

    first_chunk: int
    end_chunk: int

    @property
    def num_chunks(self) -> int:
        return max(self.end_chunk - self.first_chunk, 0)


def load_limit(num_prompt_tokens: int, block_size: int) -> int:
    """The end of the longest load vLLM accepts: whole blocks, at least one prompt token left over."""
    return max((num_prompt_tokens - 1) // block_size * block_size, 0)


def lookup_window(
    num_prompt_tokens: int, num_computed_tokens: int, chunk_tokens: int, block_size: int = 1
) -> LookupWindow:
    """The full chunks of the prompt that could extend vLLM's local hit of ``num_computed_tokens``."""
    if chunk_tokens <= 0 or block_size <= 0:
        raise ValueError(f"chunk_tokens and block_size must be positive, got {chunk_tokens} and {block_size}")
    if num_computed_tokens < 0:
        raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
    end_chunk = max(num_prompt_tokens, 0) // chunk_tokens
    if num_computed_tokens >= load_limit(num_prompt_tokens, block_size):  # nothing left that may be loaded
        return LookupWindow(end_chunk, end_chunk)
    return LookupWindow(min(num_computed_tokens // chunk_tokens, end_chunk), end_chunk)


def tokens_to_load(
    num_prompt_tokens: int,
    num_computed_tokens: int,
    chunk_tokens: int,
    first_chunk: int,
    num_hit_chunks: int,
    block_size: int = 1,
) -> int:
    """Tokens the pool supplies beyond ``num_computed_tokens``: whole blocks, at least one prompt token left."""
    if num_hit_chunks <= 0:
        return 0
    if first_chunk * chunk_tokens > num_computed_tokens:
        raise ValueError(
            f"the pool hit starts at token {first_chunk * chunk_tokens}, after the local hit ends "
            f"({num_computed_tokens}): the gap would be neither computed nor loaded"
        )
    hit_end = (first_chunk + num_hit_chunks) * chunk_tokens
    end = min(hit_end, load_limit(num_prompt_tokens, block_size))
    return max(end - num_computed_tokens, 0)


def may_skip_layer_hooks(num_scheduled_tokens, decode_tokens: int) -> bool:
    """Whether vLLM may run a step whose requests schedule ``num_scheduled_tokens`` (request id -> tokens) as one
    full CUDA graph: every request schedules at most a decode's tokens (1, plus speculative ones), as vLLM's
    uniform-decode batches do (FULL_AND_PIECEWISE replays them whole). Such a forward runs no attention layer's
    Python, so no ``wait_for_layer_load``: a load in the step must be complete before the forward starts (a
    request whose prompt is loaded up to its last token computes one token). Mixed steps run piecewise, with
    attention outside the graphs, and wait layer by layer."""
    return max(num_scheduled_tokens.values(), default=0) <= decode_tokens


def chunks_completed(computed_before: int, computed_after: int, num_prompt_tokens: int, chunk_tokens: int) -> range:
    """Full prompt chunks whose last token became computed in a step that took the request from
    ``computed_before`` to ``computed_after`` tokens (chunked prefill spreads a prompt over steps)::

        before = 300, after = 800, C = 256:  chunk 1 ends at 512, chunk 2 at 768 -> range(1, 3)
    """
    full_end = (max(num_prompt_tokens, 0) // chunk_tokens) * chunk_tokens
    after = min(computed_after, full_end)
    if after <= computed_before:
        return range(0)
    return range(computed_before // chunk_tokens, after // chunk_tokens)
