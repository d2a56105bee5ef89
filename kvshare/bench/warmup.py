"""Warm a replica before it is measured: its first requests pay one-time costs (CUDA context,
kernel loading, library handles, the first pool transfer) that no measured request should carry.

Two small requests with a random prompt (unique, so it warms no measured prefix):
1. computed from scratch, which also stores its chunks in the pool;
2. the same prompt with the local cache off, so its prefix is loaded from the pool.
Shape-specific first-use costs (e.g. attention plans for a new sequence length) remain;
they fall on the first measured request of each shape.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request

WARMUP_TOKENS = 1100  # four full 256-token chunks and a tail: store and load both run
BYTE_IDS = 256  # ids below this exist in every vocabulary the harness meets


def _post(url: str, body: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def _model(url: str, timeout_s: float) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=timeout_s) as resp:
        return json.loads(resp.read())["data"][0]["id"]


def warm_up(url: str, use_extension: bool = True, num_tokens: int = WARMUP_TOKENS, timeout_s: float = 600.0) -> float:
    """Send the warm-up requests to the replica at ``url``; seconds taken. Raises on HTTP errors."""
    url = url.rstrip("/")
    started = time.perf_counter()
    rng = random.Random()
    prompt = [rng.randrange(BYTE_IDS) for _ in range(num_tokens)]
    body = {"model": _model(url, timeout_s), "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
    _post(url + "/v1/completions", body, timeout_s)
    if use_extension:
        body["kvshare"] = {"use_pool": True, "use_local_cache": False}
    _post(url + "/v1/completions", body, timeout_s)
    return time.perf_counter() - started
