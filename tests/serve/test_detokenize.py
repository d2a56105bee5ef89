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


def test_the_stop_search_is_linear_in_the_text():
    """Fails when every token decodes and searches the whole text again (20000 tokens: ~2e8 ids decoded)."""
    num_decoded = 0

    def counted_decode(ids):
        nonlocal num_decoded
        num_decoded += len(ids)
        return byte_decode(ids)

    stops = [f"<stop{i:02d}>" for i in range(16)]
    s = TextStream(counted_decode, stops)
    text = "abcdefghij" * 2000
    assert feed(s, text) + s.finish() == text and not s.is_stopped
    assert num_decoded <= 4 * len(text)
    assert s.num_scanned <= len(text) * max(len(stop) for stop in stops)


def test_the_earliest_stop_wins_and_text_matches_a_full_decode():
    s = TextStream(byte_decode, ["zz", "é!"])
    out = feed(s, "x" * 50 + "aé!b zz")
    assert s.is_stopped and out == s.text == "x" * 50 + "a"


def test_incremental_text_equals_the_tokenizers_full_decode():
    """The window decode gives what decoding every id at once gives, on the byte-level HF tokenizer."""
    from kvshare.engine.tokenizer import Tokenizer

    tok = Tokenizer.byte_level(4096)
    text = "Grüße, 世界! " * 40 + "naïve café 🙂 done"
    ids = tok.encode(text)
    s = TextStream(tok.decode, ["never"])
    out = "".join(s.add(i) for i in ids) + s.finish()
    assert out == tok.decode(ids) == s.text


def test_an_incomplete_character_at_the_end_is_released_by_finish():
    s = TextStream(byte_decode, [])
    out = "".join(s.add(b) for b in b"ab" + "é".encode()[:1])
    assert out == "ab" and s.finish() == "\ufffd"
