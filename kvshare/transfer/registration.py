"""Pinning the pool arena for CUDA: cudaHostRegister in pieces on the allocator's extent boundaries.

Extent i is ``[i*E, min((i+1)*E, arena))``; the allocator never lets a page
straddle two extents, so no copy of a page (or of a run of pages, which the
copy plan keeps inside one extent) spans two registrations: such a copy fails
with ``invalid argument`` (seen on the H200). A failed registration is an
error, never a fall back to pageable memory (6.7 GB/s instead of ~55).

Registration is a property of the process (CUDA pins a virtual range once), so
registrations are shared, reference-counted, by the arena's base address.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context of the process, not only the current one


class RegistrationError(RuntimeError):
    """cudaHostRegister / cudaHostUnregister failed, or a copy would span two registrations."""


def extent_pieces(arena_bytes: int, extent_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of every extent: the registration pieces."""
    if arena_bytes <= 0 or extent_bytes <= 0:
        raise ValueError("arena and extent sizes must be positive")
    return [(base, min(extent_bytes, arena_bytes - base)) for base in range(0, arena_bytes, extent_bytes)]


@dataclass
class ArenaRegistration:
    base_ptr: int
    arena_bytes: int
    extent_bytes: int
    pieces: list[tuple[int, int]]
    seconds: float  # time cudaHostRegister took for all pieces
    refs: int = 1
    is_forgotten: bool = False  # its client unmapped the arena: the pins were dropped then, releases do nothing

    def check_span(self, offset: int, num_bytes: int) -> None:
        """Raise unless arena bytes [offset, offset + num_bytes) lie inside one registered piece."""
        last = offset + num_bytes - 1
        if offset < 0 or last >= self.arena_bytes or offset // self.extent_bytes != last // self.extent_bytes:
            raise RegistrationError(
                f"a copy of arena bytes [{offset}, {offset + num_bytes}) would span two CUDA registrations "
                f"(extents of {self.extent_bytes} bytes); the copy plan must split it"
            )


_lock = threading.Lock()
_registrations: dict[int, ArenaRegistration] = {}


def _cudart():
    import torch

    return torch.cuda.cudart()


def _loaded_cudart_paths(maps_path: str = "/proc/self/maps") -> list[str]:
    """Paths of every libcudart this process has loaded (torch's among them)."""
    paths: list[str] = []
    try:
        with open(maps_path) as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if "libcudart.so" in path.rsplit("/", 1)[-1] and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths


def clear_last_error() -> None:
    """Read off the 'last error' a failed runtime call leaves behind.

    Otherwise torch's next kernel-launch check (cudaGetLastError) reports it as a failure of
    that unrelated kernel. torch does not expose cudaGetLastError, so call it in each loaded
    libcudart (torch's is one of them; the call is harmless in the others).
    """
    import ctypes

    for path in _loaded_cudart_paths():
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):
            continue


def _check(err, what: str) -> None:
    if int(err) != 0:
        clear_last_error()
        try:
            text = _cudart().cudaGetErrorString(err)
        except Exception:  # the message is a courtesy; the code is what matters
            text = "unknown"
        raise RegistrationError(f"{what} failed: CUDA error {int(err)} ({text})")


def register_range(ptr: int, num_bytes: int) -> None:
    _check(
        _cudart().cudaHostRegister(ptr, num_bytes, CUDA_HOST_REGISTER_PORTABLE),
        f"cudaHostRegister({ptr:#x}, {num_bytes})",
    )


def unregister_range(ptr: int) -> None:
    _check(_cudart().cudaHostUnregister(ptr), f"cudaHostUnregister({ptr:#x})")


def _wait_for_copies() -> None:
    """Wait for every copy this process enqueued on its GPU: a copy may still read or write pinned arena
    pages (a failed load or store is given up between its enqueue and its event), and unpinning them
    under it would corrupt the bytes or fault the copy."""
    import torch

    torch.cuda.synchronize()


def acquire_registration(client) -> ArenaRegistration:
    """The client's whole arena registered with CUDA (done once per mapping, shared after)."""
    arena = client.arena
    base_ptr, arena_bytes = int(arena.ctypes.data), int(arena.size)
    extent_bytes = int(client.hello.extent_bytes)
    with _lock:
        existing = _registrations.get(base_ptr)
        if existing is not None:
            if (existing.arena_bytes, existing.extent_bytes) != (arena_bytes, extent_bytes):
                raise RegistrationError(f"arena at {base_ptr:#x} is registered with another size or extent")
            existing.refs += 1
            return existing
        pieces = extent_pieces(arena_bytes, extent_bytes)
        start = time.perf_counter()
        done: list[int] = []
        try:
            for offset, length in pieces:
                register_range(base_ptr + offset, length)
                done.append(base_ptr + offset)
        except BaseException:
            for ptr in done:
                try:
                    unregister_range(ptr)
                except RegistrationError:
                    pass  # the registration error being raised is the one to report
            raise
        registration = ArenaRegistration(base_ptr, arena_bytes, extent_bytes, pieces, time.perf_counter() - start)
        _registrations[base_ptr] = registration
    # A client closed while a transfer still holds the registration would leave pinned ranges naming
    # memory that is unmapped; the next arena mapped there then fails with CUDA error 712 ("already
    # mapped"), seen on the H200 when one test left an engine unclosed. So the pins go with the mapping.
    client.on_unmap(lambda: _forget(registration))
    return registration


def _forget(registration: ArenaRegistration) -> None:
    """Unregister every piece now, whatever the references (the arena is about to be unmapped)."""
    with _lock:
        if registration.is_forgotten or _registrations.get(registration.base_ptr) is not registration:
            return
        _registrations.pop(registration.base_ptr)
        registration.is_forgotten, registration.refs = True, 0
        _wait_for_copies()
        for offset, _length in registration.pieces:
            try:
                unregister_range(registration.base_ptr + offset)
            except RegistrationError:
                pass  # unmapping goes ahead either way; nothing a caller could do


def release_registration(registration: ArenaRegistration) -> None:
    """Drop one reference; the last one waits for the process's copies, then unregisters every piece."""
    with _lock:
        if registration.is_forgotten:
            return
        registration.refs -= 1
        if registration.refs > 0:
            return
        _registrations.pop(registration.base_ptr, None)
        _wait_for_copies()
        errors = []
        for offset, _length in registration.pieces:
            try:
                unregister_range(registration.base_ptr + offset)
            except RegistrationError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
