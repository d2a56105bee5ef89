"""``kvshare route`` imports no torch: pool_aware places by token ids from the ``tokenizers`` library alone (the
replicas' tokenizer through kvshare.engine.tokenizer_loader, without the model's weights or code), so a router on
a CPU host neither pays torch's import nor needs it installed."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")
# `kvshare route` as the console script runs it, reporting at exit every module it imported of HEAVY's packages
WRAPPER = f"""
import atexit, json, sys
heavy = lambda: sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
atexit.register(lambda: print("HEAVY " + json.dumps(heavy()), flush=True))
from kvshare.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict) -> int:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _wait_listening(url: str, proc: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            urllib.request.urlopen(url + "/health", timeout=5).close()
            return
        except urllib.error.HTTPError:
            return  # 503: no replica is healthy, but the router answers
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the router never listened")


def test_a_pool_aware_router_that_placed_text_and_chat_prompts_imported_no_torch():
    """Fails when the router loads its tokenizer through the engine's model loader (kvshare.engine.loader imports
    torch and the model code) or anything else of the route pulls torch in."""
    port = _free_port()
    argv = ["route", "--replica", "http://127.0.0.1:9", "--port", str(port), "--policy", "pool_aware"]
    argv += ["--kv-events", "tcp://127.0.0.1:9", "--model", "qwen3-8b"]  # the presets' BPE: what a real model has
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_listening(url, proc)
        # placed (tokenized, hashed) and sent to a replica that cannot be reached: 503 from the router
        assert _post(url + "/v1/completions", {"model": "m", "prompt": "a text prompt", "max_tokens": 2}) == 503
        chat = {"model": "m", "messages": [{"role": "user", "content": "a chat"}], "max_tokens": 2}
        assert _post(url + "/v1/chat/completions", chat) == 503
    finally:
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=60)[0].decode()
    [line] = [line for line in out.splitlines() if line.startswith("HEAVY ")]
    assert json.loads(line.removeprefix("HEAVY ")) == []
