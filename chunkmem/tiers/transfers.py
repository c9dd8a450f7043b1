"""``HostTransfers``: every copy between host memory and the compute device, counted and timed, and
the guards that keep a pinned host buffer from being read or rewritten while a copy still uses it.

On CUDA a copy between the device and pinned host memory is asynchronous (``non_blocking``): the
CPU goes on while the DMA engine moves the bytes, so it never waits for the device to reach the
copy. Two directions, two rules:

* **Host to device** (a gather reading a host shard, a refresh): queued on the current stream
  (the side stream for a prefetch); the copy reads the pinned buffer later, so before the CPU
  writes that buffer again (an optimizer step on the host master, a fresh cast) it waits for the
  copy (``before_host_write``).
* **Device to host** (a reduced gradient going to the host optimizer): queued on the dedicated
  **copy stream**, after the work queued so far on the current stream and after a collective
  still producing the source (``after``), so it overlaps the compute that follows. The device
  source is recorded on the copy stream, so the allocator does not reuse its memory before the copy
  has read it. The CPU waits only when it reads the target (``before_host_read``). A copy into a
  host buffer needs no wait for the copies that read it before: those ran on a stream the copy
  stream waits for (the current one, or a side stream the current one waited for before using
  what it fetched); the simulated device checks that order in every scenario.

A host buffer that is not pinned makes a copy synchronous (the CPU waits for the device to reach
it): ``Stats.pageable_copies`` counts those on CUDA. Pinned staging buffers for copies that need a
temporary host buffer are allocated once per size and reused (``staging``); pinning is slow, so
nothing is pinned in the hot path after the first step. Bytes and seconds go to ``Stats`` (seconds
from CUDA events, read once they have completed, so timing never blocks a stream; on the CPU from
the wall clock), so achieved host-device bandwidth can be read against the pinned copy speed.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable

import torch

from ..device import DeviceLayer, device_layer
from ..device.layer import Event, Stream
from ..usage.stats import Stats

__all__ = ["Direction", "HostTransfers"]


class Direction(enum.Enum):
    TO_DEVICE = "h2d"
    TO_HOST = "d2h"


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class HostTransfers:
    """Copies between host and device for one model; see the module docstring."""

    def __init__(self, stats: Stats, device: torch.device | DeviceLayer, copy_stream: Stream | None = None) -> None:
        self._stats = stats
        self._layer = device if isinstance(device, DeviceLayer) else device_layer(device)
        if self._layer.asynchronous and copy_stream is None:
            copy_stream = self._layer.new_stream()
        self._copy_stream = copy_stream
        self._readers: dict[int, Event] = {}  # pinned host storage -> event after its last read
        self._writers: dict[int, Event] = {}  # pinned host storage -> event after a copy into it
        self._timings: list[tuple[Direction, Event, Event]] = []
        self._staging: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        self._staging_lock = threading.Lock()

    @property
    def layer(self) -> DeviceLayer:
        """The device layer the copies go through."""
        return self._layer

    @property
    def asynchronous(self) -> bool:
        """Whether copies from and into pinned host memory return before the bytes have moved."""
        return self._layer.asynchronous

    def _count(self, nbytes: int, direction: Direction) -> None:
        if direction is Direction.TO_DEVICE:
            self._stats.h2d_bytes += nbytes
        else:
            self._stats.d2h_bytes += nbytes

    def copy(
        self,
        target: torch.Tensor,
        source: torch.Tensor,
        direction: Direction,
        after: Callable[[], None] | None = None,
        divide_by: int | None = None,
    ) -> None:
        """``target.copy_(source)``, asynchronous between the device and pinned memory on an asynchronous device;
        counted and timed. Device to host: ``after`` (a wait for a collective producing ``source``)
        and ``source.div_(divide_by)`` run first, on the copy stream (elsewhere, on the caller's)."""
        nbytes = source.numel() * source.element_size()
        self._count(nbytes, direction)
        layer = self._layer
        if not layer.asynchronous:
            if after is not None:
                after()
            if divide_by is not None:
                source.div_(divide_by)
            start = time.perf_counter()
            target.copy_(source)
            self._add_seconds(direction, time.perf_counter() - start)
            return
        host = source if direction is Direction.TO_DEVICE else target
        pinned = layer.is_pinned(host)
        if not pinned:
            self._stats.pageable_copies += 1
        if direction is Direction.TO_DEVICE:
            done = self._timed(direction, lambda: layer.copy(target, source, asynchronous=pinned))
            if pinned:
                self._readers[_storage(source)] = done
            return
        stream = self._copy_stream
        assert stream is not None, "an asynchronous device has a copy stream"
        layer.wait_stream(stream, layer.current_stream())
        with layer.on_stream(stream):
            if after is not None:
                after()
            if divide_by is not None:
                source.div_(divide_by)
            layer.record_stream(source, stream)
            done = self._timed(direction, lambda: layer.copy(target, source, asynchronous=pinned))
        if pinned:
            self._writers[_storage(target)] = done

    def _timed(self, direction: Direction, run: Callable[[], object]) -> Event:
        """Run a copy between two events on the current stream; returns the one after it."""
        begin = self._layer.record_event(timing=True)
        run()
        end = self._layer.record_event(timing=True)
        self._timings.append((direction, begin, end))
        if len(self._timings) > 256:
            self.settle()
        return end

    def before_host_read(self, host: torch.Tensor) -> None:
        """The CPU is about to read ``host``: wait for a copy still writing it."""
        if self._writers:
            event = self._writers.pop(_storage(host), None)
            if event is not None:
                self._layer.synchronize(event)

    def before_host_write(self, host: torch.Tensor) -> None:
        """The CPU is about to write ``host``: wait for copies still reading or writing it."""
        if self._readers:
            event = self._readers.pop(_storage(host), None)
            if event is not None:
                self._layer.synchronize(event)
        self.before_host_read(host)

    def staging(self, numel: int, dtype: torch.dtype, host: torch.device) -> torch.Tensor:
        """A buffer on ``host`` for a temporary copy (pinned where the device pins), reused once ``give_back``
        returns it; the pool keeps what it pinned."""
        with self._staging_lock:
            free = self._staging.setdefault((numel, dtype, host), [])
            if free:
                buffer = free.pop()
                self._layer.host_buffer_taken(buffer)
                return buffer
        return self._layer.host_empty(numel, dtype, host)

    def give_back(self, buffer: torch.Tensor) -> None:
        """A staging buffer is free again (the caller has read it: ``before_host_read``); any
        thread may give one back (the disk tier's I/O threads do)."""
        self._layer.host_buffer_free(buffer)
        with self._staging_lock:
            self._staging.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)

    def settle(self, wait: bool = False) -> None:
        """Add the seconds of completed asynchronous copies to the statistics (with ``wait``, of
        every copy: the host waits for those still running)."""
        pending = []
        for direction, begin, end in self._timings:
            if wait:
                self._layer.synchronize(end)
            if wait or self._layer.query(end):
                self._add_seconds(direction, self._layer.elapsed_seconds(begin, end))
            else:
                pending.append((direction, begin, end))
        self._timings = pending

    def _add_seconds(self, direction: Direction, seconds: float) -> None:
        if direction is Direction.TO_DEVICE:
            self._stats.h2d_seconds += seconds
        else:
            self._stats.d2h_seconds += seconds
