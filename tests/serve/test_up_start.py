"""`kvshare up` starting, as a user runs it (real processes): from any working directory, onto ports that are
free, and with an error naming the child that could not start."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import time

import psutil
import pytest

from kvshare.launch import free_port_block, wait_http_ready
from kvshare.pool.spawn import kvshare_env
from tests.serve.up_process import UpProcess, get_json


def completion(url: str, prompt: str) -> dict:
    import urllib.request

    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


@pytest.fixture
def foreign_health():
    """Another server on a port, answering /health 200 as someone else: what a first cluster's replica looks like."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"status": "ok", "instance_id": "not-yours"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_up_starts_from_a_directory_holding_a_kvshare_folder_and_stops_clean(tmp_path):
    (tmp_path / "kvshare").mkdir()
    (tmp_path / "kvshare" / "__init__.py").write_text("")  # would shadow the package for `python -m kvshare`
    port = free_port_block(2)
    up = UpProcess("--replicas", "1", "--pool-size", "64MiB", cwd=tmp_path, port=port)
    try:
        up.wait_ready(1)
        out = completion(up.router_url, "hello from a shadowed directory")
        assert out["choices"][0]["text"] and out["kvshare"]["replica"] == "replica0"
        status, health = get_json(f"http://127.0.0.1:{up.port + 1}/health")
        assert status == 200 and health["pool"] == "connected" and health["instance_id"]
        children = up.descendants()
        assert all(up.child(name) for name in ("pool", "replica0", "router"))
    finally:
        rc = up.stop()
    assert rc == 0, up.output()
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_up_on_a_port_in_use_exits_naming_it_before_starting_anything(tmp_path, foreign_health):
    port = foreign_health - 1  # the foreign server holds replica0's port
    up = UpProcess("--replicas", "1", "--pool-size", "64MiB", cwd=tmp_path, port=port)
    rc = up.proc.wait(60)
    assert rc == 2, up.output()
    assert f"port {foreign_health} (replica0) on 127.0.0.1 is in use" in up.output()
    assert "Traceback" not in up.output()


def test_readiness_is_the_child_just_started_not_whoever_answers_on_its_port(foreign_health):
    proc = subprocess.Popen(["sleep", "2"])  # stands for a child that could not bind and exits
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="another server answers at .* its port is taken"):
        wait_http_ready(f"http://127.0.0.1:{foreign_health}", proc, 30, "replica0", instance_id="mine")
    assert time.monotonic() - started >= 1.5  # the foreign 200 was not taken for ready
    proc.wait()


def test_a_replica_that_exits_at_start_stops_up_naming_it_and_its_last_lines(tmp_path):
    up = UpProcess(
        "--replicas", "1", "--pool", "off", "--replica-arg=--no-such-flag", cwd=tmp_path, port=free_port_block(2)
    )
    rc = up.proc.wait(120)
    out = up.output()
    assert rc == 2, out
    assert "replica0 at http://127.0.0.1:" in out and "exited (exit code 2) before it was ready" in out
    assert "unrecognized arguments: --no-such-flag" in out.split("its last lines:")[1]


def test_pool_stats_with_no_socket_finds_the_pool_up_started(tmp_path, monkeypatch):
    """up's pool socket lives in up's private directory; pool-stats and pool-admin with no --socket find it
    through the pointer up writes in the runtime directory, and up removes the pointer when it stops."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    env = kvshare_env()
    port = free_port_block(2)
    up = UpProcess("--replicas", "1", "--pool-size", "64MiB", cwd=tmp_path, port=port)
    try:
        up.wait_ready(1)
        out = subprocess.run(
            [sys.executable, "-P", "-m", "kvshare", "pool-stats"], env=env, capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["capacity_bytes"] == 64 << 20
    finally:
        assert up.stop() == 0, up.output()
    assert not (runtime / "kvshare" / f"up-pool-socket.{port}").exists()
    out = subprocess.run(
        [sys.executable, "-P", "-m", "kvshare", "pool-stats"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "pool.sock" in out.stderr and "Traceback" not in out.stderr


def test_up_uses_a_running_pool_leaves_it_running_and_says_what_it_stops(tmp_path):
    """Fails when up refuses --pool SOCKET ("pool flags are the same everywhere": serve takes a running pool's
    socket, and so does up), or stops that pool with the cluster, or says nothing when Ctrl-C stops it."""
    from kvshare.pool.client import PoolClient
    from kvshare.pool.spawn import start_pool, stop_process, wait_for_pool

    socket_path = str(tmp_path / "pool.sock")
    pool = start_pool(socket_path, "64MiB", log_level="WARNING")
    wait_for_pool(socket_path)
    up = UpProcess("--replicas", "1", "--pool", socket_path, cwd=tmp_path, port=free_port_block(2))
    try:
        up.wait_ready(1)
        prompt = "a prompt long enough to fill a chunk of the running pool " * 12
        completion(up.router_url, prompt)
        status, health = get_json(f"http://127.0.0.1:{up.port + 1}/health")
        assert status == 200 and health["pool"] == "connected", health
        assert up.child("pool") is None  # up started no pool of its own
        assert up.stop() == 0, up.output()
        assert pool.poll() is None, "up stopped the pool it did not start"
        with PoolClient(socket_path, name="test") as client:
            assert client.stats()["entries"] >= 1  # what the replica stored is still there
        out = up.output()
        assert "stopping the router, 1 replica and not the pool" in out and "kvshare up: stopped" in out, out
    finally:
        up.stop()
        stop_process(pool)


def test_a_running_pool_that_does_not_answer_is_refused_before_anything_starts(tmp_path):
    up = UpProcess("--replicas", "1", "--pool", str(tmp_path / "none.sock"), cwd=tmp_path, port=free_port_block(2))
    rc = up.proc.wait(60)
    assert rc == 2 and "no pool answers there" in up.output() and "Traceback" not in up.output(), up.output()
