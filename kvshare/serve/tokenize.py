"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes, and the prompt -> token ids rule they share
with completions and chat.

/tokenize answers exactly the ids a completion (``prompt``) or chat request (``messages``) of the same
body would run: kvshare adds no special tokens to a completion's prompt, so ``add_special_tokens: true``
is refused rather than answered with ids no request would see. ``token_strs`` are each token's text as
the logprobs name it (vLLM gives the vocabulary's raw strings, e.g. ``Ġhello``).
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from kvshare.serve import api_types as A
from kvshare.serve.off_loop import off_loop


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``) in one struct."""

    model: str | None = None
    prompt: str | None = None
    messages: list[A.ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    # vLLM's chat form takes these; kvshare renders with the model's own template only, so they are refused
    chat_template: Any = None
    chat_template_kwargs: Any = None
    tools: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


_REFUSED = ("chat_template", "chat_template_kwargs", "tools", "mm_processor_kwargs", "media_io_kwargs")


async def prompt_array(tokenizer: Any, text: str) -> np.ndarray:
    """``tokenizer.encode_array(text)`` without stalling the event loop: the pieces are looked up here (a hash and
    a lookup each, a file read where only the shared level holds one), what no level holds is encoded off the loop
    when it is long (kvshare.serve.off_loop), so a text seen before pays no hop and a miss no other stream's wait."""
    lookup = tokenizer.look_up(text)
    return await off_loop(tokenizer.encode_missing, lookup, num_chars=lookup.num_missing_chars)


def chat_prompt_ids(tokenizer: Any, messages: list[A.ChatMessage], add_generation_prompt: bool = True) -> np.ndarray:
    """A chat's prompt ids (one int64 array): the model's chat template over the messages' text, encoded."""
    return tokenizer.encode_array(chat_prompt_text(tokenizer, messages, add_generation_prompt))


def chat_prompt_text(tokenizer: Any, messages: list[A.ChatMessage], add_generation_prompt: bool = True) -> str:
    """The model's chat template over the messages' text; a template that cannot render them (or a model without
    one) is the request's 400, not the server's 500."""
    from jinja2.exceptions import TemplateError

    from kvshare.errors import UserError

    try:
        return tokenizer.chat_text(
            [{"role": m.role, "content": A.message_text(m)} for m in messages], add_generation_prompt
        )
    except (UserError, TemplateError) as exc:
        raise A.ApiError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None


def tokenize(req: TokenizeRequest, tokenizer: Any, max_model_len: int) -> dict:
    """The body of a /tokenize answer; ApiError(400) naming what cannot be honoured."""
    if (req.prompt is None) == (req.messages is None):
        raise A.ApiError(400, "give either prompt (a completion's text) or messages (a chat)", param="prompt")
    for name in _REFUSED:
        if getattr(req, name) is not None:
            raise A.ApiError(
                400, f"{name} is not supported: kvshare renders chats with the model's own template", param=name
            )
    if req.add_special_tokens:
        raise A.ApiError(
            400,
            "kvshare adds no special tokens to prompts (a request runs the prompt's own tokens); "
            "leave add_special_tokens out or false",
            param="add_special_tokens",
        )
    if req.prompt is not None:
        ids = tokenizer.encode(req.prompt)
    else:
        if req.continue_final_message:
            raise A.ApiError(400, "continue_final_message is not supported", param="continue_final_message")
        A.validate(A.ChatRequest(messages=req.messages))  # the messages a chat request would refuse, refused alike
        ids = chat_prompt_ids(tokenizer, req.messages, req.add_generation_prompt).tolist()
    strs = [tokenizer.decode([i], skip_special_tokens=False) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, tokenizer: Any, vocab_size: int) -> dict:
    """The body of a /detokenize answer; ids outside the vocabulary are a 400."""
    if any(not 0 <= t < vocab_size for t in req.tokens):
        raise A.ApiError(400, f"token ids must lie in [0, {vocab_size})", param="tokens")
    return {"prompt": tokenizer.decode(req.tokens, skip_special_tokens=False)}  # as vLLM: special tokens kept
