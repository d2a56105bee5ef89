"""Negative control: a corrupted pool page is caught by its checksum, dropped, recomputed; output still right.

Without verification the same corruption changes the output: proof that the corruption
matters, so the verified run's equality is evidence and not an accident.
"""

from __future__ import annotations

from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions
from kvshare.keys import chunk_keys, namespace_digest
from kvshare.pool.client import PoolClient
from tests.engine.conftest import ascii_prompt
from tests.engine.test_reuse import COLD, run

CHUNK = 16
NO_LOCAL = RequestOptions(use_local_cache=False)


def test_corrupted_page_is_caught_dropped_and_recomputed(tiny_dir, pool_socket):
    def engine(verify: bool) -> Engine:
        return Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=verify))

    writer = engine(True)
    ids = writer.tokenizer.encode(ascii_prompt(80, seed=11))
    cold, _ = run(writer, ids, COLD)
    run(writer, ids)  # stores chunks 0..4
    keys = chunk_keys(namespace_digest(writer.namespace), ids, CHUNK)
    with PoolClient(pool_socket) as client:
        pages = client.lookup(keys, writer.layout.page_bytes, lease=False).pages
        assert len(pages) == 5
        page = client.page(pages[2].offset, pages[2].page_bytes)  # chunk 2: tokens 32..47
        page[3::4] ^= 0x80  # flip the sign bit of every float32 of the page (little-endian: byte 3)

    unverified = engine(False)
    tokens, provenance = run(unverified, ids, NO_LOCAL)
    assert provenance == (0, 64, 16)
    assert tokens != cold  # the corruption matters
    assert unverified.stats().checksum_failures == 0

    verified = engine(True)
    tokens, provenance = run(verified, ids, NO_LOCAL)
    assert tokens == cold
    assert provenance == (0, 32, 48)  # chunks 0-1 loaded; from the bad chunk 2 on, computed
    stats = verified.stats()
    assert (stats.checksum_failures, stats.dropped_chunks) == (1, 1)
    # the bad chunk is gone from the pool and the verified engine stored a good one in its place
    assert stats.pool_stored_chunks == 1
    again = engine(True)
    assert run(again, ids, NO_LOCAL) == (cold, (0, 64, 16))
    assert again.stats().checksum_failures == 0
