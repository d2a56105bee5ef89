"""Fuzzing the HTTP endpoints of a live replica (and the router in front of it) with hypothesis.

Random JSON documents, valid bodies with fields replaced, dropped or added, and byte-mutated bodies go
to /v1/completions and /v1/chat/completions. Every answer must be a 2xx (a well-formed completion or
stream) or a 4xx with an OpenAI error body: never a 5xx, never a dropped connection. Afterwards every
process is up, the replica answers correctly (pool on == pool off) and the pool's invariants hold.
"""

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.reliability.conftest import cold, completion, health, is_openai_error, pool_is_clean, start

pytestmark = pytest.mark.reliability
PATHS = ("/v1/completions", "/v1/chat/completions")

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["system", "user", "assistant", "tool", "x"]),
            "content": st.one_of(st.text(max_size=60), json_values),
        }
    ),
    max_size=4,
)
ints = st.one_of(st.integers(-3, 40), st.sampled_from([-(2**63) - 1, -(2**63), 2**31, 2**63 - 1, 2**63, 2**64, 2**70]))
floats = st.one_of(st.floats(-1, 3), st.sampled_from([0.0, -0.0, 1e-300, 1e300, 2.0, 2.0000001]))
# each field: values of the right type at and past its edges (mostly valid bodies), or any JSON at all
FIELDS = {
    "model": st.one_of(st.just("tiny"), st.text(max_size=8), json_values),
    "prompt": st.one_of(
        st.text(max_size=80),
        st.lists(st.one_of(st.integers(-5, 300), ints), max_size=40),
        st.lists(st.lists(st.integers(0, 300), max_size=5), max_size=2),
        json_values,
    ),
    "messages": st.one_of(messages, json_values),
    "max_tokens": st.one_of(ints, st.none(), json_values),
    "max_completion_tokens": st.one_of(ints, st.none()),
    "temperature": st.one_of(floats, json_values),
    "top_p": st.one_of(floats, json_values),
    "n": st.one_of(ints, json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), json_values),
    "seed": st.one_of(ints, st.none(), json_values),
    "logprobs": st.one_of(ints, st.booleans(), json_values),
    "top_logprobs": st.one_of(ints, json_values),
    "echo": st.booleans(),
    "ignore_eos": st.one_of(st.booleans(), json_values),
    "return_token_ids": st.booleans(),
    "presence_penalty": st.one_of(floats, json_values),
    "user": st.one_of(st.text(max_size=10), json_values),
    "kvshare": st.one_of(
        st.fixed_dictionaries({}, optional={"use_pool": st.booleans(), "use_local_cache": st.booleans()}), json_values
    ),
}
BASE = {
    "/v1/completions": {"model": "tiny", "prompt": "fuzz me", "max_tokens": 4},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "fuzz me"}], "max_tokens": 4},
}


@st.composite
def mutated_bodies(draw, path: str) -> bytes:
    body = dict(BASE[path])
    for name in draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True)):
        body[name] = draw(FIELDS[name])
    for name in draw(st.lists(st.sampled_from(sorted(body)), max_size=2, unique=True)):
        if draw(st.booleans()):
            del body[name]
    body.update(draw(st.dictionaries(st.text(min_size=1, max_size=8), json_values, max_size=2)))
    return json.dumps(body).encode()


TYPED = {  # values of the right type only, near the edges: most of these bodies reach the engine
    "prompt": st.one_of(st.text(min_size=1, max_size=150), st.lists(st.integers(0, 259), min_size=1, max_size=150)),
    "max_tokens": st.one_of(st.integers(1, 8), st.none()),
    "temperature": st.one_of(st.sampled_from([0.0, 1e-300, 1e-6, 1e-5, 2.0]), st.floats(0, 2)),
    "top_p": st.one_of(st.sampled_from([1e-300, 1e-7, 1.0]), st.floats(0, 1, exclude_min=True)),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(
        st.none(), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)
    ),
    "ignore_eos": st.booleans(),
    "return_token_ids": st.booleans(),
    "user": st.text(max_size=20),
    "kvshare": st.fixed_dictionaries({}, optional={"use_pool": st.booleans(), "use_local_cache": st.booleans()}),
}


@st.composite
def typed_bodies(draw, path: str) -> bytes:
    body = dict(BASE[path])
    for name in draw(st.lists(st.sampled_from(sorted(TYPED)), max_size=8, unique=True)):
        body[name] = draw(TYPED[name])
    if path.endswith("chat/completions"):
        body.pop("prompt", None)
        body["messages"] = draw(
            st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=100)}
                ),
                min_size=1,
                max_size=4,
            )
        )
        if draw(st.booleans()):
            body.update(logprobs=True, top_logprobs=draw(st.integers(0, 5)))
    elif draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 5))
    return json.dumps(body).encode()


@st.composite
def byte_mutations(draw, path: str) -> bytes:
    raw = bytearray(json.dumps(BASE[path]).encode())
    for _ in range(draw(st.integers(1, 5))):
        raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
    return bytes(raw)


def bodies(path: str):
    return st.one_of(
        typed_bodies(path),
        typed_bodies(path),
        mutated_bodies(path),
        byte_mutations(path),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=64),
    )


@pytest.fixture(scope="module")
def cluster():
    c = start("round_robin", replicas=1, replica_args=("--max-tokens-limit", "16", "--max-prompt-tokens", "512"))
    yield c
    c.stop()


def check_answer(url: str, path: str, raw: bytes) -> int:
    req = urllib.request.Request(url + path, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, data, kind = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as err:
        status, data, kind = err.code, err.read(), err.headers.get("Content-Type", "")
    assert status < 500, (status, raw, data[:500])
    if status >= 400:
        assert is_openai_error(json.loads(data)), (status, raw, data[:500])
        return status
    if kind.startswith("text/event-stream"):
        events = [e[len(b"data: ") :] for e in data.split(b"\n\n") if e.startswith(b"data: ")]
        assert events and events[-1] == b"[DONE]", (raw, data[-500:])
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks), (raw, data[-500:])
        assert any(c["choices"] and c["choices"][0].get("finish_reason") for c in chunks)
    else:
        body = json.loads(data)
        assert body["choices"][0]["finish_reason"] in ("stop", "length"), body
    return status


@pytest.mark.parametrize("path", PATHS)
@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(data=st.data())
def test_fuzz_endpoints_answer_2xx_or_4xx_with_an_error_body(cluster, path, data):
    raw = data.draw(bodies(path))
    target = cluster.replica_urls[0] if data.draw(st.integers(0, 3)) else cluster.router_url
    status = check_answer(target, path, raw)
    event(f"HTTP {status}")  # --hypothesis-show-statistics: how many answers reached the engine


@pytest.mark.parametrize(
    "path, raw",
    [  # what the fuzzing found (each was a 500), kept as regressions
        ("/v1/completions", b"\x80" + json.dumps(BASE["/v1/completions"]).encode()),  # not UTF-8
        ("/v1/completions", json.dumps({**BASE["/v1/completions"], "seed": 2**65}).encode()),  # torch: overflow
        ("/v1/completions", json.dumps({**BASE["/v1/completions"], "temperature": 1e-82}).encode()),  # logits / T = inf
        ("/v1/chat/completions", json.dumps({**BASE["/v1/chat/completions"], "top_p": 1e-82}).encode()),  # 0 in float32
    ],
)
def test_fuzz_findings_stay_fixed(cluster, path, raw):
    for url in (cluster.replica_urls[0], cluster.router_url):
        check_answer(url, path, raw)


def test_after_fuzzing_every_process_is_up_answers_are_right_and_the_pool_is_consistent(cluster):
    for name, proc in cluster.processes.items():
        assert proc.poll() is None, f"{name} exited with {proc.returncode}"
    url = cluster.replica_urls[0]
    assert health(url)["status"] == "ok" and health(cluster.router_url)["status"] == "ok"
    prompt = "after the fuzzing " * 25  # 450 tokens: one full chunk, under --max-prompt-tokens
    completion(url, prompt)  # stores the prompt's chunks
    status, out = completion(url, prompt, kvshare={"use_local_cache": False})
    assert status == 200 and out["kvshare"]["pool_tokens"] > 0
    assert out["choices"][0]["token_ids"] == cold(url, prompt)
    pool_is_clean(cluster.pool_socket)
