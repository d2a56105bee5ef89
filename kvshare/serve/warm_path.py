"""The replica's request path, warmed before it reports healthy (after the engine's warm-up).

One token-id completion through the handler's host steps, streamed and not, with logprobs and
a timeline: the typed decode, the checks, the sampler's logprobs, the response's chunks and
their encoding. On the H200 a fresh replica's first request paid ~4 ms more than later ones in
these steps (parse +2 ms, first token written +2 ms). Then the decode of one body of the longest
prompt the replica takes, ids spread over the vocabulary, into its array: a fresh replica's first
256k-token request had paid ~17 ms more in parse than later ones (the runs of 2026-12-01 at 680646f, H200); with this
step a first 131056-token request parsed no slower than the next (9.1 vs 12.3 ms, the runs of 2026-12-01 at bc152e4),
while a first 32k-token one still parses ~1.2 ms slower (cause not found). Then a chat body's decode and the
tokenizer's warm-up (its chat template compiled, ``warm_text_path``): without it a fresh replica's first text
request spent 25-29 ms more in its host steps than the next one on 2 CPU cores (template compile ~25 ms, the chat
body's decoder ~1 ms); with it at most 0.2 ms more (benchmarks/tokenize_cost.py --fresh; the results of 2026-12-05 at
fcc1277). Nothing is loaded or stored (pool and local cache off; no token ids cached), the engine's counters leave
it out (``Engine.uncounted``), and it never passes the HTTP layer, so no metric counts it.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np

from kvshare.serve import api_types as A
from kvshare.serve.engine_request import Prepared, sampling_params
from kvshare.serve.responses import ResponseBuilder

_json = msgspec.json.Encoder()


def warm_request_path(engine: Any, model_name: str, replica_name: str, max_prompt_tokens: int | None = None) -> None:
    from kvshare.engine.engine import RequestOptions
    from kvshare.engine.timeline import Timeline

    vocab = engine.model_config.vocab_size
    ids = [i % vocab for i in range(min(engine.layout.chunk_tokens + 3, engine.max_model_len - 3))]
    for stream in (True, False):
        body = _json.encode(
            {
                "model": model_name,
                "prompt": ids,
                "max_tokens": 2,
                "temperature": 0,
                "logprobs": 2,
                "stream": stream,
                "ignore_eos": True,
                "return_token_ids": True,
                "kvshare": {"timeline": True, "use_pool": False, "use_local_cache": False},
            }
        )
        req = A.decode_completion(body)
        A.validate(req)
        array = np.asarray(A.prompt_of(req), dtype=np.int64)
        params = sampling_params(req, 2, req.logprobs, vocab)
        options = RequestOptions(use_pool=False, use_local_cache=False, timeline=Timeline(time.perf_counter()))
        prep = Prepared(list(ids), params, options, A.stop_strings(req), False, array)
        out = ResponseBuilder(req, prep, False, "cmpl-warmup", engine.tokenizer, replica_name)
        with engine.uncounted():
            for event in engine.generate(array, params, options):
                for chunk in out.add(event):
                    _json.encode(chunk)
                options.timeline.mark("first_token_written")
        for chunk in out.final_chunks():
            _json.encode(chunk)
        _json.encode(out.final_body())
    longest = (
        engine.max_model_len - 1 if max_prompt_tokens is None else min(max_prompt_tokens, engine.max_model_len - 1)
    )
    spread = (np.arange(longest, dtype=np.int64) * 7919 + vocab // 2) % vocab  # multi-digit ids, as real ones are
    body = _json.encode({"model": model_name, "prompt": spread.tolist(), "max_tokens": 1})
    array = np.asarray(A.prompt_of(A.decode_completion(body)), dtype=np.int64)
    array.min(), array.max()  # the range check a request's ids get
    warm_text_path(engine.tokenizer, model_name)


def warm_text_path(tokenizer: Any, model_name: str) -> None:
    """A chat request's one-time host costs before its prefill: its body's decoder, the chat template's compile."""
    chat = _json.encode({"model": model_name, "messages": [{"role": "user", "content": "warm-up"}], "max_tokens": 1})
    A.validate(A.decode(chat, A.ChatRequest))
    tokenizer.warm_up()
