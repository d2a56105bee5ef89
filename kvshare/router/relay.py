"""The router's side towards its replicas: a placed request sent to them in order, its response relayed as it
arrives, and their health checks.

Bytes of a response are passed on as they arrive (no buffering of streams). A request whose replica cannot be
reached before the first byte of its response goes to the next replica the policy ranked; after the first byte it
cannot move. A client that leaves closes the request to the replica, before the replica's headers (a response
that is not a stream sends them with its end) as after them: the replica then gives it up at its next layer or
token, as for a client of its own. The relay owns the HTTP client to the replicas and keeps each replica's
health and requests in flight (``ReplicaState``); the server reads them for /health and placement, and sets a
replica draining.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web

from kvshare.router.config import RouterConfig
from kvshare.router.dispatch import Dispatch
from kvshare.router.metrics import RouterMetrics
from kvshare.serve.api_types import ApiError
from kvshare.serve.connection import SlowClient, is_gone, limit_send_buffer, write_within

log = logging.getLogger("kvshare.router")
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}
CLIENT_POLL_S = 0.1  # while a request is at a replica: how often the client's connection is looked at


@dataclass
class ReplicaState:
    url: str
    is_healthy: bool = True
    is_draining: bool = False
    num_in_flight: int = 0
    last_error: str = ""


class Relay:
    """Sends placed requests to ``replicas`` and relays their responses; checks the replicas' health."""

    def __init__(self, config: RouterConfig, replicas: list[ReplicaState], metrics: RouterMetrics) -> None:
        self.config = config
        self.replicas = replicas
        self.metrics = metrics
        self.http: aiohttp.ClientSession | None = None  # the connections to the replicas, from ``open`` on

    async def open(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
        self.http = aiohttp.ClientSession(timeout=timeout, auto_decompress=False)

    async def close(self) -> None:
        if self.http:
            await self.http.close()

    async def check(self, replica: ReplicaState) -> None:
        """A health check: healthy while GET /health answers 200 within 2 s."""
        try:
            async with self.http.get(replica.url + "/health", timeout=aiohttp.ClientTimeout(total=2)) as resp:
                replica.is_healthy = resp.status == 200
                replica.last_error = "" if replica.is_healthy else f"health answered {resp.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            replica.is_healthy = False
            replica.last_error = f"{type(exc).__name__}: {exc}"
        self.metrics.healthy.labels(replica.url).set(1 if replica.is_healthy else 0)

    async def send(self, request: web.Request, body: bytes, dispatch: Dispatch) -> web.StreamResponse:
        """The response of the first replica in ``dispatch``'s order that can be reached (503 where none can)."""
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        t0 = time.perf_counter()
        last_error = "no replica is available"
        for i in dispatch.order:
            replica = self.replicas[i]
            replica.num_in_flight += 1
            sent = dispatch.send_to(i, time.monotonic())
            try:
                upstream = await _unless_client_gone(
                    request,
                    self.http.request(
                        request.method, replica.url + request.path_qs, data=body or None, headers=headers
                    ),
                )
            except ClientGone:  # the request was closed towards the replica, which gives it up at once
                replica.num_in_flight -= 1
                sent.end()
                return web.Response(status=499)  # never sent: the client's connection is closed
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                replica.num_in_flight -= 1
                sent.end()
                last_error = self._unreachable(replica, exc)
                continue
            try:
                self.metrics.requests.labels(replica.url).inc()
                return await self._relay(request, upstream, replica, sent.timing(upstream))
            finally:
                upstream.release()
                replica.num_in_flight -= 1
                sent.end()
                self.metrics.latency.observe(time.perf_counter() - t0)
        self.metrics.errors.inc()
        raise unavailable(f"no replica could take the request: {last_error}")

    def _unreachable(self, replica: ReplicaState, exc: BaseException) -> str:
        """A replica that could not be reached before the first byte: unhealthy until its next check; the error."""
        replica.is_healthy = False
        replica.last_error = error = f"{type(exc).__name__}: {exc}"
        self.metrics.failovers.inc()
        log.warning("replica %s unreachable (%s); trying the next", replica.url, error)
        return error

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, replica: ReplicaState, timing=None):
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
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


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, error_type="server_error", code="no_replica_available")
