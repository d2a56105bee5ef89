"""The pool the levels run against, the one client every level shares, and the device.

``kvshare validate`` starts its own pool of ``--pool-size`` (removed at exit) unless
``--pool SOCKET`` names a running one. Every level uses the same ``PoolClient``, so
the arena is mapped once and, on CUDA, registered once: CUDA pins a virtual range,
registrations are shared by base address (kvshare.transfer.registration), and
holding one for the whole command spares the byte level a re-registration of the
arena (seconds per 10 GiB) for each transfer it builds.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

from kvshare.errors import UserError
from kvshare.placement import is_device_name


@dataclass(frozen=True)
class PoolSpec:
    socket: str | None  # a running pool; None: start one
    size_bytes: int  # of the pool this command starts
    extent_bytes: int


def _memlock_hint(num_bytes: int) -> str:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
    return (
        f"pinning the {num_bytes}-byte arena may need RLIMIT_MEMLOCK at least that large (ulimit -l is {limit}; "
        "ulimit -l unlimited, LimitMEMLOCK=infinity, docker --ulimit memlock=-1)"
    )


def choose_device(name: str) -> str:
    """validate's --device: 'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; 'cuda' without a GPU is an error.

    (kvshare.engine.loader.resolve_device turns a device name into the engine's torch.device.)"""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not is_device_name(name):
        raise UserError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name != "cpu" and not torch.cuda.is_available():
        raise UserError(f"--device {name}: torch sees no CUDA device here (use --device auto or cpu)")
    return name


class CheckedPool:
    """Context manager: a connected PoolClient (``.client``) and, on demand, the arena's CUDA registration."""

    def __init__(self, spec: PoolSpec, device: str) -> None:
        self.spec = spec
        self.device = device
        self.client = None
        self.started_pool = spec.socket is None
        self.socket: str | None = spec.socket
        self._stack = contextlib.ExitStack()
        self._registration = None
        self.registration_seconds: float | None = None

    def __enter__(self) -> CheckedPool:
        from kvshare.pool.client import PoolClient, PoolUnavailable
        from kvshare.pool.spawn import running_pool

        try:
            if self.socket is None:
                if self.spec.extent_bytes > self.spec.size_bytes:
                    raise UserError(
                        f"--extent-size {self.spec.extent_bytes} exceeds --pool-size {self.spec.size_bytes}"
                    )
                self.socket = self._stack.enter_context(
                    running_pool(self.spec.size_bytes, ("--extent-size", str(self.spec.extent_bytes)), quiet=True)
                )
            try:
                self.client = self._stack.enter_context(PoolClient(self.socket, name="kvshare-validate"))
            except PoolUnavailable as exc:
                raise UserError(f"cannot reach the pool: {exc}") from None
            if self.is_cuda:  # CUDA's start-up cost stays out of the pin time
                import torch

                torch.cuda.init()
                if self.device.startswith("cuda:"):
                    torch.cuda.set_device(torch.device(self.device))
        except BaseException:
            self._stack.close()
            raise
        return self

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def register_arena(self, prefault: bool = True) -> str:
        """Register the whole arena with CUDA (extent pieces) once; held until exit. Returns a description.

        ``prefault``: on a pool this command started (nothing in it is anyone's data), touch every page
        with threads first; cudaHostRegister would otherwise fault the arena in on one thread.
        """
        from kvshare.transfer.registration import RegistrationError, acquire_registration, release_registration

        if self._registration is None:
            if prefault and self.started_pool:
                self._prefault()
            start = time.perf_counter()
            try:
                self._registration = acquire_registration(self.client)
            except RegistrationError as exc:
                raise RegistrationError(f"{exc}; {_memlock_hint(int(self.client.arena.size))}") from None
            self.registration_seconds = time.perf_counter() - start
            self._stack.callback(release_registration, self._registration)
        reg = self._registration
        return (
            f"cudaHostRegister {len(reg.pieces)} pieces of <= {reg.extent_bytes >> 20} MiB "
            f"({reg.arena_bytes / (1 << 30):.2f} GiB) in {self.registration_seconds:.2f} s"
        )

    def _prefault(self, num_threads: int | None = None) -> None:
        from concurrent.futures import ThreadPoolExecutor

        arena = self.client.arena
        step = 64 << 20

        def touch(offset: int) -> None:
            arena[offset : offset + step][::4096] = 0

        with ThreadPoolExecutor(max_workers=num_threads or min(8, os.cpu_count() or 1)) as workers:
            list(workers.map(touch, range(0, arena.size, step)))

    def __exit__(self, *exc) -> None:
        self._stack.close()  # registration released before the client closes, the pool stops last
