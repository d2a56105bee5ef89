"""OpenAI request bodies as typed structs, validated on decode.

msgspec rejects wrong types and missing fields with a message naming the field
(e.g. "Expected `int`, got `str` - at `$.max_tokens`"); the checks msgspec cannot
express (ranges, mutually exclusive options) live in ``validate``.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec


class ApiError(Exception):
    """An OpenAI-style error: HTTP status, message, type, param, code."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 error_type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.error_type = status, message, param, code, error_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


class KVShareOptions(msgspec.Struct, forbid_unknown_fields=True):
    """The request extension ``"kvshare": {...}``."""

    use_pool: bool = True
    use_local_cache: bool = True


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: Union[str, None] = None  # optional, as in vLLM: the replica serves one model (under one or more names)
    max_tokens: Union[int, None] = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stream: bool = False
    stream_options: Union[StreamOptions, None] = None
    stop: Union[str, list[str], None] = None
    seed: Union[int, None] = None
    user: Union[str, None] = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    kvshare: KVShareOptions = msgspec.field(default_factory=KVShareOptions)
    # accepted and ignored, as vLLM does for fields it does not act on
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


class CompletionRequest(_Common, kw_only=True):
    prompt: Union[str, list]  # a string, token ids, or a one-element batch of either (checked in prompt_of)
    logprobs: Union[int, None] = None
    echo: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct):
    role: str
    content: Union[str, list[ContentPart], None] = None
    name: Union[str, None] = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Union[int, None] = None
    logprobs: bool = False
    top_logprobs: Union[int, None] = None


MAX_LOGPROBS = 5
ROLES = ("system", "user", "assistant", "developer", "tool")


def decode(body: bytes, kind: type) -> Any:
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"invalid request: {exc}", code="invalid_value") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # found by fuzzing: bytes that are not UTF-8 gave a 500
        raise ApiError(400, f"malformed JSON: {exc}", code="invalid_json") from None


def validate(req: CompletionRequest | ChatRequest) -> None:
    """Range and consistency checks; raises ApiError(400) naming the parameter."""
    if req.n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    if not 0.0 <= req.temperature <= 2.0:
        raise ApiError(400, "temperature must lie in [0, 2]", param="temperature")
    if not 0.0 < req.top_p <= 1.0:
        raise ApiError(400, "top_p must lie in (0, 1]", param="top_p")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:  # found by fuzzing: torch refused it with a 500
        raise ApiError(400, "seed must be a 64-bit signed integer", param="seed")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > 4 or any(not s for s in stops):
        raise ApiError(400, "stop takes at most 4 non-empty strings", param="stop")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"logprobs must lie in [0, {MAX_LOGPROBS}]", param="logprobs")
        prompt_of(req)
    else:
        if not req.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        for i, message in enumerate(req.messages):
            if message.role not in ROLES:
                raise ApiError(400, f"unknown role {message.role!r}", param=f"messages[{i}].role")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise ApiError(400, f"top_logprobs must lie in [0, {MAX_LOGPROBS}]", param="top_logprobs")


def prompt_of(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request: text or token ids."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "a batch of prompts is not supported; send one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, list) and not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ApiError(400, "prompt must be a string or a list of token ids (integers)", param="prompt")
    return prompt


def stop_strings(req: CompletionRequest | ChatRequest) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def requested_max_tokens(req: CompletionRequest | ChatRequest) -> int | None:
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        return req.max_completion_tokens
    return req.max_tokens


def message_text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content if part.type == "text")
