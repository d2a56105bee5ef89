"""The shared level of the piece encoder: another process's pieces are found, equal a plain encode, and an entry
that fails any check is encoded instead; the directory is private and bounded."""

from __future__ import annotations

import multiprocessing
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings

from kvshare.engine.token_cache import PieceEncoder, TokenCacheConfig, safe_cuts
from kvshare.engine.token_share import (
    FORMAT_VERSION,
    HEADER,
    SharedPieces,
    TokenShareConfig,
    entry_name,
    pack_entry,
    unpack_entry,
)
from kvshare.errors import UserError
from tests.engine.test_token_cache import _tokenizers, texts

CONFIG = TokenCacheConfig(piece_chars=48, min_chars=0)
TEXT = " ".join(f"The cafe's naive word{i}, (don't) stop: {i * 7}" for i in range(120))


def _encoder(name: str, shared: SharedPieces | None, config: TokenCacheConfig = CONFIG) -> PieceEncoder:
    """A fresh encoder (its own, cold, per-process cache) over ``shared``."""
    tok, text = _tokenizers()[name]
    return PieceEncoder(tok, config, tokenizer_json=text, shared=shared)


def _plain(name: str, text: str) -> list[int]:
    return _tokenizers()[name][0].encode(text, add_special_tokens=False).ids


def _num_pieces(text: str, config: TokenCacheConfig = CONFIG) -> int:
    return len(safe_cuts(text, config.piece_chars)) + 1


@pytest.mark.parametrize("name", ["preset-bpe", "qwen2-nfc"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts)
def test_pieces_from_the_shared_level_equal_the_plain_ids(name, text):
    """A second encoder with a cold cache takes every piece from the shared level, and its ids equal one plain
    encode (fails when the shared lookup in PieceEncoder._pieces_ids is removed: the second encoder encodes)."""
    config = TokenCacheConfig(piece_chars=4, min_chars=0)
    with tempfile.TemporaryDirectory() as directory:
        first = _encoder(name, SharedPieces(TokenShareConfig(directory)), config)
        second = _encoder(name, SharedPieces(TokenShareConfig(directory)), config)
        plain = _plain(name, text)
        assert first.encode(text) == plain
        assert second.encode(text) == plain
        assert second.num_encoded == 0
        third = _encoder(name, SharedPieces(TokenShareConfig(directory)), config)
        assert third.encode_array(text).tolist() == plain and third.num_encoded == 0  # the shared arrays joined


def test_a_second_encoder_reads_what_the_first_wrote(tmp_path):
    """Fails when the shared lookup is removed (the second encoder then encodes every piece)."""
    first = _encoder("preset-bpe", SharedPieces(TokenShareConfig(str(tmp_path))))
    assert first.encode(TEXT) == _plain("preset-bpe", TEXT)
    assert first.num_encoded == _num_pieces(TEXT) > 10
    second = _encoder("preset-bpe", SharedPieces(TokenShareConfig(str(tmp_path))))
    assert second.encode(TEXT) == _plain("preset-bpe", TEXT)
    assert second.num_encoded == 0 and second.shared.num_hits == _num_pieces(TEXT)
    alone = _encoder("preset-bpe", None)  # the negative control: no shared level, every piece encoded
    assert alone.encode(TEXT) == _plain("preset-bpe", TEXT) and alone.num_encoded == _num_pieces(TEXT)


def _entry_paths(directory) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".ids"))


def _spoil(path: str, how: str, directory) -> None:
    with open(path, "rb") as f:
        data = bytearray(f.read())
    if how == "flipped_id":
        data[HEADER.size] ^= 1
    elif how == "truncated":
        data = data[:-2]
    elif how == "extended":
        data += b"\0\0\0\0"
    elif how == "empty":
        data = bytearray()
    elif how == "version":
        data[8] = FORMAT_VERSION + 1
    elif how == "piece_length":
        data[8 + 4 + 32] ^= 1
    elif how == "symlink":
        os.unlink(path)
        target = os.path.join(directory, "elsewhere")
        with open(target, "wb") as f:
            f.write(data)
        os.symlink(target, path)
        return
    with open(path, "wb") as f:
        f.write(data)


@pytest.mark.parametrize("how", ["flipped_id", "truncated", "extended", "empty", "version", "piece_length", "symlink"])
def test_a_spoiled_entry_is_encoded_instead(tmp_path, how):
    """Every entry spoiled one way: the second encoder encodes every piece, and its ids equal a plain encode
    (fails, with ids that differ from plain, when unpack_entry's checksum or header comparison is dropped)."""
    _encoder("preset-bpe", SharedPieces(TokenShareConfig(str(tmp_path)))).encode(TEXT)
    for path in _entry_paths(tmp_path):
        _spoil(path, how, tmp_path)
    second = _encoder("preset-bpe", SharedPieces(TokenShareConfig(str(tmp_path))))
    assert second.encode(TEXT) == _plain("preset-bpe", TEXT)
    assert second.num_encoded == _num_pieces(TEXT)


def test_another_tokenizers_entry_is_not_taken(tmp_path):
    """An entry of tokenizer A under the name tokenizer B looks for: B encodes (fails when the header's identity
    is not compared: B would get A's ids)."""
    a = _encoder("preset-bpe", SharedPieces(TokenShareConfig(str(tmp_path))))
    b = _encoder("gpt2", SharedPieces(TokenShareConfig(str(tmp_path))))
    a.encode(TEXT)
    for path in _entry_paths(tmp_path):
        name = os.path.basename(path)
        os.rename(path, os.path.join(tmp_path, b.identity + name[len(a.identity) :]))
    assert b.encode(TEXT) == _plain("gpt2", TEXT) != _plain("preset-bpe", TEXT)
    assert b.num_encoded == _num_pieces(TEXT)


def test_unpack_checks_every_header_field():
    identity, piece, ids = b"i" * 16, b"p" * 16, [1, 70000, 3]
    data = pack_entry(identity, piece, 9, ids)
    assert unpack_entry(data, identity, piece, 9).tolist() == ids
    assert unpack_entry(data, b"j" * 16, piece, 9) is None
    assert unpack_entry(data, identity, b"q" * 16, 9) is None
    assert unpack_entry(data, identity, piece, 10) is None
    assert unpack_entry(b"X" + data[1:], identity, piece, 9) is None
    assert unpack_entry(data[: HEADER.size - 1], identity, piece, 9) is None


def test_the_directory_is_bounded_least_recently_used_out(tmp_path):
    """After every write the directory holds at most max_bytes (fails when trim is not called from put_many),
    and the entry read last stays."""
    size = len(pack_entry(b"i" * 16, b"p" * 16, 40, list(range(40))))
    shared = SharedPieces(TokenShareConfig(str(tmp_path), max_bytes=size * 16))
    identity = b"i" * 16
    first = (identity, b"0" * 16, 40, list(range(40)))
    shared.put_many([first])
    for n in range(1, 60):
        shared.put_many([(identity, n.to_bytes(16, "little"), 40, list(range(40)))])
        if n % 8 == 0:
            os.utime(os.path.join(tmp_path, entry_name(*first[:2])), (1, 1))  # last used long ago
            assert shared.get(*first[:3]).tolist() == first[3]  # touched: the most recently used
        assert sum(os.path.getsize(p) for p in _entry_paths(tmp_path)) <= size * 16
    assert shared.get(*first[:3]).tolist() == first[3]
    assert shared.get(identity, (1).to_bytes(16, "little"), 40) is None  # the oldest went


def test_stale_temporary_files_are_removed(tmp_path):
    stale = tmp_path / ".tmp-1-2"
    stale.write_bytes(b"half")
    os.utime(stale, (1, 1))
    SharedPieces(TokenShareConfig(str(tmp_path)))
    assert not stale.exists()


def test_a_directory_others_may_write_is_refused(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    with pytest.raises(UserError, match="chmod 700"):
        SharedPieces(TokenShareConfig(str(open_dir)))
    created = tmp_path / "new" / "tokens"
    SharedPieces(TokenShareConfig(str(created)))
    assert os.stat(created).st_mode & 0o777 == 0o700


def _encode_in_child(directory: str | None, queue) -> None:
    from kvshare.engine.token_share import SharedPieces, TokenShareConfig

    shared = SharedPieces(TokenShareConfig(directory)) if directory else None
    encoder = _encoder("preset-bpe", shared)
    queue.put((encoder.encode(TEXT), encoder.num_encoded))


def _run_child(directory: str | None) -> tuple[list[int], int]:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_encode_in_child, args=(directory, queue))
    proc.start()
    result = queue.get(timeout=60)
    proc.join(timeout=30)
    assert proc.exitcode == 0
    return result


def test_two_processes_share_pieces(tmp_path):
    """The second process encodes nothing; without the shared level (the negative control) it encodes every
    piece."""
    plain = _plain("preset-bpe", TEXT)
    assert _run_child(str(tmp_path)) == (plain, _num_pieces(TEXT))
    assert _run_child(str(tmp_path)) == (plain, 0)
    assert _run_child(None) == (plain, _num_pieces(TEXT))


def test_serve_and_up_share_one_directory(tmp_path):
    """kvshare serve takes --token-cache-dir (off by default); kvshare up gives every built-in replica its
    cluster's private one."""
    from kvshare.cli import build_parser
    from kvshare.launch import Cluster, ClusterConfig

    args = build_parser().parse_args(["serve"])
    assert args.token_cache_dir is None
    args = build_parser().parse_args(["serve", "--token-cache-dir", str(tmp_path), "--token-cache-size", "1MiB"])
    assert (args.token_cache_dir, args.token_cache_size) == (str(tmp_path), 1 << 20)
    cluster = Cluster(ClusterConfig(num_replicas=2))
    try:
        dirs = {
            argv[argv.index("--token-cache-dir") + 1] for argv, _env in map(cluster._replica_command, (0, 1), ([], []))
        }
        assert len(dirs) == 1
        SharedPieces(TokenShareConfig(dirs.pop()))  # private: accepted
    finally:
        cluster.stop()


def test_entry_names_keep_tokenizers_apart():
    assert entry_name(b"a" * 16, b"p" * 16) != entry_name(b"b" * 16, b"p" * 16)


def test_serve_gives_its_tokenizer_the_shared_level(tmp_path, monkeypatch):
    """--token-cache-dir DIR reaches the engine's tokenizer; 'off' leaves it without; a directory others may write
    is refused with a one-line error (fails when build_engine does not attach the level)."""
    from types import SimpleNamespace

    import kvshare.engine.engine
    from kvshare.cli import build_parser
    from kvshare.commands.serve import build_engine
    from kvshare.engine.tokenizer import Tokenizer

    # the engine's model is not what is tested: a stand-in with the real tokenizer class
    monkeypatch.setattr(
        kvshare.engine.engine, "Engine", lambda config: SimpleNamespace(tokenizer=Tokenizer.byte_level(64))
    )
    engine = build_engine(build_parser().parse_args(["serve", "--token-cache-dir", str(tmp_path / "t")]))
    assert engine.tokenizer._pieces.shared.directory == str(tmp_path / "t")
    engine = build_engine(build_parser().parse_args(["serve", "--token-cache-dir", "off"]))
    assert engine.tokenizer._pieces.shared is None
    os.chmod(tmp_path, 0o777)
    with pytest.raises(UserError, match="--token-cache-dir"):
        build_engine(build_parser().parse_args(["serve", "--token-cache-dir", str(tmp_path)]))
