"""The two ways CudaTransfer moves bytes between the registered arena and a GPU staging buffer.

Both execute the same plan (``plan.RowCopy``: ``height`` rows of ``width``
bytes, host pitch = page size, rows packed in staging), enqueued on the given
stream, asynchronous with respect to the host:

- ``memcpy2d``: one cudaMemcpy2DAsync per RowCopy (a whole run of pages in one
  copy), through cuda-bindings (``cuda.bindings.runtime``);
- ``torch``: one ``Tensor.copy_(non_blocking=True)`` per row, i.e. per page
  and layer group (each >= min_copy_bytes where the page allows), for
  machines without cuda-bindings.

The choice is TransferConfig.copy_method; neither falls back to the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvshare.transfer.plan import RowCopy


class CopyError(RuntimeError):
    """A CUDA copy could not be enqueued."""


class Memcpy2DCopier:
    name = "memcpy2d"

    def __init__(self, device_index: int) -> None:
        try:
            from cuda.bindings import runtime as rt
        except ImportError as exc:
            raise CopyError(
                "TransferConfig(copy_method='memcpy2d') needs cuda-bindings (module cuda.bindings.runtime), "
                f"which cannot be imported here ({exc}); install cuda-bindings matching the CUDA driver, "
                "or choose copy_method='torch'"
            ) from None
        self._rt = rt
        self._device_index = device_index
        self._success = rt.cudaError_t.cudaSuccess
        self._h2d = rt.cudaMemcpyKind.cudaMemcpyHostToDevice
        self._d2h = rt.cudaMemcpyKind.cudaMemcpyDeviceToHost

    def _ensure_device(self) -> None:
        # cuda-bindings keeps its own per-thread current device; the stream and staging belong to ours
        err, current = self._rt.cudaGetDevice()
        self._raise_on(err, "cudaGetDevice")
        if current != self._device_index:
            (err,) = self._rt.cudaSetDevice(self._device_index)
            self._raise_on(err, f"cudaSetDevice({self._device_index})")

    def _raise_on(self, err, what: str) -> None:
        if err != self._success:
            self._rt.cudaGetLastError()  # read off the error, or torch's next launch check reports it as its own
            try:
                text = self._rt.cudaGetErrorString(err)[1].decode()
            except Exception:  # the name of the error is enough when the string cannot be had
                text = ""
            raise CopyError(f"{what} failed: {err!r} {text}")

    def copy(
        self, copies: Sequence[RowCopy], client, arena_ptr: int, stage: torch.Tensor, stream, to_device: bool
    ) -> None:
        self._ensure_device()
        stage_ptr, handle = stage.data_ptr(), stream.cuda_stream
        for c in copies:
            host, dev = arena_ptr + c.host_offset, stage_ptr + c.stage_offset
            if to_device:
                args = (dev, c.width, host, c.host_pitch, c.width, c.height, self._h2d, handle)
            else:
                args = (host, c.host_pitch, dev, c.width, c.width, c.height, self._d2h, handle)
            (err,) = self._rt.cudaMemcpy2DAsync(*args)
            self._raise_on(err, f"cudaMemcpy2DAsync({c})")


class TorchCopier:
    name = "torch"

    def copy(
        self, copies: Sequence[RowCopy], client, arena_ptr: int, stage: torch.Tensor, stream, to_device: bool
    ) -> None:
        with torch.cuda.stream(stream):
            for c in copies:
                for row in range(c.height):
                    view = client.page(c.host_offset + row * c.host_pitch, c.width)
                    # contiguous, or torch would stage it through pageable memory (4.4 GB/s) without a word
                    assert view.flags.c_contiguous
                    host = torch.from_numpy(view)
                    dev = stage[c.stage_offset + row * c.width : c.stage_offset + (row + 1) * c.width]
                    if to_device:
                        dev.copy_(host, non_blocking=True)
                    else:
                        host.copy_(dev, non_blocking=True)


def make_copier(method: str, device_index: int):
    if method == "memcpy2d":
        return Memcpy2DCopier(device_index)
    if method == "torch":
        return TorchCopier()
    raise ValueError(f"unknown copy method {method!r}")
