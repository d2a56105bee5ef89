"""A completion's token-id prompt read from its body (kvshare.serve.api_types.decode_completion):
exactly the list JSON holds, or nothing, and then msgspec's generic decode answers."""

import json

import msgspec
import numpy as np
import pytest

from kvshare.serve import api_types as A


def test_the_reader_takes_json_lists_of_non_negative_integers():
    assert A.read_list(b"[1,2]").tolist() == [1, 2]
    assert A.read_list(b"[ 0 , 17,\n\t4\r\n]").tolist() == [0, 17, 4]
    assert A.read_list(b"[]").tolist() == [] and A.read_list(b"[ \n]").tolist() == []
    assert A.read_list(b"[99999999999999999999999]").tolist() == [2**63 - 1]  # beyond any vocabulary


@pytest.mark.parametrize(
    "raw",
    [
        b"[1,-2]",
        b"[1.0]",
        b"[1e3]",
        b"[[1]]",
        b'"12"',
        b"12",
        b"[true]",
        b'[1, "2"]',
        b"[1,,2]",
        b"[1,2,]",
        b"[,1]",
        b"[1 2]",
        b"[1, 2 3]",
        b"[01]",
        b"[1, 007]",
        b"[,]",
        b"[1\x0b2]",
        b"[1,\xff]",
    ],
)
def test_the_reader_refuses_everything_else(raw):
    assert A.read_list(raw) is None, raw


@pytest.mark.parametrize("sep", [",", ", ", " ,\n ", ",\t"])
def test_a_long_list_read_on_threads_equals_its_numbers(sep):
    ids = np.random.default_rng(5).integers(0, 10**12, 120_000)  # long numbers: a cut may fall inside one
    raw = ("[ " + sep.join(str(i) for i in ids) + " ]").encode()
    inner = raw[1:-1]
    pieces = A.cut_at_commas(inner, 4)
    assert len(pieces) == 4 and b",".join(pieces) == inner  # cut at commas only, nothing lost
    assert A.read_list(raw).tolist() == ids.tolist()
    assert A.cut_at_commas(b"123", 4) == [b"123"] and A.cut_at_commas(b"1,2", 4) == [b"1", b"2"]


@pytest.mark.parametrize("where", [0, 1, 60_000, 119_998])
def test_one_bad_number_anywhere_in_a_long_list_refuses_it(where):
    ids = [str(i) for i in np.random.default_rng(6).integers(0, 151_936, 120_000)]
    ids[where] = "-" + ids[where]
    assert A.read_list(("[" + ",".join(ids) + "]").encode()) is None


def test_decode_completion_cuts_the_prompt_out_and_keeps_the_rest():
    ids = np.random.default_rng(7).integers(0, 151_936, 50_000).tolist()
    body = json.dumps(
        {"model": "m", "max_tokens": 3, "prompt": ids, "temperature": 0.5, "user": "u", "kvshare": {"timeline": True}}
    ).encode()
    req = A.decode_completion(body)
    assert type(req) is A.TokenIdsCompletionRequest and isinstance(req.prompt, np.ndarray)
    assert req.prompt.tolist() == ids
    assert (req.model, req.max_tokens, req.temperature, req.user, req.kvshare.timeline) == ("m", 3, 0.5, "u", True)


@pytest.mark.parametrize(
    "body, prompt",
    [
        # a "prompt" key that is not the request's: inside a string, in another object, before the real one
        (b'{"user": "\\"prompt\\": [1]", "prompt": [5, 6]}', [5, 6]),
        (b'{"kvshare": {"use_pool": true}, "stop": ["\\"prompt\\":[9]"], "prompt": [7]}', [7]),
        (b'{"prompt": "text [1, 2]"}', "text [1, 2]"),
        (b'{"prompt": [[1, 2]]}', [1, 2]),  # a one-element batch
        (b'{"prompt": [1, -2]}', [1, -2]),  # refused later by the replica's range check
        (b'{"prompt" : \n [3 ,4]}', [3, 4]),
    ],
)
def test_what_the_cut_cannot_take_goes_through_msgspec(body, prompt):
    got = A.prompt_of(A.decode_completion(body))
    assert (got.tolist() if isinstance(got, np.ndarray) else got) == prompt


def test_a_marker_in_the_body_is_a_clients_string_not_ours():
    body = json.dumps({"prompt": [1, 2], "user": "kvshare-prompt-0"}).encode()
    assert A.decode_completion(body).user == "kvshare-prompt-0"
    assert json.loads(A.MARK).startswith("kvshare-prompt-") and len(A.MARK) > 30  # a per-process nonce


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": [1,2,]}',
        b'{"prompt": [1,,2]}',
        b'{"prompt": [1 2]}',
        b'{"prompt": [01]}',
        b'{"prompt": [1, 2], "max_tokens": }',
        b'{"prompt": [1]',
    ],
)
def test_malformed_json_is_answered_as_before(body):
    with pytest.raises(A.ApiError) as err:
        A.decode_completion(body)
    assert err.value.code == "invalid_json", body


def test_a_wrong_type_beside_the_list_names_its_field():
    with pytest.raises(A.ApiError) as err:
        A.decode_completion(b'{"prompt": [1, 2], "max_tokens": "4"}')
    assert err.value.status == 400 and err.value.param == "max_tokens"
    with pytest.raises(msgspec.ValidationError):  # what the cut's own decode saw, before the generic one
        msgspec.json.decode(b'{"prompt": ' + A.MARK + b', "max_tokens": "4"}', type=A.TokenIdsCompletionRequest)
