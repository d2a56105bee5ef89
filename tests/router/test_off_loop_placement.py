"""pool_aware's placement encodes a long text prompt off the router's event loop: the router answers meanwhile."""

from __future__ import annotations

import json
import threading
import urllib.request

from aiohttp import web

from kvshare.router.cost_model import CostModel
from kvshare.serve.off_loop import OFF_LOOP_MIN_CHARS
from tests.router.fake_replica import completion_request, pool_aware_router
from tests.serve.test_off_loop import BlockedEncode

LONG_TEXT = "Where does this prompt go? " * (OFF_LOOP_MIN_CHARS // 27 + 1)


def test_the_router_answers_health_while_a_long_text_is_encoded_for_its_placement(monkeypatch):
    """Fails when the placement encodes the text on the event loop (``route_facts`` calling the placer's
    ``prompt_ids``, as before ``PoolAwarePlacer.encoded``): /health then waits behind the blocked encode and its
    read times out."""

    async def completions(request):
        return web.json_response({"choices": [], "prompt": (await request.json())["prompt"]})

    with pool_aware_router(completions, CostModel()) as (server, router_url):
        tokenizer = server.pool_aware.tokenizer
        blocked = BlockedEncode(tokenizer.encode_missing)
        monkeypatch.setattr(tokenizer, "encode_missing", blocked)
        answers = {}
        req = completion_request(router_url, prompt=LONG_TEXT, max_tokens=1)
        sender = threading.Thread(
            target=lambda: answers.update(long=json.loads(urllib.request.urlopen(req, timeout=60).read()))
        )
        sender.start()
        try:
            assert blocked.entered.wait(60), "the placement never encoded the text"
            with urllib.request.urlopen(router_url + "/health", timeout=30) as resp:
                status = resp.status
            is_still_encoding = not blocked.returned.is_set()
        finally:
            blocked.release.set()
            sender.join(60)
    assert status == 200 and is_still_encoding
    assert answers["long"]["prompt"] == LONG_TEXT  # placed, then relayed unchanged
