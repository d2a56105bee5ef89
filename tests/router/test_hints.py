"""The prefetch hint's wire format (kvshare.router.hints): signed, bounded, refused whole when anything is off."""

import time

import numpy as np
import pytest

from kvshare.router.hints import (
    MAX_AGE_S,
    MAX_FRAME_BYTES,
    HintRefused,
    decode_hint,
    encode_hint,
    frame_length,
    make_hint,
    parse_address,
)

KEY = "k" * 32


def body(frame: bytes) -> bytes:
    assert frame_length(frame[:4]) == len(frame) - 4
    return frame[4:]


def test_a_signed_hint_decodes_to_what_was_sent():
    ids = list(range(1000, 1300)) + [2**32 - 1]
    hint = decode_hint(body(encode_hint(make_hint("m", "salt", ids), KEY)), KEY)
    assert hint.model == "m" and hint.cache_salt == "salt"
    assert hint.tokens().tolist() == ids and hint.num_tokens == len(ids)
    assert decode_hint(body(encode_hint(make_hint("m", None, np.arange(5)), KEY)), KEY).cache_salt == ""


@pytest.mark.parametrize("position", [0, 10, 40, -1])
def test_any_changed_byte_is_refused(position):
    frame = bytearray(body(encode_hint(make_hint("m", "", list(range(600))), KEY)))
    frame[position] ^= 0x01
    with pytest.raises(HintRefused):
        decode_hint(bytes(frame), KEY)


def test_another_key_no_key_and_no_tag_are_refused():
    frame = body(encode_hint(make_hint("m", "", [1, 2, 3]), KEY))
    for key, why in (("x" * 32, "does not verify"), ("", "no key")):
        with pytest.raises(HintRefused, match=why):
            decode_hint(frame, key)
    import msgspec

    from kvshare.router.hints import SignedHint

    unsigned = msgspec.msgpack.encode(SignedHint(msgspec.msgpack.encode(make_hint("m", "", [1])), b""))
    with pytest.raises(HintRefused, match="does not verify"):
        decode_hint(unsigned, KEY)
    with pytest.raises(HintRefused, match="not a signed hint"):
        decode_hint(b"\x93garbage", KEY)
    with pytest.raises(ValueError, match="account key"):
        encode_hint(make_hint("m", "", [1]), "")


def test_an_old_hint_is_refused_as_a_replay():
    frame = body(encode_hint(make_hint("m", "", [1, 2]), KEY))
    decode_hint(frame, KEY, now=time.time() + MAX_AGE_S - 1)
    with pytest.raises(HintRefused, match="ago"):
        decode_hint(frame, KEY, now=time.time() + MAX_AGE_S + 1)


def test_a_frame_over_the_bound_and_ids_beyond_u32_are_refused():
    with pytest.raises(HintRefused, match="exceeds"):
        frame_length((MAX_FRAME_BYTES + 1024).to_bytes(4, "big"))
    with pytest.raises(ValueError, match="u32"):
        make_hint("m", "", [2**32])
    with pytest.raises(ValueError, match="u32"):
        make_hint("m", "", [-1])


def test_addresses_are_a_unix_path_or_host_and_port():
    assert parse_address("/run/x/hints.sock") == ("unix", "/run/x/hints.sock")
    assert parse_address("127.0.0.1:7001") == ("tcp", ("127.0.0.1", 7001))
    assert parse_address("[::1]:7001") == ("tcp", ("::1", 7001))
    for bad in ("hints.sock", "host:", ":80", "host:99999"):
        with pytest.raises(ValueError, match="absolute path or HOST:PORT"):
            parse_address(bad)
