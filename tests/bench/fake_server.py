"""A tiny fake OpenAI server (aiohttp) for the client tests: scripted stream chunks and delays."""

from __future__ import annotations

import asyncio
import json

from aiohttp import web

SEEN = web.AppKey("seen", list)


def fake_app(first_token_delay_s: float = 0.05, status: int = 200) -> web.Application:
    """Streams a role chunk (chat), an empty piece, a token without text, two pieces of text, a final chunk, usage."""
    seen: list[dict] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"path": request.path, "body": body, "session": request.headers.get("X-Session-ID")})
        if status != 200:
            return web.json_response(
                {"error": {"message": "bad request", "type": "invalid_request_error"}}, status=status
            )
        chat = request.path.endswith("chat/completions")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "X-KVShare-Replica": "http://fake"})
        await resp.prepare(request)

        async def send(choice: dict, **extra) -> None:
            chunk = {"id": "x", "object": "chunk", "choices": [choice] if choice else [], **extra}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\r\n\r\n")  # CRLF: clients must cope

        def piece(text: str, finish=None, **more) -> dict:
            base = {"index": 0, "finish_reason": finish, **more}
            return {**base, "delta": {"content": text} if text else {}} if chat else {**base, "text": text}

        await asyncio.sleep(first_token_delay_s)
        if chat:
            await send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        await send(piece(""))  # no token: must not count as the first token
        await asyncio.sleep(0.02)
        # a token that decodes to no text, seen only through its logprobs entry
        if chat:
            logprobs = {
                "content": [
                    {
                        "token": "",
                        "logprob": -1.0,
                        "top_logprobs": [{"token": "", "logprob": -1.0}, {"token": "x", "logprob": -1.5}],
                    }
                ]
            }
        else:
            logprobs = {"tokens": [""], "token_logprobs": [-1.0], "top_logprobs": [{"": -1.0, "x": -1.5}]}
        await send(piece("", logprobs=logprobs))
        await asyncio.sleep(0.02)
        await send(piece("Hel"))
        await send(piece("lo"))
        provenance = {"replica": "fake0", "local_tokens": 0, "pool_tokens": 256, "computed_tokens": 44}
        await send(piece("", "length", token_ids=[1, 2, 3]), kvshare=provenance)
        await send(
            {},
            usage={"prompt_tokens": 300, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 256}},
            kvshare=provenance,
        )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/v1/models", models)
    app[SEEN] = seen
    return app
