"""OpenAI request bodies decoded into typed structs and validated.

msgspec rejects wrong types and missing fields with a message naming the field
(e.g. "Expected `int`, got `str` - at `$.max_tokens`"); the checks msgspec cannot
express (ranges, mutually exclusive options) live in ``validate``.

Every parameter of the OpenAI and vLLM APIs that changes an answer is either honoured or
refused: the ones the built-in engine does not implement (``UNSUPPORTED_*``) are accepted
only at their neutral value and answered 400 naming them otherwise, never served as if
they were absent. Fields no API defines are ignored, as vLLM does.

A completion whose prompt is one list of token ids is read at once (``decode_completion``). A prompt of
262144 token ids is ~1.9 MB of JSON, nearly all of the body. msgspec checking that list and numpy reading it
took ~13 ms of such a request's time to first token on the H200's host, before the request's first KV copy
could start. So the list is found in the body and cut out: msgspec decodes the rest with a marker where the
list stood, and numpy checks and reads the list on a few threads at once (numpy compares arrays and reads
text without the GIL)::

    body     {"model": "m", "prompt": [17, 4, 99, ...], "max_tokens": 16}
                                      ^---- the list ---^
    msgspec  {"model": "m", "prompt": "kvshare-prompt-<nonce>", "max_tokens": 16}
    numpy    17, 4, 99, ...   cut at commas into pieces, each checked as JSON and read on a thread

The marker carries a nonce drawn per process, which no client can send: msgspec handing it back as the
prompt proves that the list cut out was the request's top-level prompt. Anything else (a text prompt, a
batch, a list that is not JSON's list of non-negative integers, a "prompt" key elsewhere) takes msgspec's
generic decode, which answers any error.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import msgspec
import numpy as np


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, param, code."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.error_type = status, message, param, code, error_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class KVShareOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The request extension ``"kvshare": {...}``."""

    use_pool: bool = True
    use_local_cache: bool = True
    timeline: bool = False  # return (and log) the request's timeline in the response's kvshare object


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


# Parameters the built-in engine does not implement -> the values that mean "off" (accepted).
UNSUPPORTED_COMMON: dict[str, tuple] = {
    "response_format": (None, {"type": "text"}),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "structured_outputs": (None,),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "min_tokens": (None, 0),
    "logits_processors": (None,),
    "prompt_logprobs": (None,),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "truncate_prompt_tokens": (None,),
    "return_tokens_as_token_ids": (None, False),
}
UNSUPPORTED_COMPLETION: dict[str, tuple] = {"best_of": (None, 1), "suffix": (None, ""), "prompt_embeds": (None,)}
UNSUPPORTED_CHAT: dict[str, tuple] = {
    # with no tools to call, "auto" picks none of them
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
}


def _unsupported_fields(name: str, table: dict[str, tuple], base: type) -> type:
    """A struct base that decodes each of ``table``'s parameters as any JSON value (checked in validate)."""
    return msgspec.defstruct(name, [(field, object, None) for field in table], bases=(base,), kw_only=True)


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None  # optional, as in vLLM: the replica serves one model (under one or more names)
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    kvshare: KVShareOptions = msgspec.field(default_factory=KVShareOptions)
    cache_salt: str | None = None  # vLLM's: requests with different salts never share cached KV
    # sampling, with vLLM's semantics (kvshare.engine.sampler)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    top_k: int | None = None  # None, 0 or -1: off
    min_p: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a JSON object key, so a string) -> bias
    stop_token_ids: list[int] | None = None


_CommonChecked = _unsupported_fields("_CommonChecked", UNSUPPORTED_COMMON, _Common)
_CompletionChecked = _unsupported_fields("_CompletionChecked", UNSUPPORTED_COMPLETION, _CommonChecked)
_ChatChecked = _unsupported_fields("_ChatChecked", UNSUPPORTED_CHAT, _CommonChecked)


class CompletionRequest(_CompletionChecked, kw_only=True):
    prompt: str | list  # a string, token ids, or a one-element batch of either (checked in prompt_of)
    logprobs: int | None = None
    echo: bool = False


class TokenIdsCompletionRequest(CompletionRequest, kw_only=True):
    """A completion whose prompt is one list of token ids: ``decode_completion`` reads the list into one
    int64 array (``prompt`` holds that array afterwards) and msgspec the rest, where ``prompt`` is the
    marker that stood in for the list. The generic decode with ``prompt_of``'s per-element checks took ~35 ms
    at 128k."""

    prompt: msgspec.Raw  # as decoded (the marker); the int64 array once read


class ContentPart(msgspec.Struct):
    type: str  # only "text" is served: the built-in engine reads no images, audio or files
    text: str = ""


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatRequest(_ChatChecked, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


MAX_LOGPROBS = 5
MAX_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty: [-2, 2]
MAX_LOGIT_BIAS = 100.0
MAX_STOP_STRINGS = 4  # OpenAI's bound
# A stop string's bound: the held-back tail of a stream may be as long, so a longer one delays every stream
# by as much; matching costs the same whatever the length (kvshare.serve.detokenize.StopMatcher).
MAX_STOP_CHARS = 4096
ROLES = ("system", "user", "assistant", "developer", "tool")
_AT_PATH = re.compile(r"at `\$\.?([^`]*)`")
_FIELD = re.compile(r"field `([^`]*)`")  # a missing or unknown field, named relative to the path it is at


def decode_completion(body: bytes) -> CompletionRequest:
    """A completion request: at once where the prompt is one list of token ids (the list cut out of the body,
    read by numpy, the rest by msgspec: see the module's docstring), else through the generic decode."""
    span = find_list(body)
    if span is not None:
        start, end = span
        try:
            req = msgspec.json.decode(body[:start] + MARK + body[end + 1 :], type=TokenIdsCompletionRequest)
        except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            req = None
        if req is not None and bytes(req.prompt) == MARK:  # the list was the request's prompt
            ids = read_list(body[start : end + 1])
            if ids is not None:
                req.prompt = ids
                return req
    return decode(body, CompletionRequest)  # a text prompt or a batch; or an error, reported from here


def decode(body: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}", param=_param_of(str(exc)), code="invalid_value") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # found by fuzzing: bytes that are not UTF-8 gave a 500
        raise ApiError(400, f"malformed JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # msgspec's nesting limit: a body like [[[[...]]]] 1000 levels deep
        raise ApiError(400, "malformed JSON: nested too deeply", code="invalid_json") from None


def _param_of(message: str) -> str | None:
    """The whole path of the parameter a msgspec error names: "... - at `$.messages[0].content`" ->
    "messages[0].content"; "missing required field `role` - at `$.messages[0]`" -> "messages[0].role"."""
    at, field = _AT_PATH.search(message), _FIELD.search(message)
    path = at.group(1) if at else ""
    if field is not None:
        path = f"{path}.{field.group(1)}" if path else field.group(1)
    return path.replace("[...]", "") or None


# -- a completion's prompt of token ids, read from its body -----------------------------------------

PROMPT_KEY = b'"prompt"'
MARK = b'"kvshare-prompt-' + os.urandom(12).hex().encode() + b'"'
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
# threads reading a long prompt: 4 where there are 8 cores or more. On the H200's host (16 cores) a 131072-token
# body took 8.6 ms on one thread, 5.0 on two, 4.2 on four and 4.7 on eight (2026-12-04, commit a88001c;
# `kvshare bench parse` measures it)
PARSE_THREADS = max(1, min(4, _CORES // 2))
PARSE_PIECE_BYTES = 64 << 10  # no thread gets less text than this (~9000 token ids)
_WHITESPACE = b" \t\r\n"  # JSON's
_parse_executor = None


def find_list(body: bytes) -> tuple[int, int] | None:
    """(index of ``[``, index of ``]``) of the first ``"prompt": [...]`` in ``body`` whose list holds no
    list; None where there is none. Whether it is the top-level prompt is msgspec's to say (``MARK``)."""
    at = body.find(PROMPT_KEY)
    if at < 0:
        return None
    i = _skip_whitespace(body, at + len(PROMPT_KEY))
    if body[i : i + 1] != b":":
        return None
    start = _skip_whitespace(body, i + 1)
    if body[start : start + 1] != b"[":
        return None
    end = body.find(b"]", start)
    if end < 0 or body.find(b"[", start + 1, end) >= 0:
        return None
    return start, end


def read_list(raw: bytes) -> np.ndarray | None:
    """A JSON list of non-negative integers (``[...]``) as one int64 array; None for any other text.

    An integer beyond int64 reads as the int64 maximum, which no vocabulary holds."""
    if raw[:1] != b"[" or raw[-1:] != b"]":
        return None
    inner = raw[1:-1]
    if not inner.strip(_WHITESPACE):
        return np.empty(0, dtype=np.int64)
    pieces = cut_at_commas(inner, min(PARSE_THREADS, len(inner) // PARSE_PIECE_BYTES))
    if len(pieces) == 1:
        return read_numbers(inner)
    parts = list(_parse_pool().map(read_numbers, pieces))
    return None if any(part is None for part in parts) else np.concatenate(parts)


def cut_at_commas(text: bytes, num: int) -> list[bytes]:
    """``text`` cut at commas (which are dropped) into at most ``num`` pieces of about equal size."""
    pieces, start = [], 0
    for i in range(1, num):
        cut = text.find(b",", max(start, len(text) * i // num))
        if cut < 0:
            break
        pieces.append(text[start:cut])
        start = cut + 1
    pieces.append(text[start:])
    return pieces


def read_numbers(text: bytes) -> np.ndarray | None:
    """``text``: JSON's non-negative integers between commas (``17, 4,99``), as int64; None for anything else
    (a sign, a fraction, a string, a missing or extra comma, ``1 2``, a leading zero).

    Elementwise checks (a few passes of ~0.05 ms over a 1.9 MB list), then numpy reads the numbers: it
    consumes number, comma, number, ... and the count proves every comma was read between two numbers."""
    chars = np.frombuffer(text, dtype=np.uint8)
    digit = (chars - np.uint8(48)) < 10  # wraps below "0"
    comma = chars == 44
    if not (digit | comma | (chars == 32) | (chars == 10) | (chars == 13) | (chars == 9)).all():
        return None
    first = digit.copy()  # each number's first digit
    first[1:] &= ~digit[:-1]
    commas = int(np.count_nonzero(comma))
    if np.count_nonzero(first) != commas + 1:  # as many numbers as commas allow, none split by whitespace
        return None
    if (first[:-1] & (chars[:-1] == 48) & digit[1:]).any():  # 01: JSON writes no leading zeros
        return None
    try:
        numbers = np.fromstring(text, dtype=np.int64, sep=",")
    except ValueError:  # text it could not read to its end (numpy >= 2.3; earlier ones warn and stop)
        return None
    return numbers if len(numbers) == commas + 1 else None


def _skip_whitespace(body: bytes, i: int) -> int:
    while i < len(body) and body[i] in _WHITESPACE:
        i += 1
    return i


def _parse_pool():
    global _parse_executor
    if _parse_executor is None:
        from concurrent.futures import ThreadPoolExecutor

        # threads start only as pieces need them: PARSE_THREADS of them, or up to 8 where `kvshare bench parse`
        # tries more
        _parse_executor = ThreadPoolExecutor(8, thread_name_prefix="kvshare-parse")
    return _parse_executor


# -- checks msgspec cannot express ------------------------------------------------------------------


def _refuse_unsupported(req: CompletionRequest | ChatRequest, table: dict[str, tuple]) -> None:
    for name, neutral in table.items():
        if getattr(req, name) not in neutral:
            allowed = " or ".join(json.dumps(v) for v in neutral)
            raise ApiError(
                400,
                f"{name} is not supported by this server (the built-in engine does not implement it); "
                f"leave it out or send {allowed}",
                param=name,
                code="unsupported_parameter",
            )


def _check_sampling(req: CompletionRequest | ChatRequest) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if not -MAX_PENALTY <= getattr(req, name) <= MAX_PENALTY:
            raise ApiError(400, f"{name} must lie in [-2, 2]", param=name)
    if not 0.0 < req.repetition_penalty < float("inf"):
        raise ApiError(400, "repetition_penalty must be positive (1: off)", param="repetition_penalty")
    if req.top_k is not None and req.top_k < -1:
        raise ApiError(400, "top_k must be -1 or 0 (off) or a positive number of tokens", param="top_k")
    if not 0.0 <= req.min_p <= 1.0:
        raise ApiError(400, "min_p must lie in [0, 1]", param="min_p")
    if req.cache_salt is not None and not req.cache_salt:
        raise ApiError(400, "cache_salt must be a non-empty string if given", param="cache_salt")
    for key, bias in (req.logit_bias or {}).items():
        if not (key.isascii() and key.isdigit()):  # JSON object keys are strings: token ids written out
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise ApiError(
                400, f"logit_bias values must lie in [-100, 100], got {bias} for token {key}", param="logit_bias"
            )


def validate(req: CompletionRequest | ChatRequest) -> None:
    """Range and consistency checks; raises ApiError(400) naming the parameter."""
    _refuse_unsupported(req, UNSUPPORTED_COMMON)
    _refuse_unsupported(req, UNSUPPORTED_COMPLETION if isinstance(req, CompletionRequest) else UNSUPPORTED_CHAT)
    _check_sampling(req)
    if req.n < 1:
        raise ApiError(400, "n must be at least 1", param="n")
    if req.n > 1:
        raise ApiError(
            400,
            "n > 1 is not supported by this server (the built-in engine runs one answer per request); send n requests",
            param="n",
            code="unsupported_parameter",
        )
    if not 0.0 <= req.temperature <= 2.0:
        raise ApiError(400, "temperature must lie in [0, 2]", param="temperature")
    if not 0.0 < req.top_p <= 1.0:
        raise ApiError(400, "top_p must lie in (0, 1]", param="top_p")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:  # found by fuzzing: torch refused it with a 500
        raise ApiError(400, "seed must be a 64-bit signed integer", param="seed")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise ApiError(400, f"stop takes at most {MAX_STOP_STRINGS} non-empty strings", param="stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"a stop string may have at most {MAX_STOP_CHARS} characters", param="stop")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError(400, "echo is not supported by this server", param="echo", code="unsupported_parameter")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must lie in [0, {MAX_LOGPROBS}]", param="logprobs")
        prompt_of(req)
    else:
        if not req.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        for i, message in enumerate(req.messages):
            if message.role not in ROLES:
                raise ApiError(400, f"unknown role {message.role!r}", param=f"messages[{i}].role")
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if part.type != "text":
                    raise ApiError(
                        400,
                        f"content parts of type {part.type!r} are not supported (the built-in engine reads text only)",
                        param=f"messages[{i}].content[{j}].type",
                        code="unsupported_parameter",
                    )
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must lie in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        if req.top_logprobs and not req.logprobs:  # vLLM's rule and message
            raise ApiError(400, "when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text or token ids."""
    prompt = req.prompt
    if isinstance(req, TokenIdsCompletionRequest):
        return prompt  # integers, checked by the typed decode
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(
                400,
                "a batch of prompts is not supported; send one prompt per request",
                param="prompt",
                code="unsupported_parameter",
            )
        prompt = prompt[0]
    if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ApiError(400, "prompt must be a string or a list of token ids (integers)", param="prompt")
    return prompt


def stop_strings(req: CompletionRequest | ChatRequest) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def requested_max_tokens(req: CompletionRequest | ChatRequest) -> tuple[str, int | None]:
    """(the field that names the request's output bound, its value): a chat's max_completion_tokens where
    given (OpenAI's name), else max_tokens."""
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens", req.max_completion_tokens
    return "max_tokens", req.max_tokens


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content if part.type == "text")
