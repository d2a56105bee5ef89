"""What the router reads from a request body to place it (kvshare.router.facts, through RouterServer._facts)."""

import json
from types import SimpleNamespace

import pytest

from kvshare.router.proxy import RouterConfig, RouterServer

TOKEN_PROMPT = list(range(1000, 1300))


def _facts(policy: str, body: dict, headers: dict | None = None):
    server = RouterServer(RouterConfig(replicas=("http://127.0.0.1:1", "http://127.0.0.1:2"), policy=policy))
    return server._facts(SimpleNamespace(headers=headers or {}), json.dumps(body).encode())


@pytest.mark.parametrize("prompt", [TOKEN_PROMPT, "a text prompt", [TOKEN_PROMPT]])
def test_sticky_reads_the_user_whatever_the_prompt(prompt):
    # a token-id prompt once made the placement decode fail, and the user was lost with it
    facts = _facts("sticky", {"model": "m", "prompt": prompt, "user": "alice", "max_tokens": 4})
    assert facts.session_id == "alice"


def test_the_session_header_wins_over_the_user():
    facts = _facts("sticky", {"prompt": TOKEN_PROMPT, "user": "alice"}, headers={"X-Session-ID": "s-1"})
    assert facts.session_id == "s-1"


def test_alternate_counts_the_chat_turn():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    facts = _facts("alternate", {"messages": messages, "user": "bob"})
    assert (facts.session_id, facts.chat_turn) == ("bob", 1)


def test_round_robin_reads_nothing_and_cache_aware_hashes_the_prompt():
    body = {"prompt": TOKEN_PROMPT, "user": "alice"}
    facts = _facts("round_robin", body)
    assert (facts.session_id, facts.chat_turn, facts.prefix_blocks) == (None, None, ())
    aware = _facts("cache_aware", body)
    assert aware.session_id == "alice" and len(aware.prefix_blocks) > 0
