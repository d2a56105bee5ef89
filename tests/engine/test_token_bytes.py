"""A token's raw bytes (Tokenizer.token_bytes): what logprobs report for tokens that split a UTF-8 character."""

from __future__ import annotations

from kvshare.engine.tokenizer import EOS_ID, Tokenizer


def test_byte_level_tokens_give_their_byte_even_where_decode_gives_u_fffd():
    tok = Tokenizer.byte_level(64)
    assert tok.decode([0xE4]) == tok.decode([0xBD]) == "\ufffd"  # why decode cannot tell them apart
    assert [tok.token_bytes(i) for i in (0xE4, 0xBD, 0xA0)] == [b"\xe4", b"\xbd", b"\xa0"]
    assert b"".join(tok.token_bytes(i) for i in (0xE4, 0xBD, 0xA0)).decode() == "你"
    assert tok.token_bytes(ord("A")) == b"A" and tok.token_bytes(ord(" ")) == b" "
    assert tok.token_bytes(EOS_ID) == b"<|eos|>" and tok.is_special(EOS_ID) and not tok.is_special(ord("A"))


def test_byte_fallback_pieces_give_their_byte():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    vocab = {"<unk>": 0, "<0xE4>": 1, "<0xBD>": 2, "<0xA0>": 3, "▁hi": 4}
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = Tokenizer(hf, {})
    assert tok.decode([1]) == tok.decode([2]) == "\ufffd"
    assert [tok.token_bytes(i) for i in (1, 2, 3)] == [b"\xe4", b"\xbd", b"\xa0"]
    assert tok.token_bytes(4) == tok.decode([4]).encode()  # a whole piece: its text
