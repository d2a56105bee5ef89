"""The replica's HTTP server: OpenAI completions and chat (streaming or not), models, health, metrics."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvshare.serve import api_types as A
from kvshare.serve.detokenize import TextStream
from kvshare.serve.metrics import ReplicaMetrics
from kvshare.serve.render import completion_logprobs, chat_logprobs
from kvshare.serve.worker import EngineWorker, Job, QueueFull

log = logging.getLogger("kvshare.serve")
_json = msgspec.json.Encoder()


@dataclass(frozen=True)
class ServeConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    replica_name: str = "replica"
    max_body_bytes: int = 16 << 20
    max_requests: int = 64  # queued + running; more get 429
    max_prompt_tokens: int | None = None  # default: the model's context
    max_tokens_limit: int = 8192
    default_chat_max_tokens: int = 1024
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    tenant_header: str = ""  # e.g. "X-Tenant-ID": its value salts the pool namespace

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0 or self.max_requests <= 0 or self.max_tokens_limit <= 0:
            raise ValueError("limits must be positive")


@dataclass
class _Prepared:
    prompt_ids: list[int]
    params: Any
    options: Any
    stops: list[str]
    include_usage: bool


class ReplicaServer:
    """Builds the aiohttp application around an engine; ``main`` runs it."""

    def __init__(self, engine: Any, config: ServeConfig) -> None:
        self.engine = engine
        self.config = config
        self.worker = EngineWorker(engine, config.max_requests)
        self.metrics = ReplicaMetrics(lambda: _as_dict(engine.stats()))
        self.started_at = time.time()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.on_startup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, self.worker.start))
        app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, self.worker.stop))
        return app

    # -- middleware and small endpoints ------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if self.config.api_keys and request.path.startswith("/v1/"):
                self._authenticate(request)
            return await handler(request)
        except A.ApiError as exc:
            self.metrics.errors.labels(str(exc.status)).inc()
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPRequestEntityTooLarge:
            err = A.ApiError(413, f"request body exceeds {self.config.max_body_bytes} bytes", code="body_too_large")
            self.metrics.errors.labels("413").inc()
            return web.json_response(err.body(), status=413)
        except web.HTTPException as exc:  # 404/405 of the router
            err = A.ApiError(exc.status, exc.reason, code="not_found" if exc.status == 404 else None)
            return web.json_response(err.body(), status=exc.status)

    def _authenticate(self, request: web.Request) -> None:
        header = request.headers.get("Authorization", "")
        token = header[7:] if header.startswith("Bearer ") else ""
        if token not in self.config.api_keys:
            raise A.ApiError(401, "missing or wrong API key", code="invalid_api_key", error_type="authentication_error")

    async def models(self, request: web.Request) -> web.Response:
        model = {"id": self.engine.model_name, "object": "model", "created": int(self.started_at),
                 "owned_by": "kvshare", "max_model_len": self.engine.max_model_len}
        return web.json_response({"object": "list", "data": [model]})

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "replica": self.config.replica_name,
                                  "waiting": self.worker.num_waiting, "running": self.worker.num_running})

    async def metrics_text(self, request: web.Request) -> web.Response:
        self.metrics.waiting.set(self.worker.num_waiting)
        self.metrics.running.set(self.worker.num_running)
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- generation ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = A.decode(await request.read(), A.CompletionRequest)
        A.validate(req)
        prompt = A.prompt_of(req)
        if isinstance(prompt, str):
            prompt_ids = self.engine.tokenizer.encode(prompt)
        else:
            prompt_ids = list(prompt)
        prepared = self._prepare(request, req, prompt_ids, default_max_tokens=16, logprobs=req.logprobs)
        return await self._respond(request, req, prepared, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = A.decode(await request.read(), A.ChatRequest)
        A.validate(req)
        messages = [{"role": m.role, "content": A.message_text(m)} for m in req.messages]
        prompt_ids = self.engine.tokenizer.apply_chat_template(messages)
        top = (req.top_logprobs or 0) if req.logprobs else None
        prepared = self._prepare(request, req, prompt_ids, default_max_tokens=None, logprobs=top)
        return await self._respond(request, req, prepared, chat=True)

    def _prepare(self, request, req, prompt_ids: list[int], default_max_tokens: int | None, logprobs) -> _Prepared:
        from kvshare.engine.engine import RequestOptions, SamplingParams

        if req.model != self.engine.model_name:
            raise A.ApiError(404, f"model {req.model!r} does not exist; this replica serves {self.engine.model_name!r}",
                             param="model", code="model_not_found")
        if not prompt_ids:
            raise A.ApiError(400, "the prompt is empty", param="prompt")
        vocab = self.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise A.ApiError(400, f"token ids must lie in [0, {vocab})", param="prompt")
        context = self.engine.max_model_len
        limit = min(context - 1, self.config.max_prompt_tokens or context)
        if len(prompt_ids) > limit:
            raise A.ApiError(400, f"the prompt has {len(prompt_ids)} tokens; this replica takes at most {limit}",
                             param="messages" if default_max_tokens is None else "prompt", code="context_length_exceeded")
        room = context - len(prompt_ids)
        max_tokens = A.requested_max_tokens(req)
        if max_tokens is None:
            max_tokens = min(default_max_tokens or self.config.default_chat_max_tokens, room)
        if not 1 <= max_tokens <= min(room, self.config.max_tokens_limit):
            raise A.ApiError(400, f"max_tokens must lie in [1, {min(room, self.config.max_tokens_limit)}] "
                                  f"for this prompt of {len(prompt_ids)} tokens", param="max_tokens")
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                                ignore_eos=req.ignore_eos, logprobs=logprobs)
        tenant = request.headers.get(self.config.tenant_header, "") if self.config.tenant_header else ""
        if self.config.api_keys and not tenant:
            tenant = "key:" + request.headers.get("Authorization", "")[7:]
        options = RequestOptions(use_pool=req.kvshare.use_pool, use_local_cache=req.kvshare.use_local_cache,
                                 tenant=tenant)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _Prepared(prompt_ids, params, options, A.stop_strings(req), include_usage)

    async def _respond(self, request: web.Request, req, prep: _Prepared, chat: bool) -> web.StreamResponse:
        t_arrival = time.perf_counter()
        job = Job(prep.prompt_ids, prep.params, prep.options, asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull as exc:
            raise A.ApiError(429, str(exc), code="too_many_requests", error_type="rate_limit_error") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        out = _Output(self, req, prep, chat, rid)
        response = None
        try:
            if req.stream:
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await response.prepare(request)
            async for event in job.stream():
                if out.num_tokens == 0:
                    self.metrics.ttft.observe(time.perf_counter() - t_arrival)
                pieces = out.add(event)
                if response is not None:
                    for chunk in pieces:
                        await response.write(b"data: " + _json.encode(chunk) + b"\n\n")
                if out.finish_reason:
                    break
        except ConnectionResetError:  # the client went away mid-stream: free the engine, nothing to answer
            job.is_cancelled = True
            self.metrics.cancelled.inc()
            return response
        except asyncio.CancelledError:
            job.is_cancelled = True
            self.metrics.cancelled.inc()
            raise
        except Exception as exc:
            job.is_cancelled = True
            log.exception("request %s failed", rid)
            if response is None:
                raise A.ApiError(500, f"the engine failed: {exc}", error_type="server_error") from None
            await response.write(b"data: " + _json.encode(A.ApiError(500, str(exc), error_type="server_error").body()) + b"\n\n")
            return response
        finally:
            job.is_cancelled = True  # whatever happened, the engine need not go on for this request
        self.metrics.e2e.observe(time.perf_counter() - t_arrival)
        self.metrics.requests.labels(out.finish_reason or "abort").inc()
        self.metrics.generation_tokens.inc(out.num_tokens)
        if response is None:
            return web.json_response(out.final_body())
        try:
            for chunk in out.final_chunks():
                await response.write(b"data: " + _json.encode(chunk) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left after the last token: nothing was lost
        return response


class _Output:
    """Accumulates one request's tokens into OpenAI bodies and stream chunks."""

    def __init__(self, server: ReplicaServer, req, prep: _Prepared, chat: bool, rid: str) -> None:
        self.server, self.req, self.prep, self.chat, self.rid = server, req, prep, chat, rid
        tok = server.engine.tokenizer
        self.stream = TextStream(tok.decode, prep.stops)
        self.token_ids: list[int] = []
        self.events: list[Any] = []
        self.provenance = None
        self.finish_reason: str | None = None
        self.created = int(time.time())
        self._sent_role = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, event) -> list[dict]:
        if self.provenance is None:
            self.provenance = event.provenance
            p = event.provenance
            self.server.metrics.observe_provenance(p.local_tokens, p.pool_tokens, p.computed_tokens)
        self.token_ids.append(event.token_id)
        self.events.append(event)
        piece = self.stream.add(event.token_id)
        if self.stream.is_stopped:
            self.finish_reason = "stop"
        elif event.finish_reason:
            self.finish_reason = event.finish_reason
            piece += self.stream.finish()
        if not self.req.stream:
            return []
        chunks = []
        if self.chat and not self._sent_role:
            chunks.append(self._chunk({"role": "assistant", "content": ""}, None))
            self._sent_role = True
        wants_logprobs = self.prep.params.logprobs is not None
        if piece or wants_logprobs:  # no empty chunks: clients time the first content token
            chunks.append(self._chunk(piece, None, self._logprobs([event]) if wants_logprobs else None))
        return chunks

    def _chunk(self, piece, finish_reason, logprobs=None) -> dict:
        if self.chat:
            delta = piece if isinstance(piece, dict) else ({"content": piece} if piece else {})
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.req.model, "choices": [choice]}
        choice = {"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"id": self.rid, "object": "text_completion", "created": self.created, "model": self.req.model,
                "choices": [choice]}

    def _logprobs(self, events):
        tok = self.server.engine.tokenizer
        return chat_logprobs(tok, events) if self.chat else completion_logprobs(tok, events)

    def usage(self) -> dict:
        p = self.provenance
        cached = (p.local_tokens + p.pool_tokens) if p else 0
        n_prompt = len(self.prep.prompt_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": self.num_tokens,
                "total_tokens": n_prompt + self.num_tokens, "prompt_tokens_details": {"cached_tokens": cached}}

    def kvshare(self) -> dict:
        p = self.provenance
        return {"replica": self.server.config.replica_name,
                "local_tokens": p.local_tokens if p else 0, "pool_tokens": p.pool_tokens if p else 0,
                "computed_tokens": p.computed_tokens if p else 0}

    def final_chunks(self) -> list[dict]:
        last = self._chunk("" if not self.chat else {}, self.finish_reason or "stop")
        last["kvshare"] = self.kvshare()
        if self.req.return_token_ids:
            last["choices"][0]["token_ids"] = self.token_ids
        chunks = [last]
        if self.prep.include_usage:
            chunks.append({"id": self.rid, "object": last["object"], "created": self.created, "model": self.req.model,
                           "choices": [], "usage": self.usage(), "kvshare": self.kvshare()})
        return chunks

    def final_body(self) -> dict:
        logprobs = self._logprobs(self.events) if self.prep.params.logprobs is not None else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.stream.text},
                      "logprobs": logprobs, "finish_reason": self.finish_reason or "stop"}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": self.stream.text, "logprobs": logprobs,
                      "finish_reason": self.finish_reason or "stop"}
            obj = "text_completion"
        if self.req.return_token_ids:
            choice["token_ids"] = self.token_ids
            choice["prompt_token_ids"] = self.prep.prompt_ids
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.req.model,
                "choices": [choice], "usage": self.usage(), "kvshare": self.kvshare()}


def _as_dict(stats: Any) -> dict:
    if isinstance(stats, dict):
        return stats
    return {k: v for k, v in vars(stats).items() if isinstance(v, (int, float))}
