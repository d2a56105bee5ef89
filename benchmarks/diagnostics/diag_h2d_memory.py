"""Diagnostic for the H200 (issue 18): host->device bandwidth by the kind of host memory, 1-D and in the
load's 2-D pattern. A pool load reached ~53 GB/s against ~55.9 GB/s for one 1 GiB copy out of
torch's pinned memory; the pool's arena is a memfd of 4 KiB pages registered with cudaHostRegister.

    regions  pinned (cudaHostAlloc via torch) | memfd (4 KiB pages, registered, as the pool's)
             | memfd + MADV_HUGEPAGE (shmem THP, where the kernel allows it) | anonymous + MADV_HUGEPAGE
    copies   one 1 GiB copy (best of 5) | the Qwen3-8B load pattern: 18 copies of 56 rows of 2 MiB at a
             pitch of 36 MiB (a layer group of 56 pages), best of 3

    PYTHONPATH=.:/tmp/site python3 benchmarks/diagnostics/diag_h2d_memory.py
"""
import json
import mmap
import os

import torch
from cuda.bindings import runtime as rt

GiB, MiB = 1 << 30, 1 << 20
SIZE = 2 * GiB
ROW, PITCH, ROWS, GROUPS = 2 * MiB, 36 * MiB, 56, 18


def read(path: str) -> str:
    try:
        return open(path).read().strip()
    except OSError as exc:
        return f"unreadable ({exc})"


def meminfo(*names: str) -> dict:
    out = {}
    for line in open("/proc/meminfo"):
        name, _, rest = line.partition(":")
        if name in names:
            out[name] = rest.strip()
    return out


def bandwidth(host_ptr: int, dev: torch.Tensor, stream: torch.cuda.Stream) -> dict:
    res = {}
    for name, repeats in (("1d_1GiB", 5), ("2d_load_pattern", 3)):
        best = 0.0
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            if name == "1d_1GiB":
                (err,) = rt.cudaMemcpyAsync(dev.data_ptr(), host_ptr, GiB, rt.cudaMemcpyKind.cudaMemcpyHostToDevice,
                                            stream.cuda_stream)
                num = GiB
            else:
                for g in range(GROUPS):
                    (err,) = rt.cudaMemcpy2DAsync(dev.data_ptr() + g * ROWS * ROW, ROW, host_ptr + g * ROW, PITCH, ROW,
                                                  ROWS, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream.cuda_stream)
                num = GROUPS * ROWS * ROW
            assert err == rt.cudaError_t.cudaSuccess, err
            end.record(stream)
            end.synchronize()
            best = max(best, num / (start.elapsed_time(end) / 1e3))
        res[name + "_GBps"] = round(best / 1e9, 2)
    return res


print(json.dumps({"thp_enabled": read("/sys/kernel/mm/transparent_hugepage/enabled"),
                  "thp_shmem_enabled": read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
                  **meminfo("HugePages_Total", "HugePages_Free", "Hugepagesize")}), flush=True)
dev = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
stream = torch.cuda.Stream()
pinned = torch.empty(SIZE, dtype=torch.uint8).pin_memory()
print(json.dumps({"region": "pinned", **bandwidth(pinned.data_ptr(), dev, stream)}), flush=True)
del pinned
for name in ("memfd", "memfd_madv_hugepage", "anonymous_madv_hugepage"):
    if name.startswith("memfd"):
        fd = os.memfd_create("diag", os.MFD_CLOEXEC)
        os.ftruncate(fd, SIZE)
        m = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    else:
        fd, m = None, mmap.mmap(-1, SIZE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ | mmap.PROT_WRITE)
    if "madv" in name:
        m.madvise(mmap.MADV_HUGEPAGE)
    before = meminfo("AnonHugePages", "ShmemHugePages")
    t = torch.frombuffer(m, dtype=torch.uint8)
    t.fill_(1)  # fault every page in
    ptr = t.data_ptr()
    (err,) = rt.cudaHostRegister(ptr, SIZE, 1)  # cudaHostRegisterPortable, as the pool's registration
    row = {"region": name, "register_ok": err == rt.cudaError_t.cudaSuccess, "meminfo_before": before,
           "meminfo_after_touch": meminfo("AnonHugePages", "ShmemHugePages")}
    if row["register_ok"]:
        row.update(bandwidth(ptr, dev, stream))
        rt.cudaHostUnregister(ptr)
    print(json.dumps(row), flush=True)
    del t
    try:
        m.close()
    except BufferError:  # a view still exported: the mapping goes with the process
        pass
    if fd is not None:
        os.close(fd)
