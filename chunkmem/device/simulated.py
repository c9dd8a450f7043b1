"""A simulated asynchronous device: the CPU computing, checked as a GPU would run it.

On the CPU every copy is done when it returns, so a missing wait changes nothing there; on a GPU
it reads a buffer before its bytes arrive, or overwrites a pinned buffer a copy still reads. This
mode makes such a wait fail a CPU test. It checks **happens-before** the way PyTorch's CUDA
sanitizer does, over every schedule at once rather than one drawn at random
(``chunkmem.device.happens_before``): the host, each stream, each process group's collective
stream (NCCL's, ``sim_collectives``) and each task of a host thread pool (``sim_threads``) are
actors with vector clocks; two accesses to one storage, one a write, that no wait orders raise
:class:`UnorderedAccessError`. Device memory comes from a model of CUDA's caching allocator and
pinned host memory from one of the pinned host allocator (``sim_allocator``): a free (``del`` or
``untyped_storage().resize_(0)``) while another stream may still use the memory raises, and what
they would hold is reported (``Simulator.device_memory``, ``pinned_memory``). Events complete only
once the host has waited for them (``query()`` is false before; an elapsed time raises
:class:`UnfinishedEventError`). Host buffers handed back to a pool are filled with NaN (a host
write), so a copy still using one is an error and a read of it without a refill changes the numbers.

Enter :func:`simulated_device` (tests: it checks pool threads too) or set ``CHUNKMEM_DEVICE=cpu-async`` before the first
``device_layer``: ``device_layer(cpu)`` is then a :class:`SimulatedLayer`, and chunkmem computes on the CPU even where a
GPU is present (the simulated device is that CPU).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..compat.torch import disable_current_modes
from .happens_before import (
    SimEvent,
    SimStream,
    SimulatedDeviceError,
    Simulator,
    UnfinishedEventError,
    UnorderedAccessError,
)
from .layer import CollectiveWaits, DeviceLayer
from .sim_collectives import work_class

__all__ = [
    "SIMULATED",
    "CheckedCpuLayer",
    "SimulatedDeviceError",
    "SimulatedLayer",
    "Simulator",
    "UnfinishedEventError",
    "UnorderedAccessError",
    "simulated_device",
    "simulated_layer",
    "simulation_requested",
]

SIMULATED = "cpu-async"
"""``CHUNKMEM_DEVICE`` value that makes the CPU a simulated asynchronous device."""


def simulation_requested() -> bool:
    """Whether ``CHUNKMEM_DEVICE`` asks for the simulated device (set by :func:`simulated_device`)."""
    return os.environ.get("CHUNKMEM_DEVICE", "") == SIMULATED


class SimulatedLayer(DeviceLayer):
    """The CPU as an asynchronous device (see the module docstring)."""

    asynchronous = True

    def __init__(
        self, device: torch.device, simulator: Simulator, collectives: CollectiveWaits = CollectiveWaits.STREAM
    ) -> None:
        super().__init__(device)
        self.simulator = simulator
        self._collectives = collectives
        simulator.attach_layer()

    def new_stream(self) -> SimStream:
        return self.simulator.new_stream()

    def current_stream(self) -> SimStream:
        return SimStream(self.simulator.current())

    def on_stream(self, stream: SimStream | None) -> Any:
        return self.simulator.on_stream(stream)

    def wait_stream(self, waiter: SimStream | None, waited: SimStream | None) -> None:
        current = self.simulator.current()
        self.simulator.wait_stream(waiter.name if waiter else current, waited.name if waited else current)

    def record_stream(self, tensor: torch.Tensor, stream: SimStream | None) -> None:
        self.simulator.record_stream(tensor, stream.name if stream else self.simulator.current())

    def record_event(self, stream: SimStream | None = None, timing: bool = False) -> SimEvent:
        return self.simulator.record_event(stream.name if stream else self.simulator.current(), timing)

    def wait_event(self, event: SimEvent | None) -> None:
        if event is not None:
            self.simulator.wait_event(event)

    def synchronize(self, event: SimEvent | None) -> None:
        if event is not None:
            self.simulator.synchronize(event)

    def query(self, event: SimEvent | None) -> bool:
        return event is None or self.simulator.query(event)

    def elapsed_seconds(self, begin: SimEvent, end: SimEvent) -> float:
        return self.simulator.elapsed_seconds(begin, end)

    def collective_waits(self, group: Any, backend: str) -> CollectiveWaits:
        """As on a GPU, whatever the backend moving the bytes: ``group``'s collectives run on a
        collective stream of their own, and waiting for one orders the current stream (or, with
        ``simulated_device(collectives=CollectiveWaits.HOST)``, as gloo: on its thread, a wait
        blocking the host)."""
        self.simulator.adopt_group(group, on_stream=self._collectives is CollectiveWaits.STREAM)
        return self._collectives

    @property
    def pins(self) -> bool:
        return True

    def host_empty(self, numel: int, dtype: torch.dtype, host: torch.device, pinned: bool = True) -> torch.Tensor:
        with disable_current_modes():  # host memory, from the pinned allocator: no device op made it
            buffer = torch.empty(numel, dtype=dtype, device=host)
        self.simulator.register_host(buffer, pinned)
        return buffer

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self.simulator.is_pinned(tensor)

    def host_buffer_free(self, buffer: torch.Tensor) -> None:
        self.simulator.host_buffer_free(buffer)

    def host_buffer_taken(self, buffer: torch.Tensor) -> None:
        self.simulator.host_buffer_taken(buffer)


class CheckedCpuLayer(DeviceLayer):
    """The synchronous CPU (every copy done when it returns, no streams), its host threads checked
    by the simulator: the paths only the CPU takes (a gathered buffer that is host memory, read into
    directly by the disk tier's threads) have waits for those threads too."""

    def __init__(self, device: torch.device, simulator: Simulator) -> None:
        super().__init__(device)
        self.simulator = simulator
        simulator.attach_layer()

    def host_buffer_free(self, buffer: torch.Tensor) -> None:
        self.simulator.host_buffer_free(buffer)

    def host_buffer_taken(self, buffer: torch.Tensor) -> None:
        self.simulator.host_buffer_taken(buffer)


_ACTIVE: list[Simulator] = []


@contextmanager
def _patched(simulator: Simulator) -> Iterator[None]:
    """What the dispatch mode cannot see, seen: pool tasks and their futures (``sim_threads``),
    ``Work.wait`` (a collective's edge), ``UntypedStorage.resize_`` (an allocation or a free) and
    the reads of values into Python (``tolist()``, ``numpy()``)."""
    simulator.threads.install()
    resize = torch.UntypedStorage.resize_

    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        before = storage.nbytes()
        simulator.before_resize(storage, size)
        out = resize(storage, size)
        simulator.resized(storage, before)
        return out

    torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
    reads = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}

    def reader(name: str, real: Any) -> Any:
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not tensor.is_meta:
                simulator.host_read(tensor, name)
            return real(tensor, *args, **kwargs)

        return read

    for name, real in reads.items():
        setattr(torch.Tensor, name, reader(name, real))
    work = work_class()
    real_wait = work.__dict__["wait"] if work is not None else None
    if work is not None:

        def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
            done = real_wait(self, *args, **kwargs)
            simulator.waited(self)
            return done

        work.wait = wait
    try:
        yield
    finally:
        if work is not None:
            work.wait = real_wait
        for name, real in reads.items():
            setattr(torch.Tensor, name, real)
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]
        simulator.threads.uninstall()


def simulated_layer(device: torch.device) -> DeviceLayer:
    """The layer of the simulated device in effect (one made, and its checks entered on this
    thread for good, when ``CHUNKMEM_DEVICE`` asks for it outside :func:`simulated_device`)."""
    if not _ACTIVE:
        simulator = Simulator()
        _patched(simulator).__enter__()
        simulator.check_for_good()
        _ACTIVE.append(simulator)
    simulator = _ACTIVE[-1]
    if simulator.synchronous:
        return CheckedCpuLayer(device, simulator)
    return SimulatedLayer(device, simulator, simulator.collective_waits)


@contextmanager
def simulated_device(
    check: bool = True, collectives: CollectiveWaits = CollectiveWaits.STREAM, asynchronous: bool = True
) -> Iterator[Simulator]:
    """Within the block, the CPU is the simulated asynchronous device for models boosted in it,
    with its checks on this thread and on pool threads; ``collectives``: what a wait for the
    chunk group's collectives does there (a GPU's by default; ``HOST``: gloo's, so a run takes
    the communicator's gloo branch). Without ``asynchronous`` the CPU stays synchronous (a
    :class:`CheckedCpuLayer`): only its host threads are checked. On exit with ``check``, raise if an error
    was recorded (one a worker thread swallowed, or a free found after the last op), or if nothing
    computed on the simulated device: a model boosted before the block, or handed a GPU, runs on
    its own device and the block would check nothing."""
    simulator = Simulator()
    simulator.collective_waits = collectives
    simulator.synchronous = not asynchronous
    previous = os.environ.get("CHUNKMEM_DEVICE")
    os.environ["CHUNKMEM_DEVICE"] = SIMULATED
    _ACTIVE.append(simulator)
    try:
        with _patched(simulator), simulator.checking():
            yield simulator
    except Exception as error:
        # What the checker found first is the cause (the library may have wrapped it, as a disk
        # task's failure, or failed on what it led to): the tasks still running are let finish
        # first, so that a task's access after the host's failure is checked too.
        if check:
            simulator.threads.drain()
        if check and simulator.failures and error is not simulator.failures[0]:
            first = simulator.failures[0]
            raise type(first)(str(first)) from error
        raise
    finally:
        _ACTIVE.remove(simulator)
        if previous is None:
            os.environ.pop("CHUNKMEM_DEVICE", None)
        else:
            os.environ["CHUNKMEM_DEVICE"] = previous
    if check:
        simulator.threads.drain()  # tasks nobody waited for still run: what they touch is checked
        with contextlib.suppress(SimulatedDeviceError):  # recorded in failures
            simulator.device_memory()  # the frees still to check
    if check and simulator.failures:
        first = simulator.failures[0]
        raise type(first)(str(first))
    if check and not simulator.layers:
        raise RuntimeError(
            "simulated_device(): nothing computed on the simulated device, so nothing was checked. Boost the model "
            "inside the block (a model boosted before it keeps its own device layer) on the CPU: the plugin's default "
            "device, or a Communicator on torch.device('cpu'), not on a GPU"
        )
