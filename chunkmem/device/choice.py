"""Which device layer a compute device gets."""

from __future__ import annotations

import os

import torch

from .layer import AcceleratorLayer, DeviceLayer, generic_streams, is_accelerator
from .simulated import SIMULATED, simulated_layer

__all__ = ["device_layer"]


def device_layer(device: torch.device) -> DeviceLayer:
    """The layer for compute device ``device``. The CPU is synchronous unless ``CHUNKMEM_DEVICE``
    is ``cpu-async``: then it is the simulated asynchronous device."""
    if device.type == "cuda" or (is_accelerator(device) and generic_streams()):
        return AcceleratorLayer(device)
    if device.type == "cpu" and os.environ.get("CHUNKMEM_DEVICE", "") == SIMULATED:
        return simulated_layer(device)
    return DeviceLayer(device)
