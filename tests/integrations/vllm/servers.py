"""Start vLLM OpenAI servers for the tests and talk to them (plain urllib; vLLM is not imported here)."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from kvshare.integrations.vllm.launch import LaunchSpec, VllmServerConfig, vllm_server_command, wait_until_ready
from kvshare.keys import chunk_keys
from kvshare.layout import KVLayout
from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import start_pool, stop_process


def vllm_python() -> str | None:
    """The interpreter that has vLLM: $KVSHARE_VLLM_PYTHON, else this one if it can import vllm."""
    given = os.environ.get("KVSHARE_VLLM_PYTHON")
    if given:
        return given
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def vllm_suite_marks() -> list:
    """The marks of a test module of the vLLM suite: skipped where no interpreter has vLLM."""
    return [
        pytest.mark.vllm,
        pytest.mark.slow,
        pytest.mark.skipif(
            vllm_python() is None, reason="needs vLLM (set KVSHARE_VLLM_PYTHON to the vLLM venv's python)"
        ),
    ]


@contextmanager
def private_socket(prefix: str) -> Iterator[str]:
    """A pool socket's path in an owner-only directory of its own under /tmp (AF_UNIX paths must stay
    short); the socket and the directory are removed afterwards, whatever pool used them."""
    socket_dir = f"/tmp/{prefix}-{os.getpid()}"
    os.makedirs(socket_dir, mode=0o700, exist_ok=True)
    path = os.path.join(socket_dir, "pool.sock")
    try:
        yield path
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(socket_dir)


@dataclass
class PrivatePool:
    """A pool process on its socket; a test may replace ``proc`` by a pool started again on the socket."""

    socket_path: str
    proc: subprocess.Popen


@contextmanager
def private_pool(prefix: str, size: str, args: tuple[str, ...] = ()) -> Iterator[PrivatePool]:
    """A pool of ``size`` started with ``args`` on a private_socket; on exit the process in ``proc`` is stopped (the
    one a test started again on the socket, if it did)."""
    with private_socket(prefix) as socket_path:
        pool = PrivatePool(socket_path, start_pool(socket_path, size, args))
        try:
            yield pool
        finally:
            stop_process(pool.proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    name: str
    spec: LaunchSpec
    proc: subprocess.Popen
    log_path: str

    @property
    def url(self) -> str:
        return self.spec.base_url

    def log_tail(self, num_lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-num_lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def with_connector(spec: LaunchSpec, cls: str, module: str, env: dict[str, str] | None = None) -> LaunchSpec:
    """``spec`` loading connector class ``cls`` from ``module`` instead of kvshare's (a test's subclass)."""
    argv = list(spec.argv)
    at = argv.index("--kv-transfer-config") + 1
    transfer = json.loads(argv[at])
    transfer.update(kv_connector=cls, kv_connector_module_path=module)
    argv[at] = json.dumps(transfer)
    return LaunchSpec(argv, {**spec.env, **(env or {})}, spec.base_url)


def start_servers(
    configs: dict[str, VllmServerConfig | LaunchSpec], log_dir: str, timeout_s: float = 420
) -> dict[str, Server]:
    """Start every server at once (they load in parallel) and wait until all are ready."""
    servers: dict[str, Server] = {}
    try:
        for name, config in configs.items():
            spec = config if isinstance(config, LaunchSpec) else vllm_server_command(config)
            log_path = os.path.join(log_dir, f"vllm-{name}.log")
            with open(log_path, "w") as log:
                proc = subprocess.Popen(
                    spec.argv, env=spec.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            servers[name] = Server(name, spec, proc, log_path)
        for server in servers.values():
            try:
                wait_until_ready(server.url, server.proc, timeout_s=timeout_s)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{exc}\n--- log of {server.name} ---\n{server.log_tail()}") from None
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict[str, Server]) -> None:
    for server in servers.values():
        server.stop()


@contextmanager
def running_servers(
    configs: dict[str, VllmServerConfig | LaunchSpec], log_dir: str, timeout_s: float = 420
) -> Iterator[dict[str, Server]]:
    """The servers of start_servers, stopped afterwards."""
    servers = start_servers(configs, log_dir, timeout_s)
    try:
        yield servers
    finally:
        stop_servers(servers)


def prompt_of(seed: int, num_tokens: int) -> list[int]:
    """``num_tokens`` random byte tokens (ids 0-255 of the tiny preset's tokenizer), the same for one ``seed``."""
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(num_tokens)]


def post(url: str, path: str, body: dict, timeout_s: float = 120) -> dict:
    request = urllib.request.Request(
        f"{url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.load(response)


def complete(server: Server, prompt: list[int], max_tokens: int = 12, **extra) -> dict:
    """A greedy completion of token ids with top-5 logprobs (tokens returned as ids)."""
    body = {
        "model": server.spec.argv[server.spec.argv.index("--served-model-name") + 1],
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,
        **extra,
    }
    return post(server.url, "/v1/completions", body)


def answer(response: dict) -> tuple[str, list[str], list[float]]:
    """(text, generated tokens as "token_id:N", their logprobs) of a completion response."""
    choice = response["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]


def assert_same_answer(got: dict, want: dict, what: str = "") -> None:
    """The same text and tokens, logprobs within 1e-4; ``what`` names the answer when they differ."""
    text, tokens, logprobs = answer(got)
    ref_text, ref_tokens, ref_logprobs = answer(want)
    assert tokens == ref_tokens and text == ref_text, what
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-4), what


def cached_tokens(response: dict) -> int:
    details = response["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def provenance(response: dict) -> dict:
    return (response.get("kv_transfer_params") or {}).get("kvshare", {})


def metric(server: Server, name: str) -> float:
    """Sum of a counter over its label sets in the server's /metrics."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for_metric(server: Server, name: str, at_least: float, timeout_s: float = 30) -> float:
    """vLLM publishes connector stats at its logging interval: poll until the counter arrives."""
    deadline = time.monotonic() + timeout_s
    value = metric(server, name)
    while value < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
        value = metric(server, name)
    return value


def pool_stats(socket_path: str) -> dict:
    """The pool's counters (kvshare pool-stats), read over a client of its own."""
    with PoolClient(socket_path, name="test") as client:
        return client.stats()


def stored_keys(socket_path: str, prompt: list[int], layout: KVLayout) -> list[bytes]:
    """The chunk keys of ``prompt`` in the namespace that holds its pages (the replicas' namespace carries vLLM's
    layout fingerprint, which a test does not rebuild); ``layout`` gives the chunk and page sizes."""
    with PoolClient(socket_path, name="test") as client:
        candidates = [
            chunk_keys(info.namespace, prompt, layout.chunk_tokens) for info in client.list_namespaces().namespaces
        ]
        return max(candidates, key=lambda keys: len(client.lookup(keys, layout.page_bytes, lease=False).pages))
