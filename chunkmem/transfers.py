"""``HostTransfers``: every copy between host memory and the compute device, counted and timed, and
the guard that keeps a pinned host buffer from being rewritten while a copy still reads it.

On CUDA a copy from pinned host memory is asynchronous (``non_blocking``): the CPU goes on while
the DMA engine reads the buffer. Before the CPU writes into that buffer again (the optimizer
stepping a host master, a fresh compute-dtype cast of it) it must wait for that copy, or the device
would receive a mix of old and new values. Each copy from a pinned buffer records an event; a write
waits for it. Bytes and seconds go to ``Stats`` (seconds from CUDA events, read once they have
completed, so timing never blocks the stream; on the CPU from the wall clock), so achieved
host-device bandwidth can be read against the pinned copy speed.
"""

from __future__ import annotations

import enum
import time

import torch

from .stats import Stats

__all__ = ["Direction", "HostTransfers"]


class Direction(enum.Enum):
    TO_DEVICE = "h2d"
    TO_HOST = "d2h"


class HostTransfers:
    """Copies between host and device for one model; see the module docstring."""

    def __init__(self, stats: Stats, device: torch.device) -> None:
        self._stats = stats
        self._cuda = device.type == "cuda"
        self._readers: dict[int, torch.cuda.Event] = {}  # pinned host storage -> event after its last read
        self._timings: list[tuple[Direction, torch.cuda.Event, torch.cuda.Event]] = []

    def copy(self, target: torch.Tensor, source: torch.Tensor, direction: Direction) -> None:
        """``target.copy_(source)``, asynchronous from pinned memory on CUDA; counted and timed."""
        nbytes = source.numel() * source.element_size()
        if direction is Direction.TO_DEVICE:
            self._stats.h2d_bytes += nbytes
        else:
            self._stats.d2h_bytes += nbytes
        if not self._cuda:
            start = time.perf_counter()
            target.copy_(source)
            self._add_seconds(direction, time.perf_counter() - start)
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        pinned = source.device.type == "cpu" and source.is_pinned()
        target.copy_(source, non_blocking=pinned)
        end.record()
        if pinned:
            self._readers[source.untyped_storage().data_ptr()] = end
        self._timings.append((direction, begin, end))
        if len(self._timings) > 256:
            self.settle()

    def before_host_write(self, host: torch.Tensor) -> None:
        """The CPU is about to write ``host``: wait for copies still reading it."""
        if not self._readers:
            return
        event = self._readers.pop(host.untyped_storage().data_ptr(), None)
        if event is not None:
            event.synchronize()

    def settle(self) -> None:
        """Add the seconds of completed CUDA copies to the statistics."""
        pending = []
        for direction, begin, end in self._timings:
            if end.query():
                self._add_seconds(direction, begin.elapsed_time(end) / 1000.0)
            else:
                pending.append((direction, begin, end))
        self._timings = pending

    def _add_seconds(self, direction: Direction, seconds: float) -> None:
        if direction is Direction.TO_DEVICE:
            self._stats.h2d_seconds += seconds
        else:
            self._stats.d2h_seconds += seconds
