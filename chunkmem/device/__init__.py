"""The device layer: the only code in chunkmem that knows the accelerator (streams, events, pinned
host memory, memory capacity and the allocator's statistics); see ``layer`` and ``probes``."""

from .choice import device_layer
from .layer import AcceleratorLayer, CollectiveWaits, DeviceLayer, is_accelerator
from .probes import (
    PLANNED_DEVICES,
    DeviceMemory,
    accelerator_available,
    accelerator_lines,
    accelerator_memory,
    accelerator_process_capacity,
    bf16_supported,
    collective_backend,
    compute_device,
    gpu_device,
    nvml_memory,
    peak_allocated,
    planned_precision,
    reset_peak,
)
from .simulated import SIMULATED

__all__ = [
    "PLANNED_DEVICES",
    "SIMULATED",
    "AcceleratorLayer",
    "CollectiveWaits",
    "DeviceLayer",
    "DeviceMemory",
    "accelerator_available",
    "accelerator_lines",
    "accelerator_memory",
    "accelerator_process_capacity",
    "bf16_supported",
    "collective_backend",
    "compute_device",
    "device_layer",
    "gpu_device",
    "is_accelerator",
    "nvml_memory",
    "peak_allocated",
    "planned_precision",
    "reset_peak",
]
