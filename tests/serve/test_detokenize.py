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
    assert s.num_scanned <= len(text) * len(stops)  # each character stepped once per stop string


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


def _reference(stops, pieces):
    """What the stream must have emitted after each piece (one token's text), searching the whole text: once a
    piece completes a stop, the text cut where the stop that begins first among those ending in it begins;
    before that, everything but the longest tail that may begin a stop."""
    text, emitted = "", []
    for piece in pieces:
        before = len(text)
        text += piece
        starts = [text.find(stop, max(0, before - len(stop) + 1)) for stop in stops]
        starts = [at for at in starts if at >= 0]
        if starts:
            return emitted + [text[: min(starts)]], True
        held = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        emitted.append(text[: len(text) - held])
    return emitted, False


def test_stop_matching_equals_a_search_of_the_whole_text():
    """Random tokens of 1-3 characters over a small alphabet (so stops overlap, repeat and share borders),
    against a reference that searches the whole text: after every token the same text emitted, then the
    same cut and the same stopped flag."""
    import random

    rng = random.Random(7)
    for _ in range(500):
        vocab = ["".join(rng.choice("ab\u00e9c") for _ in range(rng.randint(1, 3))) for _ in range(8)]
        stops = ["".join(rng.choice("ab\u00e9") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        ids = [rng.randrange(len(vocab)) for _ in range(rng.randint(0, 30))]
        s = TextStream(lambda ids: "".join(vocab[i] for i in ids), stops)
        emitted, out = [], ""
        for token_id in ids:
            out += s.add(token_id)
            emitted.append(out)
            if s.is_stopped:
                break
        expected, is_stopped = _reference(stops, [vocab[i] for i in ids])
        assert (emitted, s.is_stopped) == (expected, is_stopped), (vocab, stops, ids)
        assert out + s.finish() == (expected[-1] if is_stopped else "".join(vocab[i] for i in ids))


def test_a_long_stop_string_costs_memory_and_steps_linear_in_its_length():
    """Fails when the stream builds every prefix of every stop string (~L^2/2 characters: 200 MB for one
    of 20000) or searches the last len(stop) characters again on every token (20000 steps a token)."""
    import tracemalloc

    stop = "x" * 19999 + "y"
    text = "x" * 3000 + "abc" * 1000  # a tail that may begin the stop, then text that may not
    tracemalloc.start()
    s = TextStream(byte_decode, [stop])
    out = feed(s, text)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert out == text and not s.is_stopped
    assert peak < 4 << 20, peak  # the failure table (20000 ints) and the text, not 200 MB of prefixes
    assert s.num_scanned <= len(text)
