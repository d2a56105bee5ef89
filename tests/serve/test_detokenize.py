from kvshare.serve.detokenize import TextStream


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def feed(stream, text):
    return "".join(stream.add(b) for b in text.encode())


def test_multibyte_characters_are_held_until_complete():
    s = TextStream(byte_decode, [])
    pieces = [s.add(b) for b in "é!".encode()]
    assert pieces == ["", "é", "!"]


def test_stop_string_truncates_and_tail_is_held():
    s = TextStream(byte_decode, ["world"])
    out = feed(s, "hello wor")
    assert out == "hello " and not s.is_stopped
    out += feed(s, "ld and more")
    assert s.is_stopped and s.text == "hello " and out == "hello "


def test_held_tail_released_when_it_is_not_a_stop():
    s = TextStream(byte_decode, ["world"])
    out = feed(s, "hello wo") + feed(s, "w")
    assert out == "hello wow"[: len(out)]
    assert (out + s.finish()) == "hello wow"
