"""The serving stack as a user runs it: `kvshare up` (Cluster) with the tiny model, the openai SDK, curl-like calls."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import psutil
import pytest

from tests.serve.conftest import free_port_block, start_cluster

LONG = "The shared pool keeps what one replica computed for the next. " * 12  # ~770 characters = tokens


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(url: str, body, path="/v1/chat/completions", raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_openai_sdk_chat_and_completions_streaming_and_not(cluster):
    client = sdk(cluster.router_url)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=6, temperature=0
    )
    assert chat.choices[0].finish_reason in ("length", "stop") and chat.usage.completion_tokens >= 1
    assert (
        chat.kvshare["computed_tokens"] + chat.kvshare["pool_tokens"] + chat.kvshare["local_tokens"]
        == chat.usage.prompt_tokens
    )
    comp = client.completions.create(model="tiny", prompt="once upon a time", max_tokens=6, temperature=0)
    assert comp.usage.completion_tokens == 6 and isinstance(comp.choices[0].text, str)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content  # streaming and not give the same tokens
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert chunks[-1].kvshare["replica"].startswith("replica")
    comp_stream = list(
        client.completions.create(model="tiny", prompt="once upon a time", max_tokens=6, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in comp_stream if c.choices) == comp.choices[0].text
    finals = [c for c in comp_stream if c.choices and c.choices[0].finish_reason]
    assert finals and finals[-1].kvshare["computed_tokens"] > 0


def _two_turns(url: str, session: str, extension: dict) -> list[dict]:
    turns, messages = [], [{"role": "user", "content": LONG}]
    for _ in range(2):
        body = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
            "kvshare": extension,
        }
        req = urllib.request.Request(
            url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Session-ID": session},
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
        turns.append(out)
        messages = messages + [
            {"role": "assistant", "content": out["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And then? " * 5},
        ]
    return turns


def test_alternate_session_second_turn_loads_from_pool_and_matches_pool_off(cluster):
    on = _two_turns(cluster.router_url, "session-on", {})
    assert on[0]["kvshare"]["replica"] != on[1]["kvshare"]["replica"]  # turn k -> replica k mod 2
    assert on[1]["kvshare"]["pool_tokens"] > 0 and on[1]["kvshare"]["local_tokens"] == 0
    assert on[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == on[1]["kvshare"]["pool_tokens"]
    off = _two_turns(cluster.router_url, "session-off", {"use_pool": False, "use_local_cache": False})
    assert off[1]["kvshare"]["pool_tokens"] == 0 and off[1]["kvshare"]["local_tokens"] == 0
    for a, b in zip(on, off):
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]


@pytest.mark.parametrize(
    "path, body, raw, status, param",
    [
        ("/v1/chat/completions", None, b"{not json", 400, None),
        ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}, None, 400, None),
        ("/v1/chat/completions", {"model": "tiny"}, None, 400, None),
        ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, None, 404, "model"),
        ("/v1/completions", {"model": "tiny", "prompt": "x" * 40000}, None, 400, "prompt"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 0}, None, 400, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 10**7}, None, 400, "max_tokens"),
        ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 10**9]}, None, 400, "prompt"),
        ("/v1/completions", None, b'{"model": "tiny", "prompt": "' + b"x" * (17 << 20) + b'"}', 413, None),
        ("/v1/nothing", {"model": "tiny"}, None, 404, None),
    ],
)
def test_bad_input_gets_4xx_with_error_body_and_server_keeps_serving(cluster, path, body, raw, status, param):
    url = cluster.replica_urls[0]
    got, err = post(url, body, path=path, raw=raw)
    assert got == status
    assert set(err["error"]) >= {"message", "type", "param", "code"} and err["error"]["message"]
    if param:
        assert err["error"]["param"] == param
    ok, out = post(url, {"model": "tiny", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert ok == 200 and out["usage"]["completion_tokens"] == 2


def test_client_disconnect_mid_stream_frees_the_request(cluster):
    url = cluster.replica_urls[1]
    import http.client

    conn = http.client.HTTPConnection(url.split("//")[1], timeout=60)
    body = json.dumps({"model": "tiny", "prompt": "abc", "max_tokens": 4000, "stream": True, "ignore_eos": True})
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    resp.read1(200)  # a few chunks arrive
    conn.sock.shutdown(2)
    conn.close()

    def cancelled():
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        line = [ln for ln in text.splitlines() if ln.startswith("kvshare_request_cancelled_total")]
        return line and float(line[0].split()[-1]) >= 1

    deadline = time.monotonic() + 60
    while not cancelled():
        assert time.monotonic() < deadline, "the replica did not notice the client left"
        time.sleep(0.2)
    while True:  # the engine stops at its next token, after the handler counted the cancel
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())
        if health["running"] == 0 and health["waiting"] == 0:
            break
        assert time.monotonic() < deadline, f"the engine still runs the abandoned request: {health}"
        time.sleep(0.05)
    t0 = time.monotonic()
    ok, _ = post(url, {"model": "tiny", "messages": [{"role": "user", "content": "next"}], "max_tokens": 2})
    assert ok == 200 and time.monotonic() - t0 < 30


def test_killed_replica_router_sends_requests_to_the_other():
    c = start_cluster("round_robin")
    try:
        victim = c.processes["replica0"]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        client = sdk(c.router_url)
        for _ in range(4):  # round robin would send half of these to the dead replica
            out = client.completions.create(model="tiny", prompt="are you there", max_tokens=2, temperature=0)
            assert out.kvshare["replica"] == "replica1"
        health = json.loads(urllib.request.urlopen(c.router_url + "/health", timeout=10).read())
        assert [r["healthy"] for r in health["replicas"]] == [False, True]
    finally:
        c.stop()


def test_up_sigterm_leaves_no_processes_sockets_or_shared_memory(tmp_path):
    port = free_port_block(3)
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvshare", "up", "--replicas", "2", "--port", str(port), "--pool-size", "256MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    out = ""
    deadline = time.monotonic() + 120
    while "Ctrl-C stops everything" not in out:
        assert time.monotonic() < deadline and proc.poll() is None, out
        out += proc.stdout.readline()
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= 4  # pool, two replicas, router
    sockets = [p for p in tmp_path.rglob("*") if p.is_socket()]
    assert sockets, "the pool's socket should live under TMPDIR while running"
    shm_before = set(os.listdir("/dev/shm"))
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, f"left behind: {alive}"
    assert not [p for p in tmp_path.rglob("*") if p.is_socket()]
    assert not list(tmp_path.glob("kvshare-up-*"))
    # the arena is a memfd: nothing was ever in /dev/shm. What another process on the machine creates and removes
    # meanwhile (multiprocessing's sem.mp-*) is gone a moment later; what the cluster leaked stays
    leaked = set(os.listdir("/dev/shm")) - shm_before
    time.sleep(2)
    assert not leaked & set(os.listdir("/dev/shm"))
