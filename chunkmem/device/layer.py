"""The device layer: the one place that knows the accelerator. Streams, events, pinned host memory
and the waits between them go through a :class:`DeviceLayer`; the rest of chunkmem asks it, never
``torch.cuda``.

* :class:`DeviceLayer` is the synchronous device (the CPU computing): every copy is done when it
  returns, so there is one stream, no events, nothing to pin and every wait is a no-op.
* :class:`AcceleratorLayer` is a GPU-like device with streams and events that run apart from the
  host. CUDA keeps the calls it always made (``torch.cuda.Stream``, ``torch.cuda.Event``,
  ``torch.cuda.stream``); other accelerators (XPU, NPU through PrivateUse1, ...) use PyTorch's
  device-generic ``torch.Stream`` / ``torch.Event`` / ``torch.accelerator`` where this PyTorch has
  them, and run synchronously where it does not.
* ``chunkmem.device.simulated`` is a CPU that behaves as such a device, for tests.

``chunkmem.device.choice.device_layer(device)`` picks the one for a compute device.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "AcceleratorLayer",
    "CollectiveWaits",
    "DeviceLayer",
    "generic_streams",
    "is_accelerator",
    "pinned_block_bytes",
]

_CUDA = "cuda"
_HOST_TYPES = ("cpu", "meta")

# What a stream or an event is, seen from outside the layer: opaque handles, ``None`` on a device
# without them.
Stream = Any
Event = Any


class CollectiveWaits(enum.Enum):
    """What waiting for an asynchronous collective (``work.wait()``) does."""

    HOST = "host"
    """The calling thread blocks until the collective is done (gloo, on host memory)."""
    STREAM = "stream"
    """The current stream waits for the collective's own stream; the host goes on (NCCL)."""


def pinned_block_bytes(nbytes: int) -> int:
    """The block of pinned host memory a request of ``nbytes`` takes: PyTorch's caching host
    allocator (CUDA's, and the other accelerators' built on it) rounds every request up to the next
    power of two and holds that block while the tensor lives (cached for reuse after)."""
    return 0 if nbytes <= 0 else 1 << (nbytes - 1).bit_length()


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` computes apart from the host (a GPU, an XPU, ...), not the CPU itself."""
    return device.type not in _HOST_TYPES


class DeviceLayer:
    """The synchronous device (the CPU): copies finish before they return, so waits are no-ops."""

    asynchronous = False
    """Whether copies from and into pinned host memory may return before the bytes have moved."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device})"

    # --- streams ------------------------------------------------------------------------------
    def new_stream(self) -> Stream | None:
        """A stream of its own (``None``: the device has a single one)."""
        return None

    def current_stream(self) -> Stream | None:
        """The stream work queued now goes to."""
        return None

    @contextmanager
    def on_stream(self, stream: Stream | None) -> Iterator[None]:
        """Queue the block's work on ``stream`` (``None``: the current one)."""
        yield

    def wait_stream(self, waiter: Stream | None, waited: Stream | None) -> None:
        """Work queued on ``waiter`` from now on runs after what is queued on ``waited`` so far."""

    def record_stream(self, tensor: torch.Tensor, stream: Stream | None) -> None:
        """``tensor``'s memory is used by ``stream``: the allocator keeps it until that work is done."""

    def copy(self, target: torch.Tensor, source: torch.Tensor, asynchronous: bool) -> None:
        """``target.copy_(source)`` on the current stream; with ``asynchronous`` (pinned host memory
        on one side) it may return before the bytes moved: the caller waits for it (``HostTransfers``)."""
        target.copy_(source, non_blocking=asynchronous)

    # --- events -------------------------------------------------------------------------------
    def record_event(self, stream: Stream | None = None, timing: bool = False) -> Event | None:
        """An event after the work queued so far on ``stream`` (default: the current one)."""
        return None

    def wait_event(self, event: Event | None) -> None:
        """The current stream's later work runs after ``event``."""

    def synchronize(self, event: Event | None) -> None:
        """The host waits for ``event``."""

    def query(self, event: Event | None) -> bool:
        """Whether ``event`` has completed (never base a cross-rank decision on it)."""
        return True

    def elapsed_seconds(self, begin: Event, end: Event) -> float:
        """Seconds between two completed timing events."""
        return 0.0

    # --- host memory --------------------------------------------------------------------------
    @property
    def computes_on_host(self) -> bool:
        """The compute device is host memory, synchronously (the CPU, or the meta device of a plan
        for it): a gathered buffer is host memory that the disk tier can read into directly."""
        return not self.asynchronous and self.device.type in ("cpu", "meta")

    @property
    def pins(self) -> bool:
        """Whether host buffers that cross to the device are pinned (page-locked)."""
        return False

    def host_empty(self, numel: int, dtype: torch.dtype, host: torch.device, pinned: bool = True) -> torch.Tensor:
        """An uninitialised host buffer, pinned when ``pinned`` and the device pins."""
        return torch.empty(numel, dtype=dtype, device=host, pin_memory=pinned and self.pins)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is host memory a copy can read or write asynchronously."""
        return False

    def host_held_bytes(self, nbytes: int, pinned: bool = True) -> int:
        """The host memory a buffer of ``nbytes`` from ``host_empty`` holds (``pinned`` as passed
        there), what the ledger charges for it: where the device pins, the pinned allocator's
        whole block (``pinned_block_bytes``, up to twice the bytes); else exactly ``nbytes``."""
        return pinned_block_bytes(nbytes) if pinned and self.pins else nbytes

    def host_buffer_free(self, buffer: torch.Tensor) -> None:
        """A host buffer goes back to a pool: nobody may read what it holds any more."""

    def host_buffer_taken(self, buffer: torch.Tensor) -> None:
        """A host buffer comes out of a pool to a new user, after whoever gave it back (the pool's
        lock orders the two; any thread may give one back)."""

    # --- collectives ----------------------------------------------------------------------------
    def collective_waits(self, group: Any, backend: str) -> CollectiveWaits:
        """What a wait for a collective of process group ``group`` on ``backend`` does: gloo blocks
        the host, NCCL (and the other device backends) orders the current stream."""
        return CollectiveWaits.HOST if backend == "gloo" else CollectiveWaits.STREAM

    # --- identity -----------------------------------------------------------------------------
    def same_device(self, other: torch.device) -> bool:
        """Whether ``other`` names this device (an accelerator without index: the current one)."""
        return other.type == self.device.type


class AcceleratorLayer(DeviceLayer):
    """A device with streams and events of its own (see the module docstring)."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._cuda = device.type == _CUDA

    def new_stream(self) -> Stream:
        if self._cuda:
            return torch.cuda.Stream(self.device)
        return torch.Stream(device=self.device)

    def current_stream(self) -> Stream:
        if self._cuda:
            return torch.cuda.current_stream(self.device)
        return torch.accelerator.current_stream(self.device)

    @contextmanager
    def on_stream(self, stream: Stream | None) -> Iterator[None]:
        if stream is None:
            yield
        elif self._cuda:
            with torch.cuda.stream(stream):
                yield
        else:
            previous = torch.accelerator.current_stream(self.device)
            torch.accelerator.set_stream(stream)
            try:
                yield
            finally:
                torch.accelerator.set_stream(previous)

    def wait_stream(self, waiter: Stream | None, waited: Stream | None) -> None:
        (waiter or self.current_stream()).wait_stream(waited or self.current_stream())

    def record_stream(self, tensor: torch.Tensor, stream: Stream | None) -> None:
        tensor.record_stream(stream or self.current_stream())

    def record_event(self, stream: Stream | None = None, timing: bool = False) -> Event:
        event = torch.cuda.Event(enable_timing=timing) if self._cuda else torch.Event(self.device, enable_timing=timing)
        if stream is None:
            event.record()
        else:
            event.record(stream)
        return event

    def wait_event(self, event: Event | None) -> None:
        if event is not None:
            if self._cuda:
                torch.cuda.current_stream().wait_event(event)
            else:
                self.current_stream().wait_event(event)

    def synchronize(self, event: Event | None) -> None:
        if event is not None:
            event.synchronize()

    def query(self, event: Event | None) -> bool:
        return event is None or bool(event.query())

    def elapsed_seconds(self, begin: Event, end: Event) -> float:
        return begin.elapsed_time(end) / 1000.0

    @property
    def pins(self) -> bool:
        return True

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def same_device(self, other: torch.device) -> bool:
        if other.type != self.device.type:
            return False
        current = _current_index(self.device)
        mine = self.device.index if self.device.index is not None else current
        return (other.index if other.index is not None else current) == mine


def _current_index(device: torch.device) -> int:
    if device.type == _CUDA:
        return torch.cuda.current_device()
    return torch.accelerator.current_device_index()


def generic_streams() -> bool:
    """Whether this PyTorch has the device-generic stream API a non-CUDA accelerator needs."""
    return hasattr(torch, "accelerator") and hasattr(torch.accelerator, "set_stream") and hasattr(torch, "Event")
