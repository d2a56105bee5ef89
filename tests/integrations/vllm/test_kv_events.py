"""The pool's KV events decode unchanged with vLLM's own event classes (vllm.distributed.kv_events).

Suite ``vllm`` (run with the vLLM environment's python).
"""

import hashlib
import time

import numpy as np
import pytest

from kvshare.pool import events as E
from kvshare.pool.allocator import Allocator
from kvshare.pool.event_publisher import EventPublisher, KVEventsConfig, PoolEvents
from kvshare.pool.index import IndexConfig, PoolIndex

pytestmark = [pytest.mark.vllm]
kv_events = pytest.importorskip("vllm.distributed.kv_events")
msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

MiB = 1 << 20


def test_a_batch_decodes_with_vllms_classes_field_for_field():
    """Fails when a field vLLM declares without a default (e.g. lora_name) is left out of BlockStored."""
    events = [
        E.all_blocks_cleared("map"),
        E.block_stored("map", [1, 2], 9, list(range(8)), 4),
        E.block_removed("map", [2]),
    ]
    payload = E.encode_batch(E.EventBatch(ts=2.0, events=events, data_parallel_rank=0))
    batch = msgspec.msgpack.Decoder(kv_events.KVEventBatch).decode(payload)
    cleared, stored, removed = batch.events
    assert isinstance(cleared, kv_events.AllBlocksCleared)
    assert isinstance(stored, kv_events.BlockStored) and isinstance(removed, kv_events.BlockRemoved)
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size) == (
        [1, 2],
        9,
        list(range(8)),
        4,
    )
    assert stored.medium == kv_events.MEDIUM_CPU and stored.lora_name is None
    assert removed.block_hashes == [2] and batch.data_parallel_rank == 0


def test_replayed_frames_from_the_publisher_decode_with_vllms_classes(tmp_path):
    config = KVEventsConfig(
        endpoint=f"ipc://{tmp_path}/ev", replay_endpoint=f"ipc://{tmp_path}/rep", topics=("kv@r0@tiny",)
    )
    index = PoolIndex(Allocator(8 * MiB, 4 * MiB), IndexConfig())
    events = PoolEvents(config, EventPublisher(config))
    index.listener = events
    keys = [hashlib.blake2b(bytes([i]), digest_size=16).digest() for i in range(3)]
    res = index.reserve(1, b"n" * 16, keys, MiB, 0, now=0.0, tokens_le32=np.arange(12, dtype="<u4").tobytes())
    index.commit(1, res.reservation_id, [0, 0, 0])
    index.flush()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(config.replay_endpoint)
    decoder = msgspec.msgpack.Decoder(kv_events.KVEventBatch)
    seen = []
    try:
        deadline = time.monotonic() + 10
        while len([e for e in seen if isinstance(e, kv_events.BlockRemoved)]) < 3 and time.monotonic() < deadline:
            seen = []
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                assert dealer.poll(5000)
                _, topic, seq, payload = dealer.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                assert topic == b"kv@r0@tiny"
                seen += decoder.decode(payload).events
    finally:
        dealer.close(linger=0)
        ctx.term()
        events.close()
    assert isinstance(seen[0], kv_events.AllBlocksCleared)
    stored = [e for e in seen if isinstance(e, kv_events.BlockStored)]
    assert [e.token_ids for e in stored] == [list(range(4 * i, 4 * i + 4)) for i in (0, 1, 2)]
    assert len([e for e in seen if isinstance(e, kv_events.BlockRemoved)]) == 3
