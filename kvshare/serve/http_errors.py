"""OpenAI error bodies for what aiohttp answers itself (404, 405, 413), shared by replicas and the router.

Both servers answer every error as ``{"error": {"message", "type", "param", "code"}}`` with the same
status, type and code, so a client cannot tell (and need not care) which of them refused a request.
"""

from __future__ import annotations

from aiohttp import web

from kvshare.errors import RequestCancelled
from kvshare.serve.api_types import ApiError


def error_response(err: ApiError) -> web.Response:
    """An OpenAI error body; the router answers its own errors with this too, so both look alike."""
    return web.json_response(err.body(), status=err.status)


def body_too_large(max_body_bytes: int) -> ApiError:
    return ApiError(413, f"request body exceeds {max_body_bytes} bytes", code="body_too_large")


def http_error(request: web.Request, exc: web.HTTPException) -> ApiError:
    """aiohttp's routing errors (404, 405) as OpenAI errors, naming the method and path."""
    if exc.status == 404:
        return ApiError(404, f"{request.method} {request.path}: no such endpoint", code="not_found")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return ApiError(
            405, f"{request.method} {request.path}: method not allowed (allowed: {allowed})", code="method_not_allowed"
        )
    return ApiError(exc.status, exc.reason)


def engine_error(exc: Exception) -> ApiError:
    """What a request whose engine run raised ``exc`` is answered: 503 when the replica gave it up as it
    stopped (a client that left reads nothing), else 500 naming the failure."""
    if isinstance(exc, RequestCancelled):
        return ApiError(503, str(exc), error_type="server_error")
    return ApiError(500, f"the engine failed: {exc}", error_type="server_error")
