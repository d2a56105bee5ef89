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
from tests.verdicts import spy_verdicts

CHUNK = 16
NO_LOCAL = RequestOptions(use_local_cache=False)


def test_corrupted_page_is_caught_dropped_and_recomputed(tiny_dir, pool_socket):
    def engine(verify: bool) -> Engine:
        return Engine(
            EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=verify)
        )

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


def test_the_check_and_the_drop_ask_the_one_verification_point(tiny_dir, pool_socket, monkeypatch):
    """The transfer's check before its copy and the engine's search for the pages to drop both ask
    kvshare.pool.checksum about the bad page. Fails when either compares checksums itself: the bad
    page's checksum would reach the spy once, not twice."""
    engine = Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True))
    ids = engine.tokenizer.encode(ascii_prompt(80, seed=23))
    run(engine, ids)  # stores chunks 0..4
    keys = chunk_keys(namespace_digest(engine.namespace), ids, CHUNK)
    with PoolClient(pool_socket) as client:
        bad = client.lookup(keys, engine.layout.page_bytes, lease=False).pages[3]
        client.page(bad.offset, bad.page_bytes)[7] ^= 0x01
    calls = spy_verdicts(monkeypatch)
    _, provenance = run(Engine(engine.config), ids, NO_LOCAL)
    assert provenance == (0, 48, 32)  # chunks 0-2 loaded; from the bad chunk 3 on, computed
    assert [recorded for recorded, _ in calls].count(bad.checksum) == 2
