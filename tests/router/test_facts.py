"""What the router reads from a request body to place it (kvshare.router.facts, through RouterServer._facts)."""

import json
from types import SimpleNamespace

import pytest

from kvshare.router.config import RouterConfig
from kvshare.router.server import RouterServer

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


class _Placer:
    """A pool_aware placer's prompt_of as the router has it, counting what reaches it."""

    def __init__(self) -> None:
        from kvshare.router.pool_aware import PoolAwarePlacer

        self.placer = PoolAwarePlacer.__new__(PoolAwarePlacer)
        self.placer.tokenizer = None
        self.calls: list = []

    def prompt_of(self, prompt, messages):
        self.calls.append(prompt)
        return self.placer.prompt_of(prompt, messages)


@pytest.mark.parametrize(
    "prompt, ids, reaches_prompt_of",
    [
        (TOKEN_PROMPT, TOKEN_PROMPT, False),  # checked by msgspec's decoder, not id by id in Python
        ([], [], False),
        ([0, (1 << 32) - 1], [0, (1 << 32) - 1], False),
        ([1, True, 3], None, True),  # JSON true is not a token id
        ([1, -1], None, True),
        ([1, 1 << 32], None, True),  # beyond 4 bytes: the pool holds nothing of it
        ([1.0, 2], None, True),
        (["a", "b"], None, True),  # a batch: placed without a prefix
        ([TOKEN_PROMPT], None, True),
        (None, None, True),
    ],
)
def test_pool_aware_takes_token_ids_as_decoded_and_every_other_form_as_before(prompt, ids, reaches_prompt_of):
    """Token ids come from the typed decode (fails when route_facts hands every prompt to prompt_of, whose check
    id by id cost ~50 ms of the router's loop for a 128k-token prompt); any other form gets prompt_of's answer."""
    from kvshare.router.facts import route_facts

    placer = _Placer()
    facts = route_facts("pool_aware", json.dumps({"prompt": prompt}).encode(), None, lambda salt: "", placer)
    assert facts.prompt_ids == ids
    assert (placer.calls != []) == reaches_prompt_of
    if reaches_prompt_of:
        assert placer.calls == [prompt]
