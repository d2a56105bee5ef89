"""The router's side towards its clients: the OpenAI API's routes relayed to the replicas, health, drain and
metrics.

A request is read, placed (kvshare.router.dispatch: the policy, pool_aware's placer) and handed to the relay
(kvshare.router.relay), which sends it to the replicas in the placement's order and relays the response.
With API keys set, /v1/, /tokenize and /detokenize need one (``Authorization: Bearer KEY``),
checked before anything is proxied; the header travels on to the replica. /admin/ needs the admin
key (an API key is not enough: a tenant must not drain a replica others use); without an admin key
it is open only where no API key is set either.

Its own errors (no such route, no replica available, a bad key, a body too large) have the
replicas' status, type and code (kvshare.serve.http_errors), so a client sees one API whether
the router or a replica refused. /tokenize and /detokenize go to any healthy replica (the
policy's first choice); /version and /ping are answered here.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvshare.router.accounts import BodyRefused, replica_salt, vllm_body
from kvshare.router.config import RouterConfig
from kvshare.router.dispatch import place
from kvshare.router.facts import route_facts
from kvshare.router.hint_sender import HintSender
from kvshare.router.metrics import RouterMetrics, hint_counter, register_pool_aware
from kvshare.router.policy import ReplicaView, RouteFacts, Router, SessionTable
from kvshare.router.pool_aware import PoolAwarePlacer
from kvshare.router.prefetch_hints import PrefetchHints
from kvshare.router.prompt_ids import placer_tokenizer
from kvshare.router.relay import Relay, ReplicaState, unavailable
from kvshare.router.vllm_usage import ask_for_usage
from kvshare.serve.api_types import ApiError, decode
from kvshare.serve.http_errors import body_too_large, error_response, http_error
from kvshare.serve.server import version
from kvshare.serve.tenancy import Unauthorized, account_identity, check_api_key, tenant_identity


class _DrainRequest(msgspec.Struct, forbid_unknown_fields=True):
    replica: str
    drain: bool = True


class RouterServer:
    """The router: its placement (the policy, pool_aware's placer), its relay to the replicas, its routes."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.replicas = [ReplicaState(url.rstrip("/")) for url in config.replicas]
        self.metrics = RouterMetrics()
        self.pool_aware = _pool_aware_placer(config, self.metrics)
        sessions = SessionTable(config.max_sessions, config.session_ttl_s)
        self.policy = Router(config.policy, len(self.replicas), sessions, pool_aware=self.pool_aware)
        self.relay = Relay(config, self.replicas, self.metrics)
        self.hints = _prefetch_hints(config, self.metrics, self.pool_aware)
        self._health_task: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self._guard])
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        app.router.add_post("/admin/drain", self.drain)
        # every method: the replica answers what is not an endpoint (404, 405), so both answer alike
        for path in ("/v1/{tail:.*}", "/tokenize", "/detokenize"):
            app.router.add_route("*", path, self.proxy)
        app.router.add_get("/version", version)
        app.router.add_route("*", "/ping", self.ping)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    @web.middleware
    async def _guard(self, request: web.Request, handler):
        """Keys before anything else; aiohttp's own errors (404, 405, 413) as OpenAI-style bodies."""
        cfg = self.config
        is_admin = request.path.startswith("/admin/")
        if is_admin and cfg.api_keys and not cfg.admin_key:
            return error_response(
                ApiError(
                    403,
                    "/admin/ needs the router's admin key, and none is set: start it with "
                    "--admin-key-file or $KVSHARE_ADMIN_KEY",
                    code="admin_key_not_set",
                    error_type="permission_error",
                )
            )
        needed = (cfg.admin_key,) if is_admin and cfg.admin_key else cfg.api_keys
        if needed and request.path.startswith(("/v1/", "/admin/", "/tokenize", "/detokenize")):
            try:
                check_api_key(request.headers, needed)
            except Unauthorized as exc:
                return error_response(
                    ApiError(401, str(exc), code="invalid_api_key", error_type="authentication_error")
                )
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except web.HTTPRequestEntityTooLarge:
            return error_response(body_too_large(self.config.max_body_bytes))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return error_response(http_error(request, exc))

    async def _start(self, app) -> None:
        await self.relay.open()
        if self.hints is not None:
            self.hints.sender.start()
        self._health_task = asyncio.create_task(self._health_loop())
        if self.pool_aware is not None:
            self.pool_aware.start()

    async def _stop(self, app) -> None:
        if self._health_task:
            self._health_task.cancel()
        if self.pool_aware is not None:
            self.pool_aware.stop()
        if self.hints is not None:
            await self.hints.close()
        await self.relay.close()

    # -- health ------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self.relay.check(r) for r in self.replicas))
            await asyncio.sleep(self.config.health_interval_s)

    async def health(self, request: web.Request) -> web.Response:
        replicas = [
            {
                "url": r.url,
                "healthy": r.is_healthy,
                "draining": r.is_draining,
                "in_flight": r.num_in_flight,
                "error": r.last_error,
            }
            for r in self.replicas
        ]
        ok = any(r.is_healthy and not r.is_draining for r in self.replicas)
        return web.json_response(
            {
                "status": "ok" if ok else "unavailable",
                "policy": self.config.policy,
                "replicas": replicas,
                "instance_id": self.config.instance_id,
            },
            status=200 if ok else 503,
        )

    async def ping(self, request: web.Request) -> web.Response:
        """GET or POST /ping (vLLM's): 200 with an empty body while some replica can take requests."""
        if not any(r.is_healthy and not r.is_draining for r in self.replicas):
            raise unavailable("no replica is healthy")
        return web.Response(status=200)

    async def metrics_text(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def drain(self, request: web.Request) -> web.Response:
        """POST {"replica": URL, "drain": true|false}: stop (or resume) sending new requests to it."""
        body = decode(await request.read(), _DrainRequest)  # the replicas' decode: their errors and codes
        url, drain = body.replica.rstrip("/"), body.drain
        for replica in self.replicas:
            if replica.url == url:
                replica.is_draining = drain
                return web.json_response({"replica": url, "draining": drain, "in_flight": replica.num_in_flight})
        raise ApiError(404, f"no replica {url}", param="replica", code="not_found")

    # -- proxying ------------------------------------------------------------------------

    def _facts(self, request: web.Request, body: bytes) -> RouteFacts:
        """What the policy reads of this request (kvshare.router.facts); its keys' salt as the replica derives it.
        pool_aware's text prompt is a PromptText until ``PoolAwarePlacer.encoded`` gives its ids."""
        salt_of = lambda cache_salt: replica_salt(self.config.engine, self._salted_tenant(request), cache_salt)
        return route_facts(
            self.config.policy, body, request.headers.get(self.config.session_header), salt_of, self.pool_aware
        )

    def _credentials(self, request: web.Request) -> tuple[str, str]:
        """(API key, tenant header value) of a request, "" where not configured (the guard has checked its key)."""
        cfg = self.config
        header_value = request.headers.get(cfg.tenant_header, "") if cfg.tenant_header else ""
        return check_api_key(request.headers, cfg.api_keys) if cfg.api_keys else "", header_value

    def _tenant(self, request: web.Request) -> str:
        """The request's tenant identity, as the replicas derive it."""
        return tenant_identity(*self._credentials(request))

    def _salted_tenant(self, request: web.Request) -> str | None:
        """The tenant whose salt the replica's keys carry; None: vLLM replicas without tenants (the client's salt)."""
        cfg = self.config
        return None if cfg.engine == "vllm" and not (cfg.api_keys or cfg.tenant_header) else self._tenant(request)

    def _forwarded_body(self, request: web.Request, body: bytes) -> bytes:
        """The body a replica gets: to vLLM replicas, with the account signed and the tenant's cache_salt
        (kvshare.router.accounts, the same headers built-in replicas read); one that cannot carry them: 400."""
        cfg = self.config
        tenant = self._salted_tenant(request) if cfg.engine == "vllm" else None
        if not (cfg.account_key or tenant is not None):
            return body
        try:
            return vllm_body(
                request.method,
                request.path,
                body,
                cfg.account_key,
                account_identity(*self._credentials(request)),
                tenant,
            )
        except BodyRefused as exc:
            raise ApiError(400, str(exc), param=exc.param) from None

    async def proxy(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await request.read()
        facts = self._facts(request, body)
        if self.pool_aware is not None:  # a text prompt's ids: a long encode runs off the loop, the relays go on
            facts = await self.pool_aware.encoded(facts)
        body = self._forwarded_body(request, body)
        # pool_aware measures a vLLM replica by the usage a stream ends with: asked for where the client did not
        is_measured = self.pool_aware is not None and self.config.engine == "vllm"
        usage_body = ask_for_usage(request.method, request.path, body) if is_measured else None
        views = [
            ReplicaView(i, r.is_healthy and not r.is_draining, r.num_in_flight) for i, r in enumerate(self.replicas)
        ]
        is_draining = [r.is_draining for r in self.replicas]
        dispatch = place(self.policy, facts, views, time.monotonic(), is_draining, usage_body is not None)
        if self.hints is not None:  # each replica it is sent to is told first (kvshare.router.prefetch_hints)
            known = facts.prompt_ids if self.pool_aware is not None else None
            dispatch = replace(dispatch, announce=self.hints.announcer(request.method, request.path, body, known))
        self.metrics.send_delay.observe(time.perf_counter() - arrived)
        return await self.relay.send(request, usage_body or body, dispatch)


def _prefetch_hints(
    config: RouterConfig, metrics: RouterMetrics, placer: PoolAwarePlacer | None
) -> PrefetchHints | None:
    """The prefetch hints to the vLLM replicas with a hint address; their text prompts encoded by pool_aware's
    tokenizer, else by the one of ``--model`` (none: only prompts of token ids are hinted)."""
    if not any(config.hint_addresses):
        return None
    sender = HintSender([a or None for a in config.hint_addresses], config.account_key, hint_counter(metrics.registry))
    if placer is not None:
        tokenizer = placer.tokenizer
    else:
        tokenizer = placer_tokenizer(config.model) if config.model else None
    return PrefetchHints(sender, tokenizer)


def _pool_aware_placer(config: RouterConfig, metrics: RouterMetrics) -> PoolAwarePlacer | None:
    """The pool_aware policy's placer (its feeds started with the app), its metrics in ``metrics``; None for the
    other policies."""
    if config.policy != "pool_aware":
        return None
    is_batching = config.engine == "vllm"  # vLLM replicas batch: a replica's queue is the prefill ahead
    placer = PoolAwarePlacer.from_config(config.pool_aware, len(config.replicas), config.replicas, is_batching)
    register_pool_aware(metrics.registry, placer)
    return placer
