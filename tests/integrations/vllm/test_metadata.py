"""What the scheduler side tells the worker side: a load names its pages by the lease's own PageHeaders."""

from __future__ import annotations

import pickle

from kvshare.integrations.vllm.metadata import LoadSpec
from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.protocol import FORMAT_VERSION, PageHeader


def test_a_load_spec_carries_the_leased_headers_whole_across_processes():
    """vLLM pickles the step's metadata to a worker in another process: every field of each page (its format
    version too) arrives. Fails when a load's pages are not picklable or lose a field of the lease's header."""
    pages = (
        PageHeader(offset=0, page_bytes=4096, checksum=7),
        PageHeader(offset=4096, page_bytes=4096, checksum=2**64 - 1, checksum_kind=ChecksumKind.WSUM32),
    )
    spec = LoadSpec("r", b"p" * 16, 1, pages, (b"a" * 16, b"b" * 16), 16, 48, (3, 4))
    arrived = pickle.loads(pickle.dumps(spec))
    assert arrived == spec and arrived.pages == pages
    assert [p.format_version for p in arrived.pages] == [FORMAT_VERSION] * 2
    assert hash(arrived) == hash(spec)  # frozen, as the rest of the step's plan
