"""Which kvshare files a built-in request runs code in, from its arrival at a replica to its first token.

What ``kvshare demo`` (``kvshare up``) serves, in one process: a pool daemon (a child process, as ``up`` starts it)
and two replicas of the tiny synthetic model on CPU (``Engine`` + ``ReplicaServer`` on loopback ports), each with
its local prefix cache and the pool. The request is the demo's bench request (``kvshare.bench.client``: streaming
completion of token ids, top-2 logprobs, provenance). Measured:

    cold   replica A, a prompt nobody has seen: computed, then stored to the local cache and the pool
    pool   replica B, the same prompt: its chunks leased from the pool and loaded, the last token computed

Each is preceded by one request of the same kind on other prompts, so the measured one finds every lazy set-up
done (the steady state; ``--first`` measures the first ones instead). A profile hook (``sys.setprofile`` and
``threading.setprofile``, installed before any thread starts) records every kvshare function called in any
thread from the moment the client sends until the server has written the first token (the server's
``first_written.set()`` after that write, which lets the engine go on). Module bodies (imports) are not counted.
The pool daemon runs in its own process (as under ``kvshare up``): its files are not counted.

    PYTHONPATH=$PWD python benchmarks/request_path.py [--json] [--tokens 1024] [--first]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import sys
import threading
from collections import defaultdict

import kvshare

ROOT = os.path.dirname(os.path.abspath(kvshare.__file__)) + os.sep
SERVER_FILE = os.path.join(ROOT, "serve", "server.py")


class PathRecorder:
    """Files of kvshare functions that run while recording, with the threads that ran them.

    The request's threads (its replica's event loop and engine worker, and any thread started meanwhile) are
    recorded apart from the threads that were already running beside them (the pool link's watch, the other
    replica's): those are background. The engine worker's part ends when it hands the first token to the
    handler (``WorkerRequest.post``; whatever it does next, the prompt's store, is after the first token), the whole
    window when the handler has written it."""

    def __init__(self) -> None:
        from kvshare.serve.worker import WorkerRequest

        self.files: dict[str, set[str]] = defaultdict(set)
        self.background: dict[str, set[str]] = defaultdict(set)
        self.functions: dict[str, set[str]] = defaultdict(set)  # file -> functions run on the request's threads
        self.is_recording = False
        self.stopped_at_first_token = False
        self._event_set = threading.Event.set.__code__
        self._post = WorkerRequest.post.__code__
        self._background_threads: set[int] = set()
        self._done_threads: set[int] = set()

    def install(self) -> None:
        sys.setprofile(self._hook)
        threading.setprofile(self._hook)

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)

    def start(self, request_threads: set[int]) -> None:
        self.files.clear()
        self.background.clear()
        self.functions.clear()
        self._background_threads = {t.ident for t in threading.enumerate()} - request_threads
        self._done_threads = {threading.get_ident()}  # the client's (this thread): not the server's path
        self.stopped_at_first_token = False
        self.is_recording = True

    def result(self) -> dict:
        """{"files": {file: threads}, "functions": {file: functions}, "background": {file: threads}} of the last
        window."""
        return {
            "files": {k: sorted(v) for k, v in sorted(self.files.items())},
            "functions": {k: sorted(v) for k, v in sorted(self.functions.items())},
            "background": {k: sorted(v) for k, v in sorted(self.background.items())},
        }

    def _hook(self, frame, event: str, arg) -> None:
        if event not in ("call", "return") or not self.is_recording:
            return
        thread = threading.get_ident()
        if thread in self._done_threads:
            return
        code = frame.f_code
        if event == "call" and code is self._post:  # the engine hands its first token to the handler
            self._done_threads.add(thread)
            return
        if event == "call" and code is self._event_set:
            # the handler lets the engine go on once it has written the first token (ReplicaServer's relay)
            if frame.f_back is not None and frame.f_back.f_code.co_filename == SERVER_FILE:
                self.is_recording = False
                self.stopped_at_first_token = True
            return
        name = code.co_filename
        if name.startswith(ROOT) and code.co_name != "<module>":
            if thread in self._background_threads:
                self.background[name[len(ROOT) :]].add(threading.current_thread().name)
            else:
                self.files[name[len(ROOT) :]].add(threading.current_thread().name)
                self.functions[name[len(ROOT) :]].add(code.co_qualname)


class Replica:
    """An engine and its HTTP server on a loopback port, run by an event loop thread of its own."""

    def __init__(self, name: str, pool_socket: str) -> None:
        from aiohttp import web

        from kvshare.engine.engine import Engine, EngineConfig
        from kvshare.serve.config import ServeConfig
        from kvshare.serve.server import ReplicaServer

        self.engine = Engine(EngineConfig(model="tiny", pool_socket=pool_socket))
        self.server = ReplicaServer(self.engine, ServeConfig(replica_name=name))
        self._runner = web.AppRunner(self.server.app(), access_log=None)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"{name}-loop", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(120)
        self.port = self._runner.addresses[0][1]

    @property
    def threads(self) -> set[int]:
        """The threads a request of this replica runs on: its event loop's and its engine worker's."""
        return {self._thread.ident, self.server.worker._thread.ident}

    async def _start(self) -> None:
        from aiohttp import web

        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self.engine.close()


def send(replica: Replica, prompt: list[int], recorder: PathRecorder | None = None) -> dict:
    """One streaming bench request; returns the final chunk's provenance (recording the path when given)."""
    from kvshare.bench.client import BenchRequest

    url = f"http://127.0.0.1:{replica.port}"
    body = json.dumps(BenchRequest(url, "completion", "tiny", prompt, max_tokens=4).body())
    conn = http.client.HTTPConnection("127.0.0.1", replica.port, timeout=120)
    if recorder is not None:
        recorder.start(replica.threads)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    payload = conn.getresponse().read()
    conn.close()
    if recorder is not None and not recorder.stopped_at_first_token:
        raise RuntimeError("the server wrote no first token while recording (did its relay change?)")
    provenance = {}
    for line in payload.decode().splitlines():
        if line.startswith("data: {"):
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("error"):
                raise RuntimeError(f"the request failed: {chunk['error']}")
            provenance = chunk.get("kvshare") or provenance
    return provenance


def prompt(seed: int, num_tokens: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(0, 200, num_tokens).tolist()


def measure(num_tokens: int, is_first: bool) -> dict:
    from kvshare.pool.spawn import running_pool

    recorder = PathRecorder()
    recorder.install()  # before any thread starts: threading.setprofile reaches only threads started after it
    try:
        with running_pool("512MiB", quiet=True) as sock:
            a, b = Replica("replica-a", sock), Replica("replica-b", sock)
            try:
                if not is_first:
                    warm = prompt(1, num_tokens)
                    send(a, warm)  # cold on A, stored
                    send(b, warm)  # loaded from the pool on B
                measured = prompt(2, num_tokens)
                stats_b = b.engine.stats().prompt_tokens_pool
                send(a, measured, recorder)
                # the stream's last token waited for the prompt's store: the pool holds its chunks now
                cold = recorder.result()
                send(b, measured, recorder)
                pooled = recorder.result()
                pool_tokens = b.engine.stats().prompt_tokens_pool - stats_b
            finally:
                a.close()
                b.close()
    finally:
        recorder.uninstall()
    if pool_tokens <= 0:
        raise RuntimeError("replica B loaded nothing from the pool: the pool case was not measured")
    return {"prompt_tokens": num_tokens, "is_first": is_first, "cold": cold, "pool": pooled, "pool_tokens": pool_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="prompt length (whole chunks are shared)")
    parser.add_argument("--first", action="store_true", help="measure each replica's first request")
    parser.add_argument("--functions", action="store_true", help="list the functions run in each file")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the lists")
    args = parser.parse_args()
    result = measure(args.tokens, args.first)
    if args.json:
        print(json.dumps(result))
        return 0
    for case in ("cold", "pool"):
        files, background = result[case]["files"], result[case]["background"]
        print(f"{case}: {len(files)} files on the request's threads")
        for name, threads in files.items():
            print(f"  {name:40s} {', '.join(threads)}")
            if args.functions:
                print(f"      {', '.join(result[case]['functions'][name])}")
        print(
            f"  (beside it, on other threads: {', '.join(f'{k} [{chr(44).join(v)}]' for k, v in background.items())})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
