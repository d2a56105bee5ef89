"""The engine over CudaTransfer (the fake CUDA of tests/transfer/fake_cuda.py, on CPU): WSUM32 pages, their check
beside the copies, and the recompute from a page that failed it after the forward had read it."""

from __future__ import annotations

import pytest

from kvshare.engine import pool_kv
from kvshare.engine.config import EngineConfig
from kvshare.engine.engine import Engine, RequestOptions
from kvshare.keys import chunk_keys, namespace_digest
from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.client import PoolClient
from kvshare.transfer import TransferConfig
from tests.engine.conftest import ascii_prompt
from tests.engine.test_reuse import COLD, run
from tests.transfer import fake_cuda

CHUNK = 16
NO_LOCAL = RequestOptions(use_local_cache=False)


@pytest.fixture
def staged(monkeypatch):
    """Engines on CPU whose pool link moves KV with CudaTransfer (staging, WSUM32) instead of CpuTransfer."""
    from kvshare.transfer.cuda import CudaTransfer

    fake_cuda.install(monkeypatch, fake_cuda.FakeCuda())
    monkeypatch.setattr(
        pool_kv,
        "make_transfer",
        lambda layout, client, device, config: CudaTransfer(
            layout, client, device, TransferConfig(**{**config.__dict__, "copy_method": "torch"})
        ),
    )


def test_a_page_bad_after_commit_is_recomputed_after_the_forward(tiny_dir, pool_socket, staged):
    def engine() -> Engine:
        return Engine(EngineConfig(model=tiny_dir, chunk_tokens=CHUNK, pool_socket=pool_socket, verify_checksums=True))

    engines = [engine()]  # closed below while the fake CUDA is installed: their pins go under it
    try:
        writer = engines[0]
        ids = writer.tokenizer.encode(ascii_prompt(80, seed=31))
        cold, _ = run(writer, ids, COLD)
        run(writer, ids)  # stores chunks 0..4, WSUM32 summed over the staged bytes
        keys = chunk_keys(namespace_digest(writer.namespace), ids, CHUNK)
        with PoolClient(pool_socket) as client:
            pages = client.lookup(keys, writer.layout.page_bytes, lease=False).pages
            assert len(pages) == 5 and {p.checksum_kind for p in pages} == {ChecksumKind.WSUM32}
            client.page(pages[2].offset, pages[2].page_bytes)[3::4] ^= 0x80  # chunk 2 (tokens 32..47) goes bad
        engines.append(engine())
        reader = engines[-1]
        assert run(reader, ids, NO_LOCAL) == (cold, (0, 32, 48))  # checked beside the copies; computed from chunk 2
        stats = reader.stats()
        assert (stats.checksum_failures, stats.dropped_chunks) == (1, 1)
        engines.append(engine())
        again = engines[-1]
        assert run(again, ids, NO_LOCAL) == (cold, (0, 64, 16))  # the reader stored a good chunk 2 in its place
        assert again.stats().checksum_failures == 0
    finally:
        for each in engines:
            each.close()
