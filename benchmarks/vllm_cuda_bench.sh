#!/usr/bin/env bash
# The vLLM connector's worker-side copies on a GPU, with vLLM-0.32-shaped flash-attention tensors
# (no vLLM: it cannot be installed on the GPU machine). Qwen3-8B KV shape, bf16, one request of
# TOKENS tokens: store (device blocks -> pool pages, checksummed) and load (pool -> device blocks,
# checksums verified), against a plain pageable host -> device copy of the same bytes as reference.
#
#   benchmarks/vllm_cuda_bench.sh [TOKENS]        (on the GPU machine: run with carry [".whl"])
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ! $PY -c "import msgspec" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
TOKENS=${1:-32768} $PY - <<'EOF'
import os, time, torch
from kvshare.integrations.vllm.layout import detect_layout
from kvshare.integrations.vllm.metadata import WorkerReport
from kvshare.integrations.vllm.options import ConnectorConfig
from kvshare.pool.link import PoolLink
from kvshare.integrations.vllm.scheduler import PoolScheduler, ScheduledRequest
from kvshare.integrations.vllm.worker import PoolKVWorker
from kvshare.keys import Namespace
from kvshare.layout import KVLayout
from kvshare.pool.spawn import running_pool

L, H, D, N, C, T = 36, 8, 128, 16, 256, int(os.environ["TOKENS"])
layout = KVLayout(L, H, D, "bfloat16", C)
ns = Namespace("qwen3-8b-shape", "0" * 32, "bfloat16", L, H, D, C, engine_family="vllm")
blocks = T // N + 8
size = f"{(T // C + 2) * layout.page_bytes // 2**20 + 512}MiB"
with running_pool(size, ("--extent-size", "512MiB", "--prefault")) as sock:
    def side(name):
        cfg = ConnectorConfig(pool_socket=sock, replica=name)
        layers = [torch.randn(blocks, N, H, 2 * D, device="cuda", dtype=torch.bfloat16).permute(0, 2, 1, 3) for _ in range(L)]
        worker = PoolKVWorker(layout, PoolLink(sock, name + "w"))
        worker.register(layers, detect_layout("FLASH_ATTN", layers[0], H, D, N, torch.bfloat16))
        return PoolScheduler(cfg, ns, layout.page_bytes, N, PoolLink(sock, name + "s")), worker
    (sa, wa), (sb, wb) = side("A"), side("B")
    prompt = list(range(T + 1))
    sa.add_request("a", prompt, None, None); sa.match("a", 0); sa.allocated("a", 0, 0)
    plan = sa.plan_step([ScheduledRequest("a", 0, T + 1, list(range(blocks)))])
    torch.cuda.synchronize(); t = time.perf_counter()
    for spec in plan.stores:
        wa.store(spec)
    store_s = time.perf_counter() - t
    nbytes = wa.counters.store_bytes
    for i in range(3):
        rid = f"b{i}"
        sb.add_request(rid, prompt, None, None); n = sb.match(rid, 0); sb.allocated(rid, n, 0)
        plan = sb.plan_step([ScheduledRequest(rid, n, T + 1 - n, list(range(blocks))[::-1])])
        torch.cuda.synchronize(); t = time.perf_counter()
        out = wb.load(plan.loads[0]); torch.cuda.synchronize()
        load_s = time.perf_counter() - t
        sb.on_report(WorkerReport([out])); sb.finish(rid)
        assert out.is_complete
    host = torch.empty(nbytes, dtype=torch.uint8); dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host); torch.cuda.synchronize(); t = time.perf_counter(); dev.copy_(host); torch.cuda.synchronize()
    ref_s = time.perf_counter() - t
    gb = nbytes / 1e9
    # where the load's time goes: checksums over mapped pages (first pass pays the page faults), H2D, scatter
    from kvshare.pool.checksum import page_checksum
    client = wb.link.client()
    pages = plan.loads[0].pages
    first_offset = pages[0].offset
    fresh = PoolLink(sock, "probe").client()  # a new mapping: its first pass faults every page in
    for label, c in (("checksums, fresh mapping", fresh), ("checksums, mapped", fresh)):
        t = time.perf_counter()
        for ref in pages:
            page_checksum(c.page(ref.offset, ref.page_bytes))
        print(f"{label}: {time.perf_counter() - t:.3f} s")
    contiguous = all(p.offset == first_offset + i * layout.page_bytes for i, p in enumerate(pages))
    run = torch.from_numpy(client.run(first_offset, layout.page_bytes, len(pages))) if contiguous else None
    if run is not None:
        torch.cuda.synchronize(); t = time.perf_counter(); on_dev = run.to("cuda"); torch.cuda.synchronize()
        print(f"pool run -> device (pageable, one copy): {time.perf_counter() - t:.3f} s")
    print(f"{T} tokens, {nbytes / 2**30:.2f} GiB of KV (Qwen3-8B shape, bf16), {torch.cuda.get_device_name()}")
    print(f"store (device -> pool, checksummed): {store_s:.3f} s, {gb / store_s:.1f} GB/s")
    print(f"load (pool -> device, verified; last of 3): {load_s:.3f} s, {gb / load_s:.1f} GB/s")
    print(f"reference pageable host -> device copy: {ref_s:.3f} s, {gb / ref_s:.1f} GB/s; load / reference = {ref_s / load_s:.2f}")
EOF
