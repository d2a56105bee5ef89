"""Checksum kinds: WSUM32 (a GPU computes it) equals its definition and catches every one-word change;
the kind recorded at commit comes back with every lookup, over the wire and through the index."""

import msgspec
import numpy as np
import pytest
import torch

from kvshare.pool import protocol as P
from kvshare.pool.checksum import ChecksumKind, block_words, page_checksum, wsum32, wsum32_reference
from kvshare.pool.wsum import add_rows, as_unsigned, page_sums
from tests.pool.test_handlers import NS, PAGE, greet, keys, make


@pytest.mark.parametrize("num_bytes", [4, 8, 12, 4092, 4096, 4100, 3 * 4 * 1000 + 8])
def test_wsum32_is_its_definition_on_the_host_and_in_torch(num_bytes):
    data = np.random.default_rng(num_bytes).integers(0, 256, num_bytes, dtype=np.uint8)
    expected = wsum32_reference(data)
    assert wsum32(data) == expected
    assert as_unsigned(page_sums(torch.from_numpy(data.copy()).view(1, -1))) == [expected]


@pytest.mark.parametrize("word", [0x7FFFFFFF, -0x80000000, -1])
def test_wsum32_wraps_mod_2_64_alike_in_numpy_and_torch(word):
    words = np.full(1 << 21, word, dtype="<i4")  # sums far beyond 2**64
    weights = np.arange(1, words.size + 1, dtype=np.uint64)
    expected = int((words.astype(np.int64).view(np.uint64) * weights).sum(dtype=np.uint64))
    assert wsum32(words.view(np.uint8)) == expected
    assert as_unsigned(page_sums(torch.from_numpy(words.copy()).view(1, -1))) == [expected]


def test_wsum32_of_a_page_summed_in_pieces_in_any_order_is_the_pages():
    page = np.random.default_rng(1).integers(0, 256, 6 * 4096, dtype=np.uint8)
    words = torch.from_numpy(page.copy()).view(torch.int32)
    acc = torch.zeros(1, dtype=torch.int64)
    for piece in (4, 1, 5, 0, 3, 2):
        add_rows(acc, words[piece * 1024 : (piece + 1) * 1024].view(1, -1), piece * 1024)
    assert as_unsigned(acc) == [wsum32(page)]
    assert as_unsigned(page_sums(torch.from_numpy(np.stack([page, page[::-1].copy()])))) == [
        wsum32(page),
        wsum32(page[::-1].copy()),
    ]


def test_every_flipped_byte_and_every_swap_of_two_words_changes_wsum32():
    page = np.random.default_rng(2).integers(0, 256, 2048, dtype=np.uint8)
    base = wsum32(page)
    for position in range(page.size):  # every byte, each with a random nonzero xor
        damaged = page.copy()
        damaged[position] ^= 1 + position % 255
        assert wsum32(damaged) != base, position
    words = page.view("<i4")
    rng = np.random.default_rng(3)
    for _ in range(200):
        i, j = rng.choice(words.size, 2, replace=False)
        if words[i] == words[j]:
            continue
        swapped = words.copy()
        swapped[[i, j]] = swapped[[j, i]]
        assert wsum32(swapped.view(np.uint8)) != base


def test_page_checksum_by_kind_and_odd_sizes_refused():
    data = np.arange(64, dtype=np.uint8)
    assert page_checksum(data) == page_checksum(data, ChecksumKind.XXH3) != page_checksum(data, ChecksumKind.WSUM32)
    assert page_checksum(data, ChecksumKind.WSUM32) == wsum32_reference(data)
    with pytest.raises(ValueError, match="whole number of 32-bit words"):
        wsum32(np.zeros(6, dtype=np.uint8))
    assert block_words(1 << 20) == 1024 and block_words(3 * 512) == 512 and block_words(7) == 1


def test_the_kind_recorded_at_commit_comes_back_with_each_lookup():
    handlers, _, _ = make()
    greet(handlers, 1)
    cpu_keys, gpu_keys = keys("cpu", 2), keys("gpu", 2)
    for ks, kind in ((cpu_keys, None), (gpu_keys, ChecksumKind.WSUM32)):
        reserved = handlers.handle(1, P.Reserve(namespace=NS, keys=ks, page_bytes=PAGE))
        commit = (
            P.Commit(reservation_id=reserved.reservation_id, checksums=[5, 6])
            if kind is None
            else P.Commit(reservation_id=reserved.reservation_id, checksums=[5, 6], checksum_kind=kind)
        )
        assert handlers.handle(1, commit) == P.Ok(count=2)
    assert [p.checksum_kind for p in handlers.handle(2, P.Lookup(keys=cpu_keys, page_bytes=PAGE)).pages] == [
        ChecksumKind.XXH3
    ] * 2
    assert [p.checksum_kind for p in handlers.handle(2, P.Lookup(keys=gpu_keys, page_bytes=PAGE)).pages] == [
        ChecksumKind.WSUM32
    ] * 2


def test_kinds_cross_the_wire_and_unknown_kinds_are_refused_as_malformed():
    commit = P.Commit(reservation_id=7, checksums=[1, 2**64 - 1], checksum_kind=ChecksumKind.WSUM32)
    frame = P.encode(commit)
    assert P.decode_request(frame[P.FRAME_HEADER.size :]) == commit
    reply = P.LookupReply(
        lease_id=3,
        pages=[
            P.PageHeader(offset=0, page_bytes=PAGE, checksum=9, checksum_kind=ChecksumKind.WSUM32),
            P.PageHeader(offset=PAGE, page_bytes=PAGE, checksum=8),
        ],
    )
    decoded = P.decode_reply(P.encode(reply)[P.FRAME_HEADER.size :])
    assert [p.checksum_kind for p in decoded.pages] == [ChecksumKind.WSUM32, ChecksumKind.XXH3]
    payload = msgspec.msgpack.encode({"type": "commit", "reservation_id": 7, "checksums": [1], "checksum_kind": 9})
    with pytest.raises(P.ProtocolError):  # a kind this pool does not know is refused by its type, never stored
        P.decode_request(payload)
    assert P.PROTOCOL_VERSION >= 2
