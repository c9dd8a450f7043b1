"""Memory probes (device and host) and the non-model-data measurement the auto policy needs.

Probes work on a machine without a GPU: the compute device is then the CPU, and its capacity and
free memory are the host's (psutil). ``describe_devices()`` says what was found and how.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from .accounting import MemoryLedger

__all__ = [
    "DeviceMemory",
    "NonModelSampler",
    "describe_devices",
    "device_capacity",
    "device_free",
    "host_memory",
    "nvml_memory",
    "process_capacity",
]

log = logging.getLogger("chunkmem")


@dataclass(frozen=True)
class DeviceMemory:
    """Total and free bytes of one memory, and which probe measured them."""

    total: int
    free: int
    source: str
    """Which probe answered: "torch.cuda", "nvml" or "psutil (no GPU: the CPU is the device)"."""


def host_memory() -> DeviceMemory:
    """Host RAM (psutil)."""
    vm = psutil.virtual_memory()
    return DeviceMemory(total=int(vm.total), free=int(vm.available), source="psutil")


def nvml_memory(index: int) -> DeviceMemory | None:
    """The GPU's memory as NVML sees it (all processes), or ``None`` when NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            return DeviceMemory(total=int(info.total), free=int(info.free), source="nvml")
        finally:
            pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        return None


def _cuda_memory(device: torch.device) -> DeviceMemory:
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(total=int(total), free=int(free), source="torch.cuda")


def device_memory(device: torch.device) -> DeviceMemory:
    """The compute device's memory: torch.cuda (NVML if that fails) on a GPU, host RAM on the CPU."""
    if device.type == "cuda":
        try:
            return _cuda_memory(device)
        except RuntimeError:
            index = device.index if device.index is not None else torch.cuda.current_device()
            nvml = nvml_memory(index)
            if nvml is not None:
                return nvml
            raise
    mem = host_memory()
    return DeviceMemory(total=mem.total, free=mem.free, source="psutil (no GPU: the CPU is the device)")


def device_capacity(device: torch.device) -> int:
    """Total bytes of the compute device."""
    return device_memory(device).total


def process_capacity(device: torch.device) -> int:
    """Bytes of the compute device this process may use now: what is free (other processes
    count) plus what this process already holds, capped by its per-process memory fraction on a
    GPU (``torch.cuda.set_per_process_memory_fraction``)."""
    if device.type == "cuda":
        memory = device_memory(device)
        usable = memory.free + torch.cuda.memory_reserved(device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        if fraction is not None:
            usable = min(usable, int(fraction(device) * memory.total))
        return min(usable, memory.total)
    memory = host_memory()
    return min(memory.total, memory.free + psutil.Process().memory_info().rss)


def device_free(device: torch.device) -> int:
    """Free bytes of the compute device now."""
    return device_memory(device).free


def describe_devices() -> str:
    """One line per memory the probes can see, and why a probe is missing."""
    lines = []
    host = host_memory()
    lines.append(f"host: {host.total / 2**30:.1f} GiB total, {host.free / 2**30:.1f} GiB available (psutil)")
    if not torch.cuda.is_available():
        lines.append("no CUDA device (torch.cuda.is_available() is False): the CPU is the compute device")
        return "\n".join(lines)
    for index in range(torch.cuda.device_count()):
        mem = _cuda_memory(torch.device("cuda", index))
        nvml = nvml_memory(index)
        extra = "" if nvml is not None else "; NVML unavailable (install nvidia-ml-py / driver)"
        lines.append(
            f"cuda:{index}: {mem.total / 2**30:.1f} GiB total, {mem.free / 2**30:.1f} GiB free ({mem.source}{extra})"
        )
    return "\n".join(lines)


class _Saved:
    """A tensor autograd saved for backward, counted while the graph keeps it: ``on_free`` runs
    when the graph lets go of it."""

    __slots__ = ("_on_free", "tensor")

    def __init__(self, tensor: torch.Tensor, on_free: Callable[[], None] | None) -> None:
        self.tensor = tensor
        self._on_free = on_free

    def __del__(self) -> None:
        if self._on_free is not None:
            self._on_free()


class NonModelSampler:
    """Non-model device memory at each hook position of a recording iteration.

    On CUDA it is what the allocator holds beyond accounted chunk memory. On the CPU, where the
    allocator cannot be asked, it is the bytes autograd keeps saved for backward (activations),
    tracked with saved-tensor hooks; parameters and their views are model data and not counted.
    """

    def __init__(self, device: torch.device, ledger: MemoryLedger) -> None:
        self._device = device
        self._ledger = ledger
        self._samples: list[int] = []
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved references]
        self._live_bytes = 0
        self._hooks: Any = None

    @property
    def samples(self) -> tuple[int, ...]:
        return tuple(self._samples)

    def reset(self) -> None:
        """Forget the samples (a new measured iteration starts)."""
        self._samples.clear()
        if self._device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self._device)

    def sample(self) -> None:
        """Record non-model bytes at the current hook position: on CUDA the allocator's peak since
        the previous sample (the op in between made its temporaries) less the chunk bytes now.
        Resets the allocator's peak statistics while measuring."""
        if self._device.type == "cuda":
            used = torch.cuda.max_memory_allocated(self._device) - self._ledger.device_bytes
            torch.cuda.reset_peak_memory_stats(self._device)
        else:
            used = self._live_bytes
        self._samples.append(max(0, int(used)))

    def saved_tensor_hooks(self) -> Any:
        """A context manager that tracks saved activations (CPU only; a no-op context on CUDA)."""
        if self._device.type == "cuda":
            from contextlib import nullcontext

            return nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
            return _Saved(tensor, None)
        storage = tensor.untyped_storage()
        key = storage._cdata  # the storage itself (meta storages all have address 0)
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [storage.nbytes(), 1]
            self._live_bytes += storage.nbytes()
        else:
            entry[1] += 1
        return _Saved(tensor, lambda: self._drop(key))

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def _drop(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self._live_bytes -= entry[0]
            del self._live[key]
