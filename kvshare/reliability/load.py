"""The bounded load tool: many concurrent sessions through a router for a set time, checked against references.

Every session runs seeded multi-turn conversations (kvshare.reliability.workload);
a sampled share of the answers is re-asked with the pool and the local cache off
and must give the same token ids (greedy decoding). The run stops by itself:
no request starts after ``duration_s``, and what is still running is cut off
``request_timeout_s`` later. Traffic goes to loopback addresses only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass

import aiohttp

from kvshare.reliability.exchange import Outcome, post
from kvshare.reliability.summary import LoadTally
from kvshare.reliability.workload import Conversation, documents, reference_body

PROGRESS_INTERVAL_S = 0.5  # how often on_progress hears of a run
ERROR_PAUSE_S = 0.5  # a session that saw an error waits this long (no error storm against a dead server)


@dataclass(frozen=True)
class LoadConfig:
    """Everything ``kvshare load`` takes; validated on construction."""

    url: str  # the router (or one replica)
    num_sessions: int = 32
    duration_s: float = 60.0
    max_tokens: int = 8
    min_document_chars: int = 300
    max_document_chars: int = 1200
    max_context_tokens: int = 2048  # a conversation ends before its prompt passes this
    num_documents: int = 4  # shared openings: sessions reuse each other's prefixes
    chat_share: float = 0.5  # sessions that chat; the others send growing completion prompts
    check_share: float = 0.1  # answers re-asked with the pool off and compared
    seed: int = 0
    model: str | None = None  # None: the first model the server lists
    api_key: str | None = None
    tenant_header: str = ""  # with num_tenants: sessions spread over tenants by this header
    num_tenants: int = 0
    request_timeout_s: float = 120.0
    session_header: str = "X-Session-ID"

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.duration_s <= 0 or self.max_tokens < 1 or self.request_timeout_s <= 0:
            raise ValueError("sessions, duration, max_tokens and the request timeout must be positive")
        if not 0 < self.min_document_chars <= self.max_document_chars:
            raise ValueError("document sizes must satisfy 0 < min <= max")
        if self.max_context_tokens < self.max_document_chars + 200:
            raise ValueError(
                f"max_context_tokens ({self.max_context_tokens}) must leave room for a few turns after "
                f"a document of {self.max_document_chars} characters"
            )
        if not 0.0 <= self.check_share <= 1.0 or not 0.0 <= self.chat_share <= 1.0:
            raise ValueError("check_share and chat_share must lie in [0, 1]")
        if self.num_tenants < 0 or (self.num_tenants and not self.tenant_header):
            raise ValueError("num_tenants needs a tenant_header")
        require_loopback(self.url)

    @property
    def deadline_s(self) -> float:
        """The run's hard bound: the duration, then the longest a request may still take."""
        return self.duration_s + self.request_timeout_s


def require_loopback(url: str) -> None:
    """Refuse any URL whose host is not (or does not resolve only to) a loopback address."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http://HOST:PORT URL, got {url!r}")
    try:
        infos = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve {parts.hostname!r}: {exc}") from None
    addresses = {info[4][0] for info in infos}
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(
            f"the load tool sends traffic to loopback addresses only; {parts.hostname} is {sorted(addresses)}"
        )


class LoadRun:
    """One run: sessions, the tally, the clock."""

    def __init__(self, config: LoadConfig, on_progress: Callable[[LoadTally, float], None] | None = None) -> None:
        """``on_progress(tally, elapsed_s)``: called every PROGRESS_INTERVAL_S while the run goes on."""
        self.config = config
        self.on_progress = on_progress
        self.docs = documents(config.seed, config.num_documents, config.min_document_chars, config.max_document_chars)
        self.tally = LoadTally(started_at=time.monotonic())
        self.model = config.model
        self._http: aiohttp.ClientSession | None = None

    def _headers(self, session_index: int, with_session: bool) -> dict[str, str]:
        cfg = self.config
        headers = {}
        if with_session:
            headers[cfg.session_header] = f"load-{cfg.seed}-{session_index}"
        if cfg.api_key:
            headers["Authorization"] = f"Bearer {cfg.api_key}"
        if cfg.num_tenants:
            headers[cfg.tenant_header] = f"tenant-{session_index % cfg.num_tenants}"
        return headers

    async def run(self) -> dict:
        cfg = self.config
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as http:
            self._http = http
            if self.model is None:
                self.model = await self._model_name()
            started = time.monotonic()
            stop_at = started + cfg.duration_s
            tasks = [asyncio.create_task(self._session(i, stop_at)) for i in range(cfg.num_sessions)]
            ticker = asyncio.create_task(self._report_progress(started)) if self.on_progress else None
            _, pending = await asyncio.wait(tasks, timeout=cfg.deadline_s + 5.0)
            if ticker is not None:
                ticker.cancel()
                self.on_progress(self.tally, time.monotonic() - started)
            for task in pending:  # past the hard bound: cut off (counted as unfinished)
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for task in tasks:
                if not task.cancelled() and task.exception() is not None:
                    raise task.exception()
            elapsed = time.monotonic() - started
        shown = {k: v for k, v in asdict(cfg).items() if k != "api_key"}
        return self.tally.summary(elapsed, shown | {"model": self.model}, unfinished=len(pending))

    async def _report_progress(self, started: float) -> None:
        while True:
            await asyncio.sleep(PROGRESS_INTERVAL_S)
            self.on_progress(self.tally, time.monotonic() - started)

    async def _model_name(self) -> str:
        headers = self._headers(0, with_session=False)
        timeout = aiohttp.ClientTimeout(total=30)
        async with self._http.get(self.config.url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{self.config.url}/v1/models answered {resp.status}: {(await resp.text())[:200]}")
            models = (await resp.json()).get("data") or []
        if not models:
            raise RuntimeError(f"{self.config.url} lists no models")
        return models[0]["id"]

    async def _session(self, index: int, stop_at: float) -> None:
        cfg = self.config
        rng = random.Random(f"session/{cfg.seed}/{index}")
        kind = "chat" if rng.random() < cfg.chat_share else "completion"
        while time.monotonic() < stop_at:
            conv = Conversation(kind, rng.choice(self.docs), random.Random(rng.random()))
            self.tally.num_conversations += 1
            while time.monotonic() < stop_at:
                out = await self._turn(index, conv, rng)
                if out is None:
                    break
                conv.advance(out.text)
                prompt = out.prompt_tokens or 0
                if prompt + cfg.max_tokens + 200 > cfg.max_context_tokens:  # 200: the next user message and template
                    break

    async def _turn(self, index: int, conv: Conversation, rng: random.Random) -> Outcome | None:
        """One request (and maybe its reference); None when the conversation cannot go on."""
        cfg = self.config
        body = conv.body(self.model, cfg.max_tokens)
        path = "/v1/chat/completions" if conv.kind == "chat" else "/v1/completions"
        out = await post(self._http, cfg.url, path, body, self._headers(index, True), cfg.request_timeout_s)
        self.tally.add(out)
        if not out.is_ok:
            await asyncio.sleep(ERROR_PAUSE_S)
            return None
        if rng.random() < cfg.check_share:
            # the reference has no session header: a pool-off answer may come from any replica
            ref = await post(
                self._http, cfg.url, path, reference_body(body), self._headers(index, False), cfg.request_timeout_s
            )
            self.tally.add_check(out, ref, f"session {index} {conv.kind} turn {conv.num_turns}")
        return out


def run_load(config: LoadConfig, on_progress: Callable[[LoadTally, float], None] | None = None) -> dict:
    """Run the load and return its summary (kvshare.reliability.summary.LoadTally.summary)."""
    return asyncio.run(LoadRun(config, on_progress).run())


def check_pool(socket_path: str, settle_s: float = 10.0) -> dict:
    """After a run: the pool holds no leases or reservations (within ``settle_s``) and its index is consistent."""
    from kvshare.pool.client import PoolClient, PoolRequestError

    deadline = time.monotonic() + settle_s
    with PoolClient(socket_path, name="load-check") as client:
        while True:
            stats = client.stats()
            if (stats["leases"] == 0 and stats["reservations"] == 0) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        try:
            client.check_integrity()
            integrity = "ok"
        except PoolRequestError as exc:
            integrity = str(exc)
    keys = (
        "entries",
        "leases",
        "reservations",
        "evictions",
        "quota_evictions",
        "skipped_stores",
        "hit_chunks",
        "committed_pages",
        "errors",
        "protocol_errors",
    )
    return {k: stats.get(k) for k in keys} | {"integrity": integrity}
