"""Moving KV between the pool's pages and engines (CPU and CUDA), and the byte checks that prove it.

Start from ``make_transfer(layout, client, device, config)`` (``factory.py``); the interface
is in ``base.py``, the one GPU staging pipeline both engines use in ``pipeline.py``, the
built-in engine's layout conversions in ``layouts.py`` with their slow oracles in ``reference.py``, the byte round-trip
self-test in ``bytecheck.py`` (one round trip: ``roundtrip.py``; CUDA ordering: ``ordercheck.py``); a hybrid model's
state checkpoints move in ``state.py``.
"""

from kvshare.transfer.base import (
    ChunkChecksumMismatch,
    KVTransfer,
    LoadHandle,
    TransferConfig,
)
from kvshare.transfer.factory import make_transfer
from kvshare.transfer.state import StateChecksumMismatch, StateLoad

__all__ = [
    "ChunkChecksumMismatch",
    "KVTransfer",
    "LoadHandle",
    "StateChecksumMismatch",
    "StateLoad",
    "TransferConfig",
    "make_transfer",
]
