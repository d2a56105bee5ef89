"""The router's HTTP side: a streaming reverse proxy with health checks and failover.

Bytes of a response are passed on as they arrive (no buffering of streams). A
request whose replica cannot be reached before the first byte of its response
goes to the next replica the policy ranked; after the first byte it cannot move.
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
import logging
import time
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvshare.router.accounts import BodyRefused, replica_salt, vllm_body
from kvshare.router.config import RouterConfig
from kvshare.router.event_feed import attach_pool_aware
from kvshare.router.facts import route_facts
from kvshare.router.policy import ReplicaView, RouteFacts, Router
from kvshare.router.vllm_usage import ask_for_usage
from kvshare.serve.api_types import ApiError, decode
from kvshare.serve.connection import SlowClient, is_gone, limit_send_buffer, write_within
from kvshare.serve.http_errors import body_too_large, error_response, http_error
from kvshare.serve.metrics import LATENCY_BUCKETS
from kvshare.serve.server import version
from kvshare.serve.tenancy import Unauthorized, account_identity, check_api_key, tenant_identity

log = logging.getLogger("kvshare.router")
_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}
CLIENT_POLL_S = 0.1  # while a response is relayed: how often the client's connection is looked at
SEND_DELAY_BUCKETS = tuple(1e-4 * 2**k for k in range(14))  # seconds: 0.1 ms .. 0.82 s, each twice the last


@dataclass
class ReplicaState:
    url: str
    is_healthy: bool = True
    is_draining: bool = False
    num_in_flight: int = 0
    last_error: str = ""


class _Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvshare_router_requests", "Requests routed", ["replica"], registry=r)
        self.failovers = Counter(
            "kvshare_router_failovers", "Requests moved to another replica before the first byte", registry=r
        )
        self.errors = Counter("kvshare_router_errors", "Requests no replica could take", registry=r)
        self.latency = Histogram(
            "kvshare_router_request_latency_seconds",
            "Time to the end of the response",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.send_delay = Histogram(  # the router's own time in a request's TTFT (its relay of the first byte aside)
            "kvshare_router_send_delay_seconds",
            "From a request's arrival to its sending to a replica: its body read, placed and signed",
            buckets=SEND_DELAY_BUCKETS,
            registry=r,
        )
        self.broken_responses = Counter(
            "kvshare_router_broken_responses",
            "Responses a replica broke off after the first byte (streams end with an error event)",
            ["replica"],
            registry=r,
        )
        self.healthy = Gauge(
            "kvshare_router_replica_healthy", "1 if the replica answered its last health check", ["replica"], registry=r
        )


class _DrainRequest(msgspec.Struct, forbid_unknown_fields=True):
    replica: str
    drain: bool = True


class RouterServer:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.replicas = [ReplicaState(url.rstrip("/")) for url in config.replicas]
        self.policy = Router(config.policy, len(self.replicas))
        self.policy.sessions.ttl_s = config.session_ttl_s
        self.policy.sessions.max_sessions = config.max_sessions
        self.metrics = _Metrics()
        self.pool_aware = (
            attach_pool_aware(
                self.policy, config.pool_aware, self.metrics.registry, config.replicas, config.engine == "vllm"
            )
            if config.policy == "pool_aware"
            else None
        )
        self._session: aiohttp.ClientSession | None = None
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
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)
        self._health_task = asyncio.create_task(self._health_loop())
        if self.pool_aware is not None:
            self.pool_aware.start()

    async def _stop(self, app) -> None:
        if self._health_task:
            self._health_task.cancel()
        if self.pool_aware is not None:
            self.pool_aware.stop()
        if self._session:
            await self._session.close()

    # -- health ------------------------------------------------------------------------

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(r) for r in self.replicas))
            await asyncio.sleep(self.config.health_interval_s)

    async def _check(self, replica: ReplicaState) -> None:
        try:
            async with self._session.get(replica.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                replica.is_healthy = resp.status == 200
                replica.last_error = "" if replica.is_healthy else f"health answered {resp.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            replica.is_healthy = False
            replica.last_error = f"{type(exc).__name__}: {exc}"
        self.metrics.healthy.labels(replica.url).set(1 if replica.is_healthy else 0)

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
            raise _unavailable("no replica is healthy")
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
        body = usage_body or body
        views = [
            ReplicaView(i, r.is_healthy and not r.is_draining, r.num_in_flight) for i, r in enumerate(self.replicas)
        ]
        order = self.policy.choose(facts, views, time.monotonic())
        order = [i for i in order if not self.replicas[i].is_draining]
        placer = self.pool_aware
        placement = placer.last_placement if placer is not None else None  # this request's, before any await
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        t0 = time.perf_counter()
        last_error = "no replica is available"
        self.metrics.send_delay.observe(time.perf_counter() - arrived)
        for i in order:
            replica = self.replicas[i]
            replica.num_in_flight += 1
            sent_s = time.monotonic()
            job = None if placement is None else placer.begin(i, placement, sent_s, facts.is_stream)  # in T_r now
            try:
                upstream = await _unless_client_gone(
                    request,
                    self._session.request(
                        request.method, replica.url + request.path_qs, data=body or None, headers=headers
                    ),
                )
            except ClientGone:  # the request was closed towards the replica, which gives it up at once
                replica.num_in_flight -= 1
                if job is not None:
                    placer.backlog.finish(job)
                return web.Response(status=499)  # never sent: the client's connection is closed
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                replica.num_in_flight -= 1
                if job is not None:
                    placer.backlog.finish(job)
                replica.is_healthy = False
                replica.last_error = last_error = f"{type(exc).__name__}: {exc}"
                self.metrics.failovers.inc()
                log.warning("replica %s unreachable (%s); trying the next", replica.url, last_error)
                continue
            try:
                self.metrics.requests.labels(replica.url).inc()
                is_asked = usage_body is not None
                timing = None if placer is None else placer.timing(i, sent_s, upstream, placement, is_asked)
                if timing is not None and job is not None:
                    timing.on_first_byte = lambda job=job: placer.backlog.started(job)
                    timing.is_prefill_shared = lambda job=job: job.is_shared
                return await self._relay(request, upstream, replica, timing)
            finally:
                upstream.release()
                replica.num_in_flight -= 1
                if job is not None:
                    placer.backlog.finish(job)
                self.metrics.latency.observe(time.perf_counter() - t0)
        self.metrics.errors.inc()
        raise _unavailable(f"no replica could take the request: {last_error}")

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, replica: ReplicaState, timing=None):
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}
        if self.config.expose_replica_header:  # off by default: it would tell any client where a prefix lives
            headers["X-KVShare-Replica"] = replica.url
        response = web.StreamResponse(status=upstream.status, headers=headers)
        limit_send_buffer(request, self.config.stream_buffer_bytes)
        try:
            await response.prepare(request)
        except ConnectionResetError:  # the client left as the replica's headers came
            return response
        # a client that leaves while the replica computes (a long prefill sends nothing) closes the replica's
        # connection too, which lets the replica give the request up at its next layer
        watch = asyncio.create_task(_close_when_gone(request, upstream))
        try:
            async for piece in upstream.content.iter_any() if timing is None else timing.pieces(upstream):
                try:
                    await write_within(request, response, piece, self.config.write_timeout_s)
                except SlowClient:  # the client stopped reading; let go of it and of the replica
                    log.warning("a client did not read for %.1f s; dropping its response", self.config.write_timeout_s)
                    return response
                except ConnectionResetError:  # the client left: nothing to say about the replica
                    return response
        except (TimeoutError, aiohttp.ClientError) as exc:
            if is_gone(request):  # the watch closed the replica's connection for a client that left
                return response
            log.warning("replica %s broke off a response: %s", replica.url, exc)
            replica.is_healthy = False
            replica.last_error = f"broke off a response: {type(exc).__name__}: {exc}"
            self.metrics.broken_responses.labels(replica.url).inc()
            await _end_broken_response(request, response, upstream, replica.url)
            return response
        finally:
            watch.cancel()
        try:
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client left after the last piece
        return response


class ClientGone(Exception):
    """The client's connection closed before the replica's response began."""


async def _unless_client_gone(request: web.Request, sending):
    """The replica's response (``sending``: the request to it, awaiting its headers); ClientGone once the client's
    connection closes first. A response that is not a stream sends its headers with its end, so this is where
    the router waits through the replica's whole work: the request is then cancelled, which closes its
    connection, and the replica gives it up at its next layer or token as for a client of its own."""
    task = asyncio.ensure_future(sending)
    try:
        while not task.done():
            await asyncio.wait((task,), timeout=CLIENT_POLL_S)
            if not task.done() and is_gone(request):
                task.cancel()
                await asyncio.wait((task,))
                if not task.cancelled() and task.exception() is None:
                    task.result().close()  # its headers came as it was cancelled
                raise ClientGone()
        return task.result()
    finally:
        task.cancel()  # no-op once done; else (this handler cancelled) the request is closed too


async def _close_when_gone(request: web.Request, upstream: aiohttp.ClientResponse) -> None:
    while not is_gone(request):
        await asyncio.sleep(CLIENT_POLL_S)
    upstream.close()


async def _end_broken_response(
    request: web.Request, response: web.StreamResponse, upstream: aiohttp.ClientResponse, url: str
) -> None:
    """A replica died mid-response: a stream ends with an OpenAI error event and no ``[DONE]``, so no client
    takes the cut-off text for a whole answer; any other body is cut off (the connection is reset)."""
    if upstream.content_type == "text/event-stream":
        error = ApiError(
            502,
            f"replica {url} failed during the response; the output is incomplete",
            error_type="server_error",
            code="replica_failed",
        )
        try:
            await response.write(b"data: " + msgspec.json.encode(error.body()) + b"\n\n")
            await response.write_eof()
            return
        except ConnectionResetError:
            return
    if request.transport is not None:
        request.transport.abort()


def _unavailable(message: str) -> ApiError:
    return ApiError(503, message, error_type="server_error", code="no_replica_available")
