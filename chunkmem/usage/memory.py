"""Memory probes (device and host) and the non-model-data measurement the auto policy needs.

Probes work on a machine without a GPU: the compute device is then the CPU, and its capacity and
free memory are the host's (psutil). ``describe_devices()`` says what was found and how.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable
from typing import Any

import psutil
import torch

from ..compat.torch import view_base
from ..device import (
    DeviceMemory,
    accelerator_lines,
    accelerator_memory,
    accelerator_process_capacity,
    is_accelerator,
    nvml_memory,
    peak_allocated,
    reset_peak,
)
from .accounting import MemoryLedger
from .saved import KeptTensor, LiveSaved, top_hooks

__all__ = [
    "DeviceMemory",
    "NonModelSampler",
    "describe_devices",
    "device_capacity",
    "device_free",
    "host_memory",
    "nvml_memory",
    "process_capacity",
    "return_freed_host_memory",
]

log = logging.getLogger("chunkmem")


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


def return_freed_host_memory() -> None:
    """Give the host memory freed so far back to the system where glibc's allocator kept it.
    After a large block is freed, glibc raises its mmap threshold, so the next blocks of that
    size come from its heap and, once freed, stay in the process: boosting a base chunk by chunk
    to disk would keep the whole base's worth of RSS though no tensor holds it (measured: 286 of
    293 MiB at W=1, 27 MiB with the trim)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def host_memory() -> DeviceMemory:
    """Host RAM (psutil)."""
    vm = psutil.virtual_memory()
    return DeviceMemory(total=int(vm.total), free=int(vm.available), source="psutil")


def device_memory(device: torch.device) -> DeviceMemory:
    """The compute device's memory: the accelerator's (``chunkmem.device``), host RAM on the CPU."""
    if is_accelerator(device):
        return accelerator_memory(device)
    mem = host_memory()
    return DeviceMemory(total=mem.total, free=mem.free, source="psutil (no GPU: the CPU is the device)")


def device_capacity(device: torch.device) -> int:
    """Total bytes of the compute device."""
    return device_memory(device).total


def process_capacity(device: torch.device) -> int:
    """Bytes of the compute device this process may use now: what is free (other processes
    count) plus what this process already holds, capped by its per-process memory fraction on an
    accelerator (``chunkmem.device.accelerator_process_capacity``)."""
    if is_accelerator(device):
        return accelerator_process_capacity(device)
    memory = host_memory()
    return min(memory.total, memory.free + psutil.Process().memory_info().rss)


def device_free(device: torch.device) -> int:
    """Free bytes of the compute device now."""
    return device_memory(device).free


def describe_devices() -> str:
    """One line per memory the probes can see, and why a probe is missing."""
    host = host_memory()
    lines = [f"host: {host.total / 2**30:.1f} GiB total, {host.free / 2**30:.1f} GiB available (psutil)"]
    return "\n".join([*lines, *accelerator_lines()])


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
        self._live = LiveSaved()
        self._hooks: Any = None
        self._allocator_measures = peak_allocated(device) is not None

    @property
    def samples(self) -> tuple[int, ...]:
        return tuple(self._samples)

    def reset(self) -> None:
        """Forget the samples (a new measured iteration starts)."""
        self._samples.clear()
        reset_peak(self._device)

    def sample(self) -> None:
        """Record non-model bytes at the current hook position: on CUDA the allocator's peak since
        the previous sample (the op in between made its temporaries) less the chunk bytes now.
        Resets the allocator's peak statistics while measuring."""
        peak = peak_allocated(self._device) if self._allocator_measures else None
        if peak is not None:
            used = peak - self._ledger.device_bytes
            reset_peak(self._device)
        else:
            used = self._live.bytes
        self._samples.append(max(0, int(used)))

    def saved_tensor_hooks(self) -> Any:
        """A context manager that tracks saved activations (CPU only; a no-op context on CUDA).
        Where saved-tensor hooks are in place already (the boosted model's saved-activation meter,
        or the user's around the model), each saved tensor is counted here and handed on to them:
        they pack it as they would without the sampler, so what they count and keep stays the same.
        Before PyTorch 2.8, which cannot say which hooks are in place, the sampler's own take the
        saved tensors from them during the measured iteration."""
        if self._allocator_measures:
            from contextlib import nullcontext

            return nullcontext()
        beneath = top_hooks()
        if beneath is None:
            return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        pack_beneath, unpack_beneath = beneath

        def pack(tensor: torch.Tensor) -> tuple[KeptTensor | None, Any]:
            return self._count(tensor), pack_beneath(tensor)

        def unpack(saved: tuple[KeptTensor | None, Any]) -> torch.Tensor:
            return unpack_beneath(saved[1])

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)

    def _pack(self, tensor: torch.Tensor) -> KeptTensor:
        return self._count(tensor) or KeptTensor(tensor)

    def _count(self, tensor: torch.Tensor) -> KeptTensor | None:
        """The handle that counts ``tensor`` while it lives (``None``: model data, not counted)."""
        if isinstance(tensor, torch.nn.Parameter) or isinstance(view_base(tensor), torch.nn.Parameter):
            return None
        return self._live.keep(tensor)

    @staticmethod
    def _unpack(saved: KeptTensor) -> torch.Tensor:
        return saved.get()
