"""OpenAI response bodies of one request, logprobs included, built from the engine's token events (pure: no HTTP,
no metrics).

The server feeds each ``TokenEvent`` to ``ResponseBuilder.add`` and writes what it returns::

    streaming      add() -> chunks [role chunk (chat, once)] [content chunk per event]
                   final_chunks() -> [last chunk: finish_reason, kvshare, token_ids?] [usage chunk?]
    not streaming  add() -> []; final_body() -> one completion / chat.completion body

Every final answer carries ``usage`` (``cached_tokens``: local + pool) and the ``kvshare``
object, the request's provenance (both withheld where ServeConfig.provenance says so): which
replica, and how many prompt tokens came from its local cache, from the pool, and were computed;
with ``{"kvshare": {"timeline": true}}`` also the request's ``timeline`` (kvshare.engine.timeline:
seconds since arrival of each step to the first token).

Logprobs come in the two OpenAI shapes (completions and chat), each token named by its text. One that is
not whole UTF-8 on its own (a byte of a multi-byte character, from byte-level BPE or byte fallback) decodes
to U+FFFD like every other such byte, so two of them would collide as keys of a completion's
``top_logprobs``: it is named as OpenAI names it, ``bytes:`` and its bytes escaped (``bytes:\\xe4\\xbd``),
and chat's ``bytes`` carry the token's raw bytes. Special tokens are named by their text (as vLLM does);
an id the tokenizer does not know (a synthetic preset's vocabulary is larger than its byte tokenizer's)
has no text at all and is named ``token_id:N`` (vLLM's placeholder), ``bytes`` null.
"""

from __future__ import annotations

import codecs
import time
from typing import Any

from kvshare.serve.detokenize import TextStream
from kvshare.serve.engine_request import Prepared

# who sees a request's provenance (where its prompt tokens came from, cached_tokens): it says whether a prefix was
# in the caches already, so across the users of one namespace it is a prompt oracle. own-tenant: only requests
# whose namespace is their own (a tenant identity or a cache_salt); off: nobody; all: everybody (one user)
PROVENANCE = ("off", "own-tenant", "all")


def is_provenance_shown(policy: str, namespace_salt: str) -> bool:
    """Whether a request of this namespace salt (tenancy.namespace_salt) gets its provenance under ``policy``."""
    return policy == "all" or (policy == "own-tenant" and bool(namespace_salt))


class ResponseBuilder:
    """Accumulates one request's tokens into OpenAI bodies and stream chunks."""

    def __init__(
        self,
        req,
        prep: Prepared,
        chat: bool,
        rid: str,
        tokenizer: Any,
        replica_name: str,
        is_provenance_shown: bool = True,
    ) -> None:
        self.req, self.prep, self.chat, self.rid = req, prep, chat, rid
        self.tokenizer, self.replica_name = tokenizer, replica_name
        self.is_provenance_shown = is_provenance_shown  # ServeConfig.provenance decided it for this request
        self.stream = TextStream(tokenizer.decode, prep.stops)
        self.token_ids: list[int] = []
        self.events: list[Any] = []
        self.provenance = None
        self.finish_reason: str | None = None
        self.created = int(time.time())
        self._sent_role = False
        self._stream_offsets = TextOffsets()  # text_offset across a stream's chunks

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, event) -> list[dict]:
        if self.provenance is None:
            self.provenance = event.provenance
        self.token_ids.append(event.token_id)
        self.events.append(event)
        # the token that ends a request with "stop" (EOS, or one of stop_token_ids) adds no text, as in vLLM
        piece = self.stream.add(event.token_id) if event.finish_reason != "stop" else ""
        if self.stream.is_stopped:
            self.finish_reason = "stop"
        elif event.finish_reason:
            self.finish_reason = event.finish_reason
            piece += self.stream.finish()
        if not self.req.stream:
            return []
        chunks = []
        if self.chat and not self._sent_role:
            chunks.append(self._with_usage_so_far(self._chunk({"role": "assistant", "content": ""}, None), 0))
            self._sent_role = True
        wants_logprobs = self.prep.params.logprobs is not None
        if piece or wants_logprobs:  # no empty chunks: clients time the first content token
            logprobs = self._logprobs([event], self._stream_offsets) if wants_logprobs else None
            chunks.append(self._with_usage_so_far(self._chunk(piece, None, logprobs), self.num_tokens))
        return chunks

    def _with_usage_so_far(self, chunk: dict, num_generated: int) -> dict:
        """``chunk`` with the usage up to it, where the client asked for continuous usage stats (vLLM's shape:
        the counts alone; the usage chunk at the end has the details)."""
        if self.prep.is_usage_continuous:
            n_prompt = len(self.prep.prompt_ids)
            chunk["usage"] = {
                "prompt_tokens": n_prompt,
                "completion_tokens": num_generated,
                "total_tokens": n_prompt + num_generated,
            }
        return chunk

    def _chunk(self, piece, finish_reason, logprobs=None) -> dict:
        if self.chat:
            delta = piece if isinstance(piece, dict) else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {
                "id": self.rid,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.req.model,
                "choices": [choice],
            }
        choice = {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": finish_reason}
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
        }

    def _logprobs(self, events, offsets: TextOffsets | None = None):
        tok = self.tokenizer
        return chat_logprobs(tok, events) if self.chat else completion_logprobs(tok, events, offsets)

    def usage(self) -> dict:
        p = self.provenance
        cached = (p.local_tokens + p.pool_tokens) if p else 0
        n_prompt = len(self.prep.prompt_ids)
        details = {"cached_tokens": cached} if self.is_provenance_shown else None  # null, as vLLM's by default
        return {
            "prompt_tokens": n_prompt,
            "completion_tokens": self.num_tokens,
            "total_tokens": n_prompt + self.num_tokens,
            "prompt_tokens_details": details,
        }

    def kvshare(self) -> dict:
        """The request's provenance, or {} where it is withheld: which replica served, what it held already and how
        long its steps took are what another user of the namespace could learn the prompts of others from."""
        if not self.is_provenance_shown:
            return {}
        timeline = {"timeline": self.prep.options.timeline.as_dict()} if self.prep.options.timeline is not None else {}
        p = self.provenance
        return {
            "replica": self.replica_name,
            "local_tokens": p.local_tokens if p else 0,
            "pool_tokens": p.pool_tokens if p else 0,
            "computed_tokens": p.computed_tokens if p else 0,
            "deterministic": bool(p and p.is_deterministic),
            "pool_kv_bytes": p.pool_kv_bytes if p else 0,
            **({"pool_state_bytes": p.pool_state_bytes} if p and p.pool_state_bytes else {}),
            **timeline,
        }

    def final_chunks(self) -> list[dict]:
        last = self._with_usage_so_far(
            self._chunk("" if not self.chat else {}, self.finish_reason or "stop"), self.num_tokens
        )
        last["kvshare"] = self.kvshare()
        if self.req.return_token_ids:
            last["choices"][0]["token_ids"] = self.token_ids
        chunks = [last]
        if self.prep.include_usage:
            chunks.append(
                {
                    "id": self.rid,
                    "object": last["object"],
                    "created": self.created,
                    "model": self.req.model,
                    "choices": [],
                    "usage": self.usage(),
                    "kvshare": self.kvshare(),
                }
            )
        return chunks

    def final_body(self) -> dict:
        logprobs = self._logprobs(self.events) if self.prep.params.logprobs is not None else None
        if self.chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": self.stream.text},
                "logprobs": logprobs,
                "finish_reason": self.finish_reason or "stop",
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": self.stream.text,
                "logprobs": logprobs,
                "finish_reason": self.finish_reason or "stop",
            }
            obj = "text_completion"
        if self.req.return_token_ids:
            choice["token_ids"] = self.token_ids
            ids = self.prep.prompt_ids
            choice["prompt_token_ids"] = ids if isinstance(ids, list) else ids.tolist()
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
            "usage": self.usage(),
            "kvshare": self.kvshare(),
        }


# -- logprobs ------------------------------------------------------------------------------


def token_name(tokenizer: Any, token_id: int) -> tuple[str, bytes | None]:
    """A token's name in logprobs and its raw bytes (None: an id outside the tokenizer's vocabulary)."""
    if not 0 <= token_id < tokenizer.vocab_size:
        return f"token_id:{token_id}", None
    raw = tokenizer.token_bytes(token_id)
    try:
        return raw.decode("utf-8"), raw
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


class TextOffsets:
    """``text_offset``: characters of the answer's text before each token; bytes of a split character count
    once and special tokens not at all. One per answer, so the offsets of a stream's chunks run on."""

    def __init__(self) -> None:
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.offset = 0

    def advance(self, tokenizer: Any, token_id: int, raw: bytes | None) -> int:
        """The offset of this token; the next one's is past its text."""
        at = self.offset
        if raw is not None and not tokenizer.is_special(token_id):  # special tokens are not in the text
            self.offset += len(self._text.decode(raw))
        return at


def completion_logprobs(tokenizer: Any, events: list[Any], offsets: TextOffsets | None = None) -> dict:
    """``offsets``: where the answer's text stands before ``events`` (a stream passes one per answer)."""
    offsets = offsets or TextOffsets()
    tokens, token_logprobs, top, text_offset = [], [], [], []
    for event in events:
        name, raw = token_name(tokenizer, event.token_id)
        tokens.append(name)
        token_logprobs.append(event.logprob)
        top.append({token_name(tokenizer, t)[0]: lp for t, lp in (event.top_logprobs or {}).items()})
        text_offset.append(offsets.advance(tokenizer, event.token_id, raw))
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": text_offset}


def chat_logprobs(tokenizer: Any, events: list[Any]) -> dict:
    content = []
    for event in events:
        name, raw = token_name(tokenizer, event.token_id)
        top = []
        for t, lp in (event.top_logprobs or {}).items():
            top_name, top_raw = token_name(tokenizer, t)
            top.append({"token": top_name, "logprob": lp, "bytes": _listed(top_raw)})
        content.append({"token": name, "logprob": event.logprob, "bytes": _listed(raw), "top_logprobs": top})
    return {"content": content}


def _listed(raw: bytes | None) -> list[int] | None:
    return None if raw is None else list(raw)
