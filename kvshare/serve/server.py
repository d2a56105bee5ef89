"""The replica's HTTP server: OpenAI completions and chat (streaming or not), models, health, metrics.

Routes, the engine queue and stream writes live here; a request is checked and made the engine's by
``engine_request``, the response bodies and stream chunks are assembled by ``responses.ResponseBuilder``. The
routes ``vllm serve`` adds (/tokenize, /detokenize, /version, /ping) answer in vLLM's shapes, so its tools work
unchanged; the served names follow vLLM's rule (``models.ServedModels``). The engine runs one request at a time
(``worker.EngineWorker``): the others wait in its queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import kvshare
from kvshare.keys import namespace_digest
from kvshare.serve import api_types as A
from kvshare.serve import tokenize as T
from kvshare.serve.audit import Auditor
from kvshare.serve.config import ServeConfig
from kvshare.serve.connection import SlowClient, is_gone, limit_send_buffer, read_capped, write_within
from kvshare.serve.engine_request import Prepared, checked_max_tokens, checked_prompt_ids, sampling_params
from kvshare.serve.http_errors import body_too_large, engine_error, error_response, http_error
from kvshare.serve.metrics import ReplicaMetrics
from kvshare.serve.models import ServedModels
from kvshare.serve.off_loop import off_loop
from kvshare.serve.readiness import Readiness
from kvshare.serve.responses import ResponseBuilder, is_provenance_shown
from kvshare.serve.tenancy import Unauthorized, account_identity, check_api_key, namespace_salt, tenant_identity
from kvshare.serve.warm_path import warm_request_path
from kvshare.serve.worker import EngineWorker, QueueFull, WorkerRequest

log = logging.getLogger("kvshare.serve")
_json = msgspec.json.Encoder()


class ReplicaServer:
    """Builds the aiohttp application around an engine; ``main`` runs it."""

    def __init__(self, engine: Any, config: ServeConfig, warm_up: Callable[[Any], Any] | None = None) -> None:
        """``warm_up(engine)``: the warm-up run with config.warmup (default kvshare.engine.warmup.warm_up)."""
        self.engine = engine
        self.config = config
        self.readiness = Readiness(config.warmup)
        if config.warmup and warm_up is None:
            from kvshare.engine.warmup import warm_up
        self.metrics = ReplicaMetrics(
            lambda: _as_dict(engine.stats()), (config.served_model_names or (engine.config.model,))[0]
        )
        # audit hook: sampled reused requests are recomputed cold by the worker while no request waits
        self.auditor = (
            Auditor(engine, config.audit, self.metrics.registry, is_busy=lambda: self.worker.num_waiting > 0)
            if config.audit.rate > 0
            else None
        )
        self.worker = EngineWorker(
            engine,
            config.max_requests,
            idle_task=self.auditor.run_one if self.auditor else None,
            first_task=(lambda: self.readiness.run_warmup(lambda e: self._warm_up(warm_up, e), engine))
            if config.warmup
            else None,
        )
        self.metrics.max_running.set(self.worker.max_running)
        self.started_at = time.time()
        self.served = ServedModels(
            config.served_model_names or (engine.config.model,),
            root=engine.config.model,
            max_model_len=engine.max_model_len,
            created=int(self.started_at),
        )

    def _warm_up(self, warm_up: Callable[[Any], Any], engine: Any):
        """The engine's warm-up, then this server's own request path (its report gains "request_path")."""
        report = warm_up(engine)
        started = time.perf_counter()
        warm_request_path(
            self.engine, self.served.names[0], self.config.replica_name, self.config.max_prompt_tokens or None
        )
        if hasattr(report, "step_seconds"):
            report.step_seconds["request_path"] = time.perf_counter() - started
        return report

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{name:.+}", self.model)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", version)
        app.router.add_route("*", "/ping", self.ping)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_get("/admin/namespace", self.namespace)
        app.on_startup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, self.worker.start))
        app.on_cleanup.append(lambda _: asyncio.get_running_loop().run_in_executor(None, self.worker.stop))
        return app

    # -- middleware and small endpoints ------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            if self.config.api_keys and request.path.startswith(("/v1/", "/admin/", "/tokenize", "/detokenize")):
                self._authenticate(request)
            return await handler(request)
        except A.ApiError as exc:
            self.metrics.errors.labels(str(exc.status)).inc()
            return error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            self.metrics.errors.labels("413").inc()
            return error_response(body_too_large(self.config.max_body_bytes))
        except web.HTTPException as exc:  # 404/405 of aiohttp's routing
            if exc.status < 400:
                raise
            return error_response(http_error(request, exc))

    def _authenticate(self, request: web.Request) -> None:
        try:
            check_api_key(request.headers, self.config.api_keys)
        except Unauthorized as exc:
            raise A.ApiError(401, str(exc), code="invalid_api_key", error_type="authentication_error") from None

    def _identities(self, request: web.Request, header_value: str | None = None) -> tuple[str, str]:
        """(tenant identity, account) of a request (kvshare.serve.tenancy); the middleware has checked its key."""
        if header_value is None:
            header_value = request.headers.get(self.config.tenant_header, "") if self.config.tenant_header else ""
        api_key = check_api_key(request.headers, self.config.api_keys) if self.config.api_keys else ""
        return tenant_identity(api_key, header_value), account_identity(api_key, header_value)

    async def namespace(self, request: web.Request) -> web.Response:
        """GET /admin/namespace[?tenant=VALUE]: the pool namespace digest of this request's tenant.

        ``tenant`` stands for the tenant header's value; with API keys the key of the request decides the
        rest, so a caller learns only namespaces of its own key. Flush one with
        ``kvshare pool-admin flush --namespace HEX`` (or ``--replica URL --tenant VALUE``).
        """
        header_value = request.query.get("tenant")
        if header_value is not None and not self.config.tenant_header:
            raise A.ApiError(
                400,
                "this replica takes no tenant header (--tenant-header); its tenants come from API keys only",
                param="tenant",
            )
        tenant, _ = self._identities(request, header_value)
        digest = namespace_digest(self.engine.namespace.with_tenant(tenant))
        return web.json_response(
            {
                "model": self.engine.model_name,
                "replica": self.config.replica_name,
                "is_tenant_salted": bool(tenant),
                "namespace": digest.hex(),
                "grid_tokens": self.engine.namespace.grid_tokens,
            }
        )

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(self.served.listing())

    async def model(self, request: web.Request) -> web.Response:
        """GET /v1/models/{name}: one served name's card (a path served as its name keeps its slashes)."""
        return web.json_response(self.served.card(request.match_info["name"]))

    # a tokenizer call's work is linear in its body: capped, and run off the loop so that no stream waits for it
    async def tokenize(self, request: web.Request) -> web.Response:
        req = A.decode(await read_capped(request, self.config.max_tokenize_bytes), T.TokenizeRequest)
        self.served.resolve(req.model)
        return web.json_response(await off_loop(T.tokenize, req, self.engine.tokenizer, self.engine.max_model_len))

    async def detokenize(self, request: web.Request) -> web.Response:
        req = A.decode(await read_capped(request, self.config.max_tokenize_bytes), T.DetokenizeRequest)
        self.served.resolve(req.model)
        vocab = self.engine.model_config.vocab_size
        return web.json_response(await off_loop(T.detokenize, req, self.engine.tokenizer, vocab))

    async def ping(self, request: web.Request) -> web.Response:
        """GET or POST /ping: vLLM's (SageMaker's) liveness check, 200 with an empty body."""
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        """200 while the replica can serve: a pool it cannot reach makes requests cold, not failed ("pool").

        503 before the warm-up has run ("warming up") and after it failed ("warm-up failed")."""
        stats = _as_dict(self.engine.stats())
        pool = (
            "connected"
            if stats.get("is_pool_connected")
            else "unreachable"
            if stats.get("is_pool_configured")
            else "off"
        )
        ready = self.readiness
        return web.json_response(
            {
                "status": ready.status,
                "replica": self.config.replica_name,
                "waiting": self.worker.num_waiting,
                "running": self.worker.num_running,
                "pool": pool,
                "instance_id": self.config.instance_id,
                **ready.health_fields(),
            },
            status=200 if ready.is_ready else 503,
        )

    async def metrics_text(self, request: web.Request) -> web.Response:
        self.metrics.waiting.set(self.worker.num_waiting)
        self.metrics.running.set(self.worker.num_running)
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- generation ----------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        body = await request.read()
        read_s, req = time.perf_counter(), A.decode_completion(body)
        A.validate(req)
        prompt_ids = A.prompt_of(req)
        if isinstance(prompt_ids, str):  # a long text's encode runs off the loop: the other streams go on meanwhile
            prompt_ids = await T.prompt_array(self.engine.tokenizer, prompt_ids)
        prepared = self._prepare(
            request, req, prompt_ids, default_max_tokens=16, logprobs=req.logprobs, arrival=(arrival, read_s)
        )
        return await self._respond(request, req, prepared, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        body = await request.read()
        read_s, req = time.perf_counter(), A.decode(body, A.ChatRequest)
        A.validate(req)
        text = T.chat_prompt_text(self.engine.tokenizer, req.messages)  # rendering: ~0.3 ms at 128k tokens
        prompt_ids = await T.prompt_array(self.engine.tokenizer, text)
        top = (req.top_logprobs or 0) if req.logprobs else None
        prepared = self._prepare(
            request, req, prompt_ids, default_max_tokens=None, logprobs=top, arrival=(arrival, read_s)
        )
        return await self._respond(request, req, prepared, chat=True)

    def _prepare(
        self, request, req, prompt_ids, default_max_tokens: int | None, logprobs, arrival: tuple[float, float]
    ) -> Prepared:
        """The request checked and ready for the engine; ``arrival``: (handler start, body read) clock() values."""
        from kvshare.engine.engine import RequestOptions
        from kvshare.engine.timeline import Timeline

        req.model = self.served.resolve(req.model)  # responses name the first served name, as vLLM's do
        vocab = self.engine.model_config.vocab_size
        ids = checked_prompt_ids(prompt_ids, vocab)
        max_tokens = checked_max_tokens(
            A.requested_max_tokens(req),
            len(prompt_ids),
            "messages" if default_max_tokens is None else "prompt",
            default_max_tokens or self.config.default_chat_max_tokens,
            context=self.engine.max_model_len,
            max_prompt_tokens=self.config.max_prompt_tokens,
            max_tokens_limit=self.config.max_tokens_limit,
        )
        params = sampling_params(req, max_tokens, logprobs, vocab)
        timeline = Timeline(arrival[0]) if req.kvshare.timeline else None
        tenant, account = self._identities(request)
        options = RequestOptions(
            use_pool=req.kvshare.use_pool,
            use_local_cache=req.kvshare.use_local_cache,
            tenant=namespace_salt(tenant, req.cache_salt),
            account=account,
            timeline=timeline,
        )
        if timeline is not None:
            timeline.mark("body_read", arrival[1])
            timeline.mark("parse")  # decoded, checked and tokenized
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        is_usage_continuous = include_usage and req.stream_options.continuous_usage_stats  # vLLM's rule
        return Prepared(prompt_ids, params, options, A.stop_strings(req), include_usage, ids, is_usage_continuous)

    async def _respond(self, request: web.Request, req, prep: Prepared, chat: bool) -> web.StreamResponse:
        t_arrival = time.perf_counter()  # the metrics time from here (a timeline from the handler's start)
        job = self._submit(request, req, prep)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        out = ResponseBuilder(
            req,
            prep,
            chat,
            rid,
            self.engine.tokenizer,
            self.config.replica_name,
            is_provenance_shown=is_provenance_shown(self.config.provenance, prep.options.tenant),
        )
        response = None
        try:
            if req.stream:
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                limit_send_buffer(request, self.config.stream_buffer_bytes)
                await response.prepare(request)
            await self._relay(request, response, job, out, prep, t_arrival)
        except (ConnectionResetError, SlowClient):  # the client went away or stopped reading: free the engine
            job.is_cancelled = True
            self.metrics.cancelled.inc()
            # a handler ends with a response; 499 (client closed request) is never sent to a client that left
            return response if response is not None else web.Response(status=499)
        except asyncio.CancelledError:
            job.is_cancelled = True
            self.metrics.cancelled.inc()
            raise
        except Exception as exc:
            job.is_cancelled = True
            error = engine_error(exc)
            if error.status == 500:
                log.exception("request %s failed", rid)
            if response is None:
                raise error from None
            await response.write(b"data: " + _json.encode(error.body()) + b"\n\n")
            return response
        finally:
            job.is_cancelled = True  # whatever happened, the engine need not go on for this request
            job.first_written.set()
        self._record(rid, prep, out, t_arrival)
        if response is None:
            return web.json_response(out.final_body())
        try:
            for chunk in out.final_chunks():
                await self._write(request, response, b"data: " + _json.encode(chunk) + b"\n\n")
            await self._write(request, response, b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionResetError, SlowClient):
            pass  # the client left (or stalled) after the last token: nothing was lost
        return response

    def _submit(self, request: web.Request, req, prep: Prepared) -> WorkerRequest:
        """The request queued for the engine (A.ApiError 429 when the queue is full)."""
        ids = prep.prompt_array if prep.prompt_array is not None else prep.prompt_ids
        job = WorkerRequest(
            ids, prep.params, prep.options, asyncio.get_running_loop(), client_gone=lambda: is_gone(request)
        )
        if not req.stream:  # nothing is written before the end: the engine need not wait after the first token
            job.first_written.set()
        try:
            self.worker.submit(job)
        except QueueFull as exc:
            raise A.ApiError(429, str(exc), code="too_many_requests", error_type="rate_limit_error") from None
        return job

    async def _relay(
        self,
        request: web.Request,
        response: web.StreamResponse | None,
        job: WorkerRequest,
        out: ResponseBuilder,
        prep: Prepared,
        t_arrival: float,
    ) -> None:
        """The engine's tokens into ``out`` until the finish, each written at once to a stream (``response``); the
        first token's time to first token, queue time and provenance go to the metrics."""
        async for event in job.stream():
            if out.num_tokens == 0:
                self.metrics.ttft.observe(time.perf_counter() - t_arrival)
                self.metrics.queue_time.observe(job.started_s - t_arrival)
                p = event.provenance  # the same object in every event of a request
                self.metrics.observe_provenance(p.local_tokens, p.pool_tokens, p.computed_tokens)
            pieces = out.add(event)
            if response is not None:
                for chunk in pieces:
                    await self._write(request, response, b"data: " + _json.encode(chunk) + b"\n\n")
                if prep.options.timeline is not None and out.num_tokens == 1:
                    prep.options.timeline.mark("first_token_written")
            job.first_written.set()  # the engine may go on (it waits for this after the first token)
            if out.finish_reason:
                break

    def _record(self, rid: str, prep: Prepared, out: ResponseBuilder, t_arrival: float) -> None:
        """A request that ran to its end (or its abort): the metrics, the audit's offer, the timeline's log line."""
        self.metrics.e2e.observe(time.perf_counter() - t_arrival)
        self.metrics.requests.labels(out.finish_reason or "abort").inc()
        self.metrics.generation_tokens.inc(out.num_tokens)
        if self.auditor is not None and out.finish_reason:  # audit hook: offer the finished request
            self.auditor.offer(
                prep.prompt_ids,
                prep.params,
                replace(prep.options, timeline=None),
                out.provenance,
                out.token_ids,
                out.events,
            )
        if prep.options.timeline is not None:
            log.info("timeline %s %s", rid, _json.encode(prep.options.timeline.as_dict()).decode())

    async def _write(self, request: web.Request, response: web.StreamResponse, data: bytes) -> None:
        """One write of a stream (kvshare.serve.connection.write_within): a client that stalls is counted, dropped."""
        try:
            await write_within(request, response, data, self.config.write_timeout_s)
        except SlowClient:
            self.metrics.slow_clients.inc()
            log.warning("a client did not read for %.1f s; dropping its stream", self.config.write_timeout_s)
            raise


async def version(request: web.Request) -> web.Response:
    """GET /version, as vLLM's (which gives vLLM's version): kvshare's."""
    return web.json_response({"version": kvshare.__version__})


def _as_dict(stats: Any) -> dict:
    if isinstance(stats, dict):
        return stats
    return {k: v for k, v in vars(stats).items() if isinstance(v, (int, float))}
