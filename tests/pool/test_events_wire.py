"""A running pool's KV events, read by a subscriber written from vLLM's example
(examples/online_serving/kv_events_subscriber.py): SUB on one topic, msgspec decode, sequence continuity
checked, a gap filled from the replay socket (start sequence -> batches, then -1). The replay client is a
DEALER: the ROUTER answers one request with many messages, and a REQ socket takes only the first."""

import time
from typing import Any

import msgspec
import pytest

from kvshare.pool.client import PoolClient
from kvshare.pool.spawn import running_pool

from .conftest import make_keys

zmq = pytest.importorskip("zmq")

MiB = 1 << 20
CHUNK = 4


# Types as vLLM 0.32 declares them (vllm/distributed/kv_events.py): events map-encoded, tagged by class name.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Subscriber:
    def __init__(self, endpoint, replay_endpoint, topic):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.connect(endpoint)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.replay = self.ctx.socket(zmq.DEALER)
        self.replay.connect(replay_endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.topic = topic.encode()
        self.last_seq = -1
        self.seqs, self.events, self.num_replays = [], [], 0

    def poll(self, timeout_ms=100):
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        assert topic == self.topic
        seq = int.from_bytes(seq_bytes, "big")
        if seq > self.last_seq + 1:  # missed batches: ask the replay socket for them
            self.replay.send_multipart((b"", (self.last_seq + 1).to_bytes(8, "big")))
            self.num_replays += 1
            while True:
                _, r_topic, r_seq_bytes, r_payload = self.replay.recv_multipart()
                r_seq = int.from_bytes(r_seq_bytes, "big", signed=True)
                if r_seq == -1:
                    break
                if r_topic == self.topic and r_seq > self.last_seq:
                    self._process(r_seq, r_payload)
        if seq > self.last_seq:
            self._process(seq, payload)
        return True

    def _process(self, seq, payload):
        assert seq == self.last_seq + 1, f"sequence jumped from {self.last_seq} to {seq}"
        self.last_seq = seq
        self.seqs.append(seq)
        self.events += self.decoder.decode(payload).events

    def close(self):
        self.sub.close(linger=0)
        self.replay.close(linger=0)
        self.ctx.term()


def h(key):
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def store(client, keys, tokens):
    res = client.reserve(b"n" * 16, keys, MiB, token_ids=tokens)
    client.commit(res.reservation_id, [0] * len(res.grants))
    return [keys[i] for i, _ in res.grants]


@pytest.mark.timeout(60)
def test_every_committed_page_once_and_every_removal_through_gaps_and_replay(tmp_path):
    """Fails when the replay socket sends no buffered batch: the late subscriber's gap from sequence 0 is
    never filled ("sequence jumped from -1 to 2")."""
    endpoint, replay = f"ipc://{tmp_path}/ev", f"ipc://{tmp_path}/replay"
    args = (
        "--extent-size",
        "4MiB",
        "--high-watermark",
        "1",
        "--low-watermark",
        "1",
        "--kv-events",
        endpoint,
        "--kv-events-replay",
        replay,
        "--kv-events-topic",
        "kv@r0@tiny",
        "--kv-events-topic",
        "kv@r1@tiny",
    )
    with running_pool("16MiB", args, quiet=True) as path, PoolClient(path) as client:
        chain_a = make_keys("a", 8)
        tokens_a = list(range(8 * CHUNK))
        committed = store(client, chain_a, tokens_a)  # before anyone listens: only replay has these
        sub = Subscriber(endpoint, replay, "kv@r1@tiny")
        try:
            for i in range(100):  # until the subscription is live: probe pages, stored and dropped
                probe = make_keys(f"probe{i}", 1)
                committed += store(client, probe, list(range(CHUNK)))
                client.drop(probe)
                if sub.poll(100):
                    break
            chain_b = make_keys("b", 10)  # 18 pages wanted in 16: pages of chain a are evicted
            committed += store(client, chain_b, None)
            evicted = [k for k in chain_a if not client.lookup([k], MiB, lease=False).pages]
            assert evicted
            client.flush()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                removed = [x for e in sub.events if isinstance(e, BlockRemoved) for x in e.block_hashes]
                if len(removed) == len(committed):
                    break
                sub.poll(100)
            counts = client.stats()["kv_events"]
        finally:
            sub.close()
    assert counts["replays"] >= 1 and counts["events"] >= len(sub.events) and counts["batches"] >= len(sub.seqs)
    assert sub.num_replays >= 1 and sub.seqs == list(range(len(sub.seqs)))
    assert isinstance(sub.events[0], AllBlocksCleared)
    stored = [e for e in sub.events if isinstance(e, BlockStored)]
    assert sorted(x for e in stored for x in e.block_hashes) == sorted(h(k) for k in committed)  # each once
    assert sorted(removed) == sorted(h(k) for k in committed)  # evicted, dropped, flushed: each once
    by_hash = {e.block_hashes[0]: e for e in stored}
    assert by_hash[h(chain_a[1])].parent_block_hash == h(chain_a[0])
    assert by_hash[h(chain_a[1])].token_ids == tokens_a[CHUNK : 2 * CHUNK]
    assert {e.medium for e in stored} == {"CPU"}


def test_a_pool_without_events_is_sent_no_token_ids(pool):
    """A Reserve carries token ids only to a pool that publishes them (hello says so)."""
    with PoolClient(pool) as client:
        assert client.hello.wants_token_ids is False
        granted = store(client, make_keys("quiet", 2), list(range(2 * CHUNK)))
        assert len(granted) == 2
