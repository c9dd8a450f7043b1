"""Which device layer a compute device gets."""

from __future__ import annotations

import torch

from .layer import AcceleratorLayer, DeviceLayer, generic_streams, is_accelerator
from .simulated import SIMULATED, simulated_layer, simulation_requested

__all__ = ["device_layer"]


def device_layer(device: torch.device) -> DeviceLayer:
    """The layer for compute device ``device``. The CPU is synchronous unless ``CHUNKMEM_DEVICE``
    is ``cpu-async``: then it is the simulated asynchronous device, and an accelerator is refused
    (a run asked to be simulated would run unchecked on the GPU)."""
    if simulation_requested() and is_accelerator(device):
        raise ValueError(
            f"CHUNKMEM_DEVICE={SIMULATED} asks for the simulated asynchronous device (the CPU), but chunkmem was "
            f"handed {device} to compute on, where nothing would be simulated or checked. Compute on the CPU (the "
            "plugin's default under this setting, or a Communicator on torch.device('cpu')), or unset CHUNKMEM_DEVICE "
            "to train on the GPU"
        )
    if device.type == "cuda" or (is_accelerator(device) and generic_streams()):
        return AcceleratorLayer(device)
    if device.type == "cpu" and simulation_requested():
        return simulated_layer(device)
    return DeviceLayer(device)
