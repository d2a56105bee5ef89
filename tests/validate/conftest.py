"""Fixtures of the validate tests: a small pool, in-process tiny engines, a cluster with the audit on."""

from __future__ import annotations

import pytest

from kvshare.pool.spawn import running_pool

CHUNK = 16  # in-process engines: small chunks keep the tiny model's prompts short


@pytest.fixture(scope="module")
def pool_socket():
    """A 64 MiB pool with 8 MiB extents that keeps every committed page (one per test module)."""
    with running_pool(
        "64MiB", ("--extent-size", "8MiB", "--high-watermark", "1", "--low-watermark", "1"), quiet=True
    ) as path:
        yield path


@pytest.fixture(scope="module")
def writer(pool_socket):
    """A tiny engine on the pool (tests use prompts of their own, so sharing it is safe)."""
    engine = make_engine(pool_socket)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def replica(pool_socket):
    """A second engine on the same pool that does not verify checksums (what a poisoned page needs)."""
    engine = make_engine(pool_socket, verify=False)
    yield engine
    engine.close()


def make_engine(pool_socket: str | None, verify: bool = False):
    from kvshare.engine.config import EngineConfig
    from kvshare.engine.engine import Engine

    return Engine(EngineConfig(model="tiny", chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=verify))


def corrupt_chunk(pool_socket: str, engine, prompt_ids: list[int], chunk: int) -> None:
    """Flip the sign of every float32 of one committed chunk's page (as a writer that copied too early might)."""
    from kvshare.keys import chunk_keys, namespace_digest
    from kvshare.pool.client import PoolClient

    keys = chunk_keys(namespace_digest(engine.namespace), prompt_ids, engine.layout.chunk_tokens)
    with PoolClient(pool_socket) as client:
        pages = client.lookup(keys, engine.layout.page_bytes, lease=False).pages
        assert len(pages) > chunk, f"the pool holds {len(pages)} chunks of the prompt"
        client.page(pages[chunk].offset, pages[chunk].page_bytes)[3::4] ^= 0x80


def pool_chunks(pool_socket: str, engine, prompt_ids: list[int]) -> int:
    from kvshare.keys import chunk_keys, namespace_digest
    from kvshare.pool.client import PoolClient

    keys = chunk_keys(namespace_digest(engine.namespace), prompt_ids, engine.layout.chunk_tokens)
    with PoolClient(pool_socket) as client:
        return client.lookup(keys, engine.layout.page_bytes, lease=False).num_pages
