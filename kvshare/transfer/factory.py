"""make_transfer: the transfer for a device (CpuTransfer or CudaTransfer), from one place.

Kept apart from ``base.py`` so the interface does not import its implementations: cpu.py
and cuda.py import base.py; this module imports them, each only when a transfer for its
device is asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvshare.layout import KVLayout
from kvshare.transfer.base import KVTransfer, TransferConfig

if TYPE_CHECKING:
    from kvshare.pool.client import PoolClient


def make_transfer(layout: KVLayout, client: PoolClient, device, config: TransferConfig | None = None) -> KVTransfer:
    """CpuTransfer or CudaTransfer, chosen by the device's type."""
    device = torch.device(device)
    config = config or TransferConfig()
    if device.type == "cpu":
        from kvshare.transfer.cpu import CpuTransfer

        return CpuTransfer(layout, client, device, config)
    if device.type == "cuda":
        from kvshare.transfer.cuda import CudaTransfer

        return CudaTransfer(layout, client, device, config)
    raise ValueError(f"no KV transfer for device {device}; kvshare moves KV to 'cpu' or 'cuda'")
