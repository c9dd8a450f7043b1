"""What this machine's accelerator stack is, which device layer chunkmem computes on and why, and how
fast pinned host memory reaches the device: the device facts ``chunkmem-env`` reports."""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass

import torch

from .choice import device_layer
from .layer import DeviceLayer
from .probes import accelerator_available, compute_device, nvml_gpu_count
from .simulated import SIMULATED, simulation_requested

__all__ = ["LayerChoice", "PinnedCopy", "Toolkit", "layer_choice", "locked_memory_limit", "pinned_copy", "toolkit"]


@dataclass(frozen=True)
class Toolkit:
    """The accelerator libraries this PyTorch was built with and what it finds at run time."""

    cuda_build: str | None
    """The CUDA version torch was built with (``torch.version.cuda``); ``None``: a build without CUDA."""
    cuda_available: bool
    """Whether torch can use a CUDA GPU now (``torch.cuda.is_available()``)."""
    gpus: tuple[str, ...]
    """The GPUs torch sees, by name."""
    nvml_gpus: int | None
    """How many GPUs the driver reports through NVML (all of them, whatever torch sees); ``None``:
    NVML is not there (no driver, or no ``nvidia-ml-py``)."""
    cudnn: int | None
    """cuDNN's version as torch reports it (e.g. 90100), ``None`` without cuDNN."""
    nccl: str | None
    """NCCL's version, ``None`` where torch.distributed has no NCCL."""
    gloo: bool
    """Whether torch.distributed has gloo (the CPU backend)."""
    visible_devices: str | None
    """``CUDA_VISIBLE_DEVICES`` as set (``None``: unset, every GPU is visible)."""


def _nccl() -> str | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_nccl_available()):
        return None
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):
        return None
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


def _gloo() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def toolkit() -> Toolkit:
    available = torch.cuda.is_available()
    gpus = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if available else ()
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return Toolkit(
        cuda_build=torch.version.cuda,
        cuda_available=available,
        gpus=gpus,
        nvml_gpus=nvml_gpu_count(),
        cudnn=cudnn,
        nccl=_nccl(),
        gloo=_gloo(),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
    )


@dataclass(frozen=True)
class LayerChoice:
    """The compute device and device layer a ``ChunkPlugin`` would pick in this process, and why."""

    device: torch.device
    layer: DeviceLayer
    reason: str


def _why_no_gpu(kit: Toolkit) -> str:
    if kit.cuda_build is None:
        return "this torch is built without CUDA (torch.version.cuda is None)"
    if kit.visible_devices is not None and kit.visible_devices.strip() in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={kit.visible_devices!r} hides every GPU"
    if kit.nvml_gpus:
        return f"the driver reports {kit.nvml_gpus} GPU(s) but torch.cuda.is_available() is False"
    return "no CUDA GPU found (torch.cuda.is_available() is False)"


def layer_choice(kit: Toolkit | None = None) -> LayerChoice:
    """What ``ChunkPlugin`` computes on (``compute_device``) and the layer ``device_layer`` gives it."""
    kit = kit or toolkit()
    device = compute_device()
    layer = device_layer(device)
    if simulation_requested():
        reason = f"CHUNKMEM_DEVICE={SIMULATED}: the CPU runs as the simulated asynchronous device (for tests)"
    elif accelerator_available():
        local = os.environ.get("LOCAL_RANK")
        which = f"LOCAL_RANK={local}" if local is not None else "the current CUDA device"
        reason = f"a CUDA GPU is available; {which} picks {device}"
    else:
        reason = f"the CPU computes: {_why_no_gpu(kit)}"
    return LayerChoice(device=device, layer=layer, reason=reason)


@dataclass(frozen=True)
class PinnedCopy:
    """One timed copy of host memory to the compute device, from a pinned and from a pageable buffer."""

    pins: bool
    """Whether the layer pins the host buffers it copies to the device (never on the CPU)."""
    pinned: bool
    """Whether a pinned buffer could be allocated (``False`` where the layer does not pin)."""
    nbytes: int
    pinned_seconds: float | None
    pageable_seconds: float | None
    error: str | None
    """Why pinning failed, as torch said it."""


def locked_memory_limit() -> int | None:
    """This process's limit on page-locked memory in bytes (``ulimit -l``); ``None``: unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _timed_copy(layer: DeviceLayer, source: torch.Tensor, target: torch.Tensor) -> float:
    target.copy_(source, non_blocking=True)  # warm: the first copy pays for lazy setup
    layer.synchronize(layer.record_event())
    begin = layer.record_event(timing=True)
    start = time.perf_counter()
    target.copy_(source, non_blocking=True)
    end = layer.record_event(timing=True)
    layer.synchronize(end)
    if begin is None or end is None:
        return time.perf_counter() - start
    return layer.elapsed_seconds(begin, end)


def pinned_copy(layer: DeviceLayer, nbytes: int) -> PinnedCopy:
    """Allocate ``nbytes`` of pinned host memory the way chunkmem's buffers are (``host_empty``) and
    time one copy of it to the device, and one of pageable memory; on a layer that does not pin
    (the CPU computes), nothing is copied."""
    if not layer.pins:
        return PinnedCopy(pins=False, pinned=False, nbytes=0, pinned_seconds=None, pageable_seconds=None, error=None)
    host = torch.device("cpu")
    target = torch.empty(nbytes, dtype=torch.uint8, device=layer.device)
    pageable = torch.ones(nbytes, dtype=torch.uint8)
    pageable_seconds = _timed_copy(layer, pageable, target)
    try:
        pinned = layer.host_empty(nbytes, torch.uint8, host, pinned=True)
    except RuntimeError as error:
        return PinnedCopy(True, False, nbytes, None, pageable_seconds, " ".join(str(error).split())[:300])
    if not layer.is_pinned(pinned):
        return PinnedCopy(True, False, nbytes, None, pageable_seconds, "the buffer asked for pinned is not pinned")
    pinned.fill_(1)
    return PinnedCopy(True, True, nbytes, _timed_copy(layer, pinned, target), pageable_seconds, None)
