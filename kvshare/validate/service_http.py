"""HTTP for the service level: OpenAI requests at temperature 0 and what their responses say.

Non-streaming requests with ``return_token_ids`` (the generated ids, and the prompt's)
and top logprobs (the gap at a divergence), ``ignore_eos`` so every run generates
the same number of tokens, and the ``kvshare`` request extension that turns the pool
and the local prefix cache off or on. From a response: token ids, per-step top
logprobs, provenance (the ``kvshare`` object) and ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

TOP_LOGPROBS = 5  # the gap needs two; more guards against two tokens with one text in a completions dict

POOL_OFF = {"use_pool": False, "use_local_cache": False}  # recompute everything
POOL_ONLY = {"use_pool": True, "use_local_cache": False}  # reuse only what the pool holds
LOCAL_ONLY = {"use_pool": False, "use_local_cache": True}


class ServiceError(RuntimeError):
    """A replica answered with an error or not at all."""


@dataclass
class Completion:
    token_ids: list[int]
    top_logprobs: list[list[float]]  # per generated step: the top logprob values
    prompt_token_ids: list[int] | None
    prompt_tokens: int
    cached_tokens: int | None
    provenance: dict | None  # {"replica", "local_tokens", "pool_tokens", "computed_tokens"}; None if absent
    raw: dict = field(default_factory=dict, repr=False)

    def reused(self, source: str) -> int:
        return int((self.provenance or {}).get(f"{source}_tokens", 0) or 0)


def get_json(url: str, timeout_s: float = 30.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServiceError(f"GET {url} failed: {exc}") from None


def post_json(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        text = err.read()[:500].decode(errors="replace")
        raise ServiceError(f"POST {url} answered {err.code}: {text}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ServiceError(f"POST {url} failed: {exc}") from None


def model_of(replica: str) -> tuple[str, int | None]:
    """(served model id, max_model_len if the server says) of a replica."""
    data = get_json(replica.rstrip("/") + "/v1/models").get("data") or []
    if not data:
        raise ServiceError(f"{replica}/v1/models lists no model")
    return str(data[0]["id"]), data[0].get("max_model_len")


def request(replica: str, model: str, prompt, max_tokens: int, extension: dict | None, timeout_s: float) -> Completion:
    """``prompt``: token ids (completions) or a list of messages (chat)."""
    chat = bool(prompt) and isinstance(prompt[0], dict)
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if extension is not None:
        body["kvshare"] = extension
    if chat:
        body.update(messages=prompt, logprobs=True, top_logprobs=TOP_LOGPROBS)
    else:
        body.update(prompt=list(prompt), logprobs=TOP_LOGPROBS)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return parse(post_json(replica.rstrip("/") + path, body, timeout_s), chat)


def tokenize(replica: str, model: str, text: str, timeout_s: float) -> list[int]:
    """The prompt ids of ``text`` as the replica tokenizes it (one token generated, pool and cache off)."""
    body = {
        "model": model,
        "prompt": text,
        "max_tokens": 1,
        "temperature": 0.0,
        "return_token_ids": True,
        "kvshare": POOL_OFF,
    }
    out = post_json(replica.rstrip("/") + "/v1/completions", body, timeout_s)
    ids = out["choices"][0].get("prompt_token_ids")
    if not ids:
        raise ServiceError(f"{replica} returned no prompt_token_ids: it does not support return_token_ids")
    return [int(t) for t in ids]


def parse(body: dict, chat: bool) -> Completion:
    choice = body["choices"][0]
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise ServiceError("the response carries no token_ids (the server ignored return_token_ids)")
    logprobs = choice.get("logprobs") or {}
    if chat:
        steps = [
            [float(t["logprob"]) for t in (step.get("top_logprobs") or [])] for step in logprobs.get("content") or []
        ]
    else:
        steps = [[float(v) for v in (step or {}).values()] for step in logprobs.get("top_logprobs") or []]
    usage = body.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return Completion(
        [int(t) for t in token_ids],
        steps,
        choice.get("prompt_token_ids"),
        int(usage.get("prompt_tokens", 0)),
        None if cached is None else int(cached),
        body.get("kvshare"),
        body,
    )
