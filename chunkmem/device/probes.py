"""What the device layer knows about the accelerator itself: which one computes, its memory and
this process's share of it, its allocator's peak, bf16 support. The host's side (psutil) is
``chunkmem.usage.memory``'s."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .layer import is_accelerator
from .simulated import simulation_requested

__all__ = [
    "PLANNED_DEVICES",
    "DeviceMemory",
    "accelerator_available",
    "accelerator_lines",
    "accelerator_memory",
    "accelerator_process_capacity",
    "bf16_supported",
    "compute_device",
    "gpu_device",
    "nvml_gpu_count",
    "nvml_memory",
    "peak_allocated",
    "planned_precision",
    "reset_peak",
]

T = TypeVar("T")
_CUDA = "cuda"
# The device kinds the planner plans for (the machine it plans for need not be this one), the
# accelerator first: what its CLI offers and defaults to.
PLANNED_DEVICES: tuple[str, ...] = (_CUDA, "cpu")


def planned_precision(device_type: str) -> str:
    """What ``ChunkPlugin(precision=None)`` picks when training on a device of ``device_type``
    that supports bf16 (every GPU the planner targets): bf16 on the GPU, fp32 on the CPU."""
    return "bf16" if device_type == _CUDA else "fp32"


@dataclass(frozen=True)
class DeviceMemory:
    """Total and free bytes of one memory, and which probe measured them."""

    total: int
    free: int
    source: str
    """Which probe answered: "torch.cuda", "nvml", "torch.accelerator" or "psutil (no GPU: the CPU is the device)"."""


def accelerator_available() -> bool:
    """Whether a CUDA GPU is there to compute on (the accelerator chunkmem picks by itself): not
    where ``CHUNKMEM_DEVICE`` asks for the simulated device, which is the CPU."""
    return torch.cuda.is_available() and not simulation_requested()


def compute_device() -> torch.device:
    """The local GPU (``LOCAL_RANK`` under torchrun, else the current device), or the CPU (also
    where a GPU is present but ``CHUNKMEM_DEVICE`` asks for the simulated device)."""
    if not accelerator_available():
        return torch.device("cpu")
    local = os.environ.get("LOCAL_RANK")
    index = int(local) % torch.cuda.device_count() if local is not None else torch.cuda.current_device()
    torch.cuda.set_device(index)
    return torch.device(_CUDA, index)


def collective_backend(device: torch.device) -> str:
    """The process-group backend for ranks computing on ``device`` (NCCL on NVIDIA GPUs, gloo on
    the CPU), as torch.distributed maps them."""
    import torch.distributed as dist

    return dist.get_default_backend_for_device(device)


def gpu_device(device: int | str | torch.device | None) -> torch.device:
    """What ``module.cuda(device)`` names: a GPU index, a device, or (``None``) the current GPU."""
    return torch.device(_CUDA, device) if isinstance(device, int) else torch.device(device or _CUDA)


def bf16_supported(device: torch.device | None) -> bool:
    """Whether ``device`` (``None``: the one ``compute_device`` would pick) computes in bf16 at
    full speed: a GPU that supports it; never the CPU, where 16-bit matmuls are emulated."""
    on_gpu = device.type == _CUDA if device is not None else accelerator_available()
    return on_gpu and torch.cuda.is_bf16_supported()


def _ask_nvml(query: Callable[[Any], T]) -> T | None:
    """``query(pynvml)`` between NVML's init and shutdown, or ``None`` when NVML is unavailable
    (no ``nvidia-ml-py``, no driver)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return query(pynvml)
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None


def nvml_memory(index: int) -> DeviceMemory | None:
    """The GPU's memory as NVML sees it (all processes), or ``None`` when NVML is unavailable."""

    def query(nvml: Any) -> DeviceMemory:
        info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(index))
        return DeviceMemory(total=int(info.total), free=int(info.free), source="nvml")

    return _ask_nvml(query)


def nvml_gpu_count() -> int | None:
    """How many GPUs the driver reports (whatever ``CUDA_VISIBLE_DEVICES`` hides from torch), or
    ``None`` when NVML is unavailable."""
    return _ask_nvml(lambda nvml: int(nvml.nvmlDeviceGetCount()))


def _cuda_memory(device: torch.device) -> DeviceMemory:
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=int(total), free=int(free), source="torch.cuda")


def accelerator_memory(device: torch.device) -> DeviceMemory:
    """An accelerator's memory: torch.cuda (NVML if that fails) on a GPU, torch.accelerator elsewhere."""
    if device.type == _CUDA:
        try:
            return _cuda_memory(device)
        except RuntimeError:
            index = device.index if device.index is not None else torch.cuda.current_device()
            nvml = nvml_memory(index)
            if nvml is not None:
                return nvml
            raise
    free, total = torch.accelerator.get_memory_info(device)
    return DeviceMemory(total=int(total), free=int(free), source="torch.accelerator")


def accelerator_process_capacity(device: torch.device) -> int:
    """Bytes of an accelerator this process may use now: what is free (other processes count)
    plus what this process already holds, capped by its per-process memory fraction on a GPU
    (``torch.cuda.set_per_process_memory_fraction``)."""
    memory = accelerator_memory(device)
    if device.type != _CUDA:
        return min(memory.free + torch.accelerator.memory_reserved(device), memory.total)
    usable = memory.free + torch.cuda.memory_reserved(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        usable = min(usable, int(fraction(device) * memory.total))
    return min(usable, memory.total)


def _generic(name: str) -> Any:
    """``torch.accelerator.<name>`` where this PyTorch has it, else ``None``."""
    return getattr(getattr(torch, "accelerator", None), name, None)


def reset_peak(device: torch.device) -> None:
    """Restart the allocator's peak statistics (nothing to do without an accelerator allocator)."""
    if device.type == _CUDA:
        torch.cuda.reset_peak_memory_stats(device)
    elif is_accelerator(device) and _generic("reset_peak_memory_stats") is not None:
        _generic("reset_peak_memory_stats")(device)


def peak_allocated(device: torch.device) -> int | None:
    """The allocator's peak allocated bytes since ``reset_peak`` (``None`` where no allocator can
    be asked: the CPU, an accelerator on a PyTorch without ``torch.accelerator`` statistics)."""
    if device.type == _CUDA:
        return int(torch.cuda.max_memory_allocated(device))
    peak = _generic("max_memory_allocated") if is_accelerator(device) else None
    return int(peak(device)) if peak is not None else None


def accelerator_lines() -> list[str]:
    """One line per GPU, and why a probe is missing."""
    if not torch.cuda.is_available():
        return ["no CUDA device (torch.cuda.is_available() is False): the CPU is the compute device"]
    lines = []
    for index in range(torch.cuda.device_count()):
        mem = _cuda_memory(torch.device(_CUDA, index))
        nvml = nvml_memory(index)
        extra = "" if nvml is not None else "; NVML unavailable (install nvidia-ml-py / driver)"
        lines.append(
            f"cuda:{index}: {mem.total / 2**30:.1f} GiB total, {mem.free / 2**30:.1f} GiB free ({mem.source}{extra})"
        )
    return lines
