"""The host's work between a cross-replica request's lease and its first copy (issue 18: 4.6 ms at 262128
tokens on the H200's host, serial before the load): the leased pages' checks (``_page_offsets``), the page
check's set-up (``PageCheck``, every page verified), and the plan of the first layer group (``load_units``),
for the Qwen3-8B shape at 256k (1023 pages in 256 MiB extents) and the Qwen3-32B shape at 128k (499
pages). Best of 30, milliseconds. Runs anywhere (CPU only: no copy is made).

    PYTHONPATH=. python3 benchmarks/diagnostics/diag_host_path.py
"""
import json
import os
import sys
from types import SimpleNamespace

import torch

from kvshare.layout import KVLayout
from kvshare.pool.checksum import ChecksumKind
from kvshare.pool.protocol import PageHeader
from kvshare.transfer.base import KVTransfer
from kvshare.transfer.plan import load_units
from kvshare.transfer.verify import PageCheck

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # diag_parse beside this script
from diag_parse import best_ms  # noqa: E402

MiB = 1 << 20
EXTENT = 256 * MiB
SHAPES = {"qwen3-8b 256k": (36, 1023), "qwen3-32b 128k": (64, 499)}


def main() -> None:
    for name, (num_layers, num_pages) in SHAPES.items():
        layout = KVLayout(num_layers=num_layers, num_kv_heads=8, head_dim=128, dtype="bfloat16", chunk_tokens=256)
        per_extent = EXTENT // layout.page_bytes
        offsets = [(i // per_extent) * EXTENT + (i % per_extent) * layout.page_bytes for i in range(num_pages)]
        pages = [PageHeader(offset=o, page_bytes=layout.page_bytes, checksum=i, checksum_kind=ChecksumKind.WSUM32)
                 for i, o in enumerate(offsets)]
        chosen = list(range(num_pages))
        row = {"shape": name, "pages": num_pages,
               "page_offsets_ms": best_ms(lambda: KVTransfer._page_offsets(SimpleNamespace(layout=layout), pages), 30),
               "page_check_ms": best_ms(lambda: PageCheck(pages, chosen, None, torch.device("cpu"), on_device=True), 30),
               "first_group_plan_ms": best_ms(lambda: next(load_units(offsets, layout, 2 * MiB, 256 * MiB, EXTENT)), 30)}
        row = {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}
        row["total_ms"] = round(row["page_offsets_ms"] + row["page_check_ms"] + row["first_group_plan_ms"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
