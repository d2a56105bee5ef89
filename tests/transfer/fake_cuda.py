"""A CPU stand-in for the CUDA pieces CudaTransfer touches, so its data path runs without a GPU.

Streams and events become no-ops (everything runs in program order), staging
buffers live in host memory, cudaHostRegister records ranges, and
cudaMemcpy2DAsync really copies row by row with ``ctypes.memmove`` after
checking what the real one would refuse: a width above a pitch, or a host
range that is not inside one registration ("invalid argument" on the H200).
What this cannot show is stream ordering: that needs the GPU tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import types

import torch


class Err(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorHostMemoryAlreadyRegistered = 712


class Kind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class FakeCuda:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}  # ptr -> bytes
        self.register_calls = 0
        self.fail_register_at: int | None = None  # fail the n-th cudaHostRegister (1-based)
        self.copies_2d: list[tuple] = []
        self.device_ends: list[int] = []  # the device-side pointer of each 2-D copy
        self.free_bytes = 8 << 30  # torch.cuda.mem_get_info's free memory

    # -- torch.cuda.cudart() -------------------------------------------------------------------
    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.register_calls += 1
        if self.fail_register_at == self.register_calls:
            return Err.cudaErrorInvalidValue
        if ptr in self.registered:
            return Err.cudaErrorHostMemoryAlreadyRegistered
        self.registered[ptr] = size
        return Err.cudaSuccess

    def cudaHostUnregister(self, ptr: int) -> int:
        return Err.cudaSuccess if self.registered.pop(ptr, None) is not None else Err.cudaErrorInvalidValue

    def cudaGetErrorString(self, err) -> str:
        return f"fake error {int(err)}"

    def inside_one_registration(self, ptr: int, num_bytes: int) -> bool:
        return any(base <= ptr and ptr + num_bytes <= base + size for base, size in self.registered.items())

    # -- cuda.bindings.runtime -------------------------------------------------------------------
    def runtime_module(self) -> types.ModuleType:
        rt = types.ModuleType("cuda.bindings.runtime")
        rt.cudaError_t = Err
        rt.cudaMemcpyKind = Kind
        rt.cudaGetDevice = lambda: (Err.cudaSuccess, 0)
        rt.cudaSetDevice = lambda index: (Err.cudaSuccess,)
        rt.cudaGetErrorString = lambda err: (Err.cudaSuccess, f"fake error {int(err)}".encode())
        rt.cudaMemcpy2DAsync = self.memcpy_2d
        rt.cudaGetLastError = lambda: (Err.cudaSuccess,)
        return rt

    def memcpy_2d(self, dst, dpitch, src, spitch, width, height, kind, stream):
        if width > dpitch or width > spitch or kind not in (Kind.cudaMemcpyHostToDevice, Kind.cudaMemcpyDeviceToHost):
            return (Err.cudaErrorInvalidValue,)
        host, pitch = (src, spitch) if kind == Kind.cudaMemcpyHostToDevice else (dst, dpitch)
        if not self.inside_one_registration(host, (height - 1) * pitch + width):
            return (Err.cudaErrorInvalidValue,)
        self.copies_2d.append((width, height))
        self.device_ends.append(dst if kind == Kind.cudaMemcpyHostToDevice else src)
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)
        return (Err.cudaSuccess,)


class FakeEvent:
    is_pending = False  # set on the class: every event's work counts as still running (query() is False)

    def __init__(self, enable_timing: bool = False, **_) -> None:
        self.recorded = False

    def record(self, stream=None) -> None:
        self.recorded = True

    def query(self) -> bool:
        return not FakeEvent.is_pending

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def elapsed_time(self, other) -> float:
        return 0.001  # ms; a real event pair never measures exactly zero either


class FakeStream:
    cuda_stream = 0

    def __init__(self, device=None, **_) -> None:
        self.waits = 0

    def wait_event(self, event) -> None:
        self.waits += 1

    def synchronize(self) -> None:
        pass


def install(monkeypatch, fake: FakeCuda, with_bindings: bool = True) -> None:
    """Patch torch.cuda and cuda.bindings for the test's duration (monkeypatch undoes it)."""
    import sys

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (fake.free_bytes, 80 << 30))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    if with_bindings:
        bindings = types.ModuleType("cuda.bindings")
        bindings.runtime = fake.runtime_module()
        cuda_pkg = types.ModuleType("cuda")
        cuda_pkg.bindings = bindings
        monkeypatch.setitem(sys.modules, "cuda", cuda_pkg)
        monkeypatch.setitem(sys.modules, "cuda.bindings", bindings)
        monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", bindings.runtime)
    else:
        monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", None)  # import fails
        monkeypatch.setitem(sys.modules, "cuda.bindings", None)
