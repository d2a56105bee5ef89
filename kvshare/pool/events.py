"""KV events in vLLM's wire format (vllm/distributed/kv_events.py), for routers that read vLLM's events.

A publisher sends one ZMQ multipart message per batch, on each of its topics::

    | topic (utf-8) | seq: 8-byte big-endian | msgpack EventBatch |

``EventBatch`` is an array ``[ts, events, data_parallel_rank]``; each event is a tagged struct,
map-encoded (``{"type": "BlockStored", "block_hashes": [...], ...}``, vLLM >= 0.26) by default or
positional (``["BlockStored", [...], ...]``, older vLLM) behind ``encoding="positional"``. A replay
socket (ZMQ ROUTER) answers a client's 8-byte start sequence with every buffered batch from it on,
then one message whose sequence is -1.

Pure: structs, hash conversion and one encode/decode path; no sockets (event_publisher.py has them).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

MEDIUM_CPU = "CPU"  # a pool page: llm-d and Dynamo score an unknown medium as if it were on the GPU
MEDIUM_GPU = "GPU"  # a block in a replica's own (GPU) prefix cache
SEQ_BYTES = 8
END_SEQ = -1  # the replay's last message carries this sequence
ENCODINGS = ("map", "positional")
HASH_KINDS = ("int", "bytes")


Event = TypeVar("Event")


class EventBatch(msgspec.Struct, Generic[Event], kw_only=True, array_like=True, omit_defaults=True, gc=False):
    """``EventBatch[MapEvent]`` and ``EventBatch[PositionalEvent]`` decode one encoding's events (a subclass that
    redeclared ``events`` would move it first: msgspec orders a redeclared keyword-only field before the others)."""

    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


# -- map-encoded events (vLLM >= 0.26): the fields vLLM declares without a default are always sent ---------


class BlockStored(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None


class BlockRemoved(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False, tag=True):
    pass


# -- positional events (older vLLM): ["BlockStored", hashes, parent, tokens, block_size, lora_id, medium] ----


class PositionalBlockStored(
    msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"
):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class PositionalBlockRemoved(
    msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"
):
    block_hashes: list[int | bytes]
    medium: str | None


class PositionalAllBlocksCleared(
    msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"
):
    pass


MapEvent = BlockStored | BlockRemoved | AllBlocksCleared
PositionalEvent = PositionalBlockStored | PositionalBlockRemoved | PositionalAllBlocksCleared
_REMOVED = {"map": BlockRemoved, "positional": PositionalBlockRemoved}
_CLEARED = {"map": AllBlocksCleared, "positional": PositionalAllBlocksCleared}


_encoder = msgspec.msgpack.Encoder()
_decoders = {
    "map": msgspec.msgpack.Decoder(EventBatch[MapEvent]),
    "positional": msgspec.msgpack.Decoder(EventBatch[PositionalEvent]),
}


def check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def external_hash(key: bytes, kind: str) -> int | bytes:
    """A chunk key as an event's block hash: its low 64 bits as an unsigned int (vLLM's default), or its bytes."""
    if kind == "bytes":
        return key
    return int.from_bytes(key, "big") & ((1 << 64) - 1)


def block_stored(
    encoding: str,
    hashes: list[int | bytes],
    parent: int | bytes | None,
    token_ids: list[int],
    block_size: int,
    medium: str = MEDIUM_CPU,
) -> BlockStored | PositionalBlockStored:
    """Blocks now held (the pool's: ``medium="CPU"``; a replica's prefix cache: ``"GPU"``), no LoRA (its bytes
    are in the key's namespace)."""
    fields = dict(
        block_hashes=hashes, parent_block_hash=parent, token_ids=token_ids, block_size=block_size, lora_id=None
    )
    if encoding == "map":
        return BlockStored(**fields, medium=medium, lora_name=None)
    return PositionalBlockStored(**fields, medium=medium)


def block_removed(
    encoding: str, hashes: list[int | bytes], medium: str = MEDIUM_CPU
) -> BlockRemoved | PositionalBlockRemoved:
    return _REMOVED[encoding](block_hashes=hashes, medium=medium)


def all_blocks_cleared(encoding: str) -> AllBlocksCleared | PositionalAllBlocksCleared:
    return _CLEARED[encoding]()


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes, encoding: str = "map") -> EventBatch:
    """One batch's payload; raises ValueError with a one-line reason when it is not a batch of ``encoding``."""
    try:
        return _decoders[encoding].decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a {encoding}-encoded KV event batch: {exc}") from None


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def seq_of(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a sequence frame has {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
