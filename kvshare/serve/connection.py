"""The client's connection, as a replica's (and the router's) handlers look at it and write to it."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from kvshare.serve.http_errors import body_too_large


def limit_send_buffer(request: web.Request, num_bytes: int) -> None:
    """Bound the kernel's send buffer of a response's connection.

    Linux grows a TCP send buffer up to net.ipv4.tcp_wmem's maximum (4 MiB by default) while the peer
    does not read, so a stalled client would hold that much before a write ever waits and the write
    timeout could start counting; like Redis's client output buffer limit, a stream gets a fixed bound.
    """
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, num_bytes)


def is_gone(request: web.Request) -> bool:
    """Whether the client's connection is closed. Read from the engine's thread between prefill layers: one
    attribute of the transport, no I/O (the handler itself learns of it only at its next write)."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def read_capped(request: web.Request, limit: int) -> bytes:
    """The request's body; an ApiError 413 (body_too_large) when it is longer than ``limit`` bytes."""
    if request.content_length is not None and request.content_length > limit:
        raise body_too_large(limit)
    body = bytearray()
    while len(body) <= limit:  # one read returns what has arrived so far: read to the end, or past the cap
        piece = await request.content.read(limit + 1 - len(body))
        if not piece:
            return bytes(body)
        body += piece
    raise body_too_large(limit)


class SlowClient(Exception):
    """A streaming client stopped reading: one write did not complete within its timeout."""


async def write_within(request: web.Request, response: web.StreamResponse, data: bytes, timeout_s: float) -> None:
    """One write of a stream; a client that does not take it within ``timeout_s`` is disconnected (SlowClient).

    A write waits only when the connection's buffers are full, i.e. the client stopped reading: without a
    bound such a client would hold its handler (and the router's connection) open for ever.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await response.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise SlowClient() from None
