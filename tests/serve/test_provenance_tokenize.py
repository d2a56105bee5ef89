"""Who sees a request's provenance (--provenance), and the tokenizer endpoints' key, size cap and thread."""

import threading

import pytest

from kvshare.serve import server as server_module
from kvshare.serve.config import ServeConfig
from kvshare.serve.server import ReplicaServer
from tests.serve.live import LiveApp, call

KEY = "key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The same preamble that someone else may have sent before. " * 40  # > 2 chunks of the tiny model


@pytest.fixture(scope="module")
def engine():
    from kvshare.engine.engine import Engine, EngineConfig

    return Engine(EngineConfig(model="tiny", local_cache_bytes=64 << 20))


def _replica(engine, **config) -> LiveApp:
    return LiveApp(ReplicaServer(engine, ServeConfig(replica_name="replica0", **config)).app())


def _complete(url: str, **extra) -> dict:
    status, body = call(url, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 1, **extra})
    assert status == 200, body
    return body


def test_provenance_is_shown_only_where_the_namespace_is_the_callers_own(engine):
    """Fails when every response carries local_tokens/pool_tokens (and cached_tokens) whatever --provenance says:
    in a namespace shared by several users they say whether someone else sent the prompt before."""
    with _replica(engine, provenance="own-tenant") as url:
        _complete(url)
        shared = _complete(url)  # a repeat: the local cache holds the prefix
        assert "local_tokens" not in shared["kvshare"] and "replica" not in shared["kvshare"], shared["kvshare"]
        assert shared["usage"]["prompt_tokens_details"] is None
        _complete(url, cache_salt="mine")
        own = _complete(url, cache_salt="mine")  # a namespace of its own: its provenance is its own history
        assert own["kvshare"]["local_tokens"] > 0 and own["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    with _replica(engine, provenance="off") as url:
        assert _complete(url, cache_salt="mine")["kvshare"] == {}
    with _replica(engine, provenance="all") as url:
        assert _complete(url)["kvshare"]["local_tokens"] > 0  # one user: the repeat shows where its KV came from
    with pytest.raises(ValueError, match="--provenance"):
        ServeConfig(provenance="some")


def test_tokenizer_endpoints_need_a_key_have_a_size_cap_and_run_off_the_event_loop(engine, monkeypatch):
    """Fails when /tokenize and /detokenize answer without a key, take any body size, or tokenize on the loop
    (a 1 MB body then stalls every stream of the replica)."""
    threads = []
    tokenize = server_module.T.tokenize

    def recording_tokenize(*args):
        threads.append(threading.current_thread())
        return tokenize(*args)

    monkeypatch.setattr(server_module.T, "tokenize", recording_tokenize)
    with _replica(engine, api_keys=(KEY,), max_tokenize_bytes=4096) as url:
        for path, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [104, 105]})):
            status, out = call(url, path, body)
            assert status == 401 and out["error"]["code"] == "invalid_api_key", out
            assert call(url, path, body, headers=AUTH)[0] == 200
        status, out = call(url, "/tokenize", {"prompt": "x" * 5000}, headers=AUTH)
        assert status == 413 and out["error"]["code"] == "body_too_large", out
        assert set(out["error"]) == {"message", "type", "param", "code"}
    assert threads and all(t.name != "live-app" for t in threads), threads  # the app's loop runs in "live-app"


def test_a_tokenize_body_longer_than_one_network_read_is_read_whole(engine):
    """Fails when the capped body read takes only what one read returns: a 2.5 MiB body under a 4 MiB cap
    arrives in several reads, and the handler then sees truncated JSON (400) instead of the whole prompt."""
    prompt = "word " * (2 << 18)  # 2.5 MiB of JSON
    with _replica(engine, api_keys=(KEY,), max_tokenize_bytes=4 << 20) as url:
        status, out = call(url, "/tokenize", {"prompt": prompt}, headers=AUTH)
        assert status == 200, out
        assert out["count"] == len(engine.tokenizer.encode(prompt))


def test_a_prompt_shorter_than_a_chunk_sent_again_is_reused_to_the_token(engine):
    """Fails when in-place reuse starts at a whole chunk (256 tokens): a short prompt sent twice to one replica
    then reports cached_tokens 0 both times. Token-id prompts, so each length is exact."""
    with _replica(engine, provenance="all") as url:
        for n in (35, 255, 256):
            body = {"model": "tiny", "prompt": [(7 * i + n) % 200 + 32 for i in range(n)], "max_tokens": 1}
            cached = []
            for _ in range(2):
                status, out = call(url, "/v1/completions", body)
                assert status == 200, out
                cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            assert cached == [0, n - 1], (n, cached)
