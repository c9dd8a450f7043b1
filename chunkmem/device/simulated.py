"""A simulated asynchronous device: the CPU computing, checked as a GPU would run it.

On the CPU every copy is done when it returns, so a missing wait changes nothing there; on a GPU
it reads a buffer before its bytes arrive, or overwrites a pinned buffer a copy still reads. This
mode makes such a wait fail a CPU test. It checks **happens-before** the way PyTorch's CUDA
sanitizer does, over every schedule at once rather than one drawn at random:

* The host and each stream (the compute stream, the side and copy streams chunkmem makes) are
  actors with a vector clock. The host's work reaches a stream when it queues there (program
  order); a stream reaches another only through ``wait_stream`` / ``wait_event``; the host reaches
  a stream only through an event's ``synchronize``.
* A ``TorchDispatchMode`` sees every op on the threads it is entered on and records which storages
  it reads and writes, on which actor: ops on host buffers (those the layer allocated, and what
  host ops make from them) are the host's, except a copy between a host buffer and device memory,
  which is the current stream's (as ``copy_(non_blocking=True)`` is on a GPU); other ops are the
  current stream's.
* Two accesses to one storage, one of them a write, from actors not ordered by happens-before
  raise :class:`UnorderedAccessError`, naming both. A device tensor freed by the host while a
  stream other than its allocation stream may still use it, and not ``record_stream``-ed to that
  stream, raises too: the caching allocator hands freed memory to the next op of the stream that
  allocated it (the compute stream, or the side stream an op that made the tensor ran on).
* Host buffers handed back to a pool are filled with NaN (a host write), so a copy still using
  one is an error and a read of it without a refill changes the numbers.

Enter :func:`simulated_device` (tests: it checks pool threads too) or set ``CHUNKMEM_DEVICE=cpu-async`` before the first
``device_layer``: ``device_layer(cpu)`` is then a :class:`SimulatedLayer`, and chunkmem computes on the CPU even where a
GPU is present (the simulated device is that CPU).
"""

from __future__ import annotations

import concurrent.futures.thread
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .layer import DeviceLayer

__all__ = [
    "SIMULATED",
    "SimulatedLayer",
    "Simulator",
    "UnorderedAccessError",
    "simulated_device",
    "simulated_layer",
    "simulation_requested",
]

SIMULATED = "cpu-async"
"""``CHUNKMEM_DEVICE`` value that makes the CPU a simulated asynchronous device."""

HOST = "host"
COMPUTE = "compute stream"

Clock = dict[str, int]


class UnorderedAccessError(RuntimeError):
    """Two accesses to one buffer that a GPU could run in either order (a missing wait)."""


def simulation_requested() -> bool:
    """Whether ``CHUNKMEM_DEVICE`` asks for the simulated device (set by :func:`simulated_device`)."""
    return os.environ.get("CHUNKMEM_DEVICE", "") == SIMULATED


@dataclass
class SimStream:
    """A stream of the simulated device; only its name identifies it."""

    name: str


@dataclass
class SimEvent:
    """The clock of a stream when the event was recorded."""

    stream: str
    clock: Clock


@dataclass
class _Accesses:
    ref: Any  # StorageWeakRef: tells a storage that died from a new one at the same address
    write: tuple[str, int, str] | None = None  # actor, its tick, the op
    reads: dict[str, tuple[int, str]] = field(default_factory=dict)
    streams: set[str] = field(default_factory=set)  # record_stream-ed to
    allocated_on: str = COMPUTE  # the stream whose next op the allocator gives the memory to when freed


def _merge(into: Clock, other: Clock) -> None:
    for actor, tick in other.items():
        if into.get(actor, 0) < tick:
            into[actor] = tick


def _key(tensor: torch.Tensor) -> int | None:
    if tensor.is_meta or tensor.device.type != "cpu" or tensor.layout is not torch.strided:
        return None
    return tensor.untyped_storage()._cdata


@dataclass(frozen=True, slots=True)
class _OpInfo:
    """What an op's schema says, read once per op (every op of a run passes through the mode)."""

    name: str
    view: bool  # every result aliases an input, none written: no access of its own
    written_positions: frozenset[int]
    written_names: frozenset[str]


_OP_INFO: dict[Any, _OpInfo] = {}


def _op_info(func: Any) -> _OpInfo:
    info = _OP_INFO.get(func)
    if info is None:
        schema = func._schema
        writes = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        returns = schema.returns
        info = _OP_INFO[func] = _OpInfo(
            name=str(func.overloadpacket.__name__),
            view=bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns),
            written_positions=frozenset(i for i, a in enumerate(schema.arguments) if a.name in writes),
            written_names=frozenset(writes),
        )
    return info


def _tensors(value: Any, write: bool, into: list[tuple[torch.Tensor, bool]]) -> None:
    """The tensors in an op's argument or result (a tensor, or lists and tuples of them: what
    an ATen schema's types hold), with ``write``."""
    if isinstance(value, torch.Tensor):
        into.append((value, write))
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, write, into)
    elif isinstance(value, dict):
        into.extend((t, write) for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


def _non_blocking(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``copy_``'s ``non_blocking``."""
    return bool(args[2]) if len(args) > 2 else bool(kwargs.get("non_blocking", False))


class Simulator:
    """The happens-before state of one simulated device (one per process)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._clocks: dict[str, Clock] = {HOST: {HOST: 0}, COMPUTE: {COMPUTE: 0}}
        self._host_buffers: dict[int, tuple[Any, bool]] = {}  # storage -> (weak ref, pinned)
        self._accesses: dict[int, _Accesses] = {}
        self._watched: dict[int, _Accesses] = {}  # device storages made on, or used by, a side stream
        self._local = threading.local()
        self._streams = 0
        self._layers = 0
        self.errors: list[str] = []

    @property
    def layers(self) -> int:
        """How many device layers compute on this simulator (0: nothing ran on it)."""
        return self._layers

    def attach_layer(self) -> None:
        """A :class:`SimulatedLayer` computes on this simulator from now on."""
        with self._lock:
            self._layers += 1

    # --- streams and events -------------------------------------------------------------------
    def new_stream(self) -> SimStream:
        with self._lock:
            self._streams += 1
            name = f"stream {self._streams}"
            self._clocks[name] = {name: 0}
            return SimStream(name)

    def current(self) -> str:
        return getattr(self._local, "stream", COMPUTE)

    @contextmanager
    def on_stream(self, stream: SimStream | None) -> Iterator[None]:
        previous = self.current()
        self._local.stream = stream.name if stream is not None else previous
        try:
            yield
        finally:
            self._local.stream = previous

    def wait_stream(self, waiter: str, waited: str) -> None:
        with self._lock:
            _merge(self._clocks[waiter], self._clocks[waited])

    def record_event(self, stream: str) -> SimEvent:
        with self._lock:
            self._issue(stream)
            return SimEvent(stream, dict(self._clocks[stream]))

    def wait_event(self, event: SimEvent) -> None:
        with self._lock:
            _merge(self._clocks[self.current()], event.clock)

    def synchronize(self, event: SimEvent) -> None:
        with self._lock:
            _merge(self._clocks[HOST], event.clock)

    def record_stream(self, tensor: torch.Tensor, stream: str) -> None:
        key = _key(tensor)
        if key is not None:
            with self._lock:
                self._entry(key, tensor).streams.add(stream)

    # --- host buffers -------------------------------------------------------------------------
    def register_host(self, tensor: torch.Tensor, pinned: bool) -> None:
        key = _key(tensor)
        if key is not None:
            with self._lock:
                self._host_buffers[key] = (StorageWeakRef(tensor.untyped_storage()), pinned)
                self._accesses.pop(key, None)

    def _host_entry(self, key: int) -> tuple[Any, bool] | None:
        entry = self._host_buffers.get(key)
        if entry is not None and entry[0].expired():
            del self._host_buffers[key]
            return None
        return entry

    def is_host(self, tensor: torch.Tensor) -> bool:
        key = _key(tensor)
        return key is not None and self._host_entry(key) is not None

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        key = _key(tensor)
        entry = self._host_entry(key) if key is not None else None
        return entry is not None and entry[1]

    # --- accesses -----------------------------------------------------------------------------
    def _issue(self, actor: str) -> int:
        """``actor`` does one more thing; work a stream does was queued by the host after all
        the host did before."""
        clock = self._clocks[actor]
        if actor != HOST:
            _merge(clock, self._clocks[HOST])
        clock[actor] = clock.get(actor, 0) + 1
        return clock[actor]

    def _entry(self, key: int, tensor: torch.Tensor) -> _Accesses:
        entry = self._accesses.get(key)
        if entry is None or entry.ref.expired():
            entry = _Accesses(StorageWeakRef(tensor.untyped_storage()))
            self._accesses[key] = entry
        return entry

    def _fail(self, message: str) -> None:
        self.errors.append(message)
        raise UnorderedAccessError(message)

    def _check(self, actor: str, clock: Clock, other: str, tick: int, what: str, op: str, earlier: str) -> None:
        if other != actor and clock.get(other, 0) < tick:
            self._fail(
                f"simulated device: {op} on the {actor} {what} a buffer that {earlier} on the {other} may still "
                "be using: no wait orders them (a GPU could run them in either order)"
            )

    def access(self, tensor: torch.Tensor, actor: str, write: bool, op: str) -> None:
        key = _key(tensor)
        if key is None:
            return
        entry = self._entry(key, tensor)
        clock = self._clocks[actor]
        tick = clock[actor]
        if entry.write is not None:
            other, other_tick, other_op = entry.write
            self._check(actor, clock, other, other_tick, "uses", op, f"{other_op} writes")
        if write:
            for other, (other_tick, other_op) in entry.reads.items():
                self._check(actor, clock, other, other_tick, "writes", op, f"{other_op} reads")
            entry.write = (actor, tick, op)
            entry.reads = {}
        else:
            entry.reads[actor] = (tick, op)
        if actor not in (HOST, COMPUTE) and key not in self._host_buffers:
            self._watched[key] = entry

    def check_freed(self) -> None:
        """A device tensor a stream other than its allocation stream used was freed by the host:
        unless that use is ordered before the allocation stream (which the allocator gives the
        memory to) or the tensor was ``record_stream``-ed to that stream, its memory may be
        rewritten under the use."""
        if not self._watched:
            return
        for key, entry in list(self._watched.items()):
            if not entry.ref.expired():
                continue
            del self._watched[key]
            # The allocation stream's next op, which the host's waits so far precede.
            owner = dict(self._clocks[entry.allocated_on])
            _merge(owner, self._clocks[HOST])
            used = [(a, t, o) for a, (t, o) in entry.reads.items()]
            if entry.write is not None:
                used.append(entry.write)
            for actor, tick, op in used:
                if (
                    actor not in (HOST, entry.allocated_on)
                    and actor not in entry.streams
                    and owner.get(actor, 0) < tick
                ):
                    self._fail(
                        f"simulated device: a device tensor allocated on the {entry.allocated_on} that {op} on the "
                        f"{actor} uses was freed before that use is ordered, and it was not record_stream-ed to the "
                        f"{actor}: the allocator may give its memory to the {entry.allocated_on}'s next op"
                    )

    def run_op(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        info = _op_info(func)
        if info.view:
            return func(*args, **kwargs)
        touched: list[tuple[torch.Tensor, bool]] = []
        for index, value in enumerate(args):
            _tensors(value, index in info.written_positions, touched)
        for name, value in kwargs.items():
            _tensors(value, name in info.written_names, touched)
        with self._lock:
            self.check_freed()
            host = [self.is_host(t) for t, _ in touched]
            name = info.name
            # Only an asynchronous copy between a host buffer and memory that is not one is the
            # stream's; a blocking one is the host's (the host waits for it, and its other side
            # may be host memory the layer did not allocate: a load's values).
            transfer = name == "copy_" and any(host) and not all(host) and _non_blocking(args, kwargs)
            actor = HOST if any(host) and not transfer else self.current()
            self._issue(actor)
            for (tensor, write), on_host in zip(touched, host, strict=True):
                # A host op's other operands (a step count made on the compute stream, a load's
                # values) are the host's business and not tracked; a copy's device side is its
                # stream's.
                if actor != HOST or on_host:
                    self.access(tensor, actor, write, f"{name} ({'write' if write else 'read'})")
        out = func(*args, **kwargs)
        if actor != COMPUTE:
            inputs = {_key(t) for t, _ in touched}
            results: list[tuple[torch.Tensor, bool]] = []
            _tensors(out, False, results)
            made = [r for r, _ in results if _key(r) not in inputs]
            for result in made:
                if actor == HOST:
                    self.register_host(result, pinned=False)
                elif (key := _key(result)) is not None:
                    with self._lock:
                        entry = self._entry(key, result)
                        entry.allocated_on = actor
                        self._watched[key] = entry
        return out


class _Mode(TorchDispatchMode):
    def __init__(self, simulator: Simulator) -> None:
        super().__init__()
        self._simulator = simulator

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        return self._simulator.run_op(func, args, kwargs or {})


class SimulatedLayer(DeviceLayer):
    """The CPU as an asynchronous device (see the module docstring)."""

    asynchronous = True

    def __init__(self, device: torch.device, simulator: Simulator) -> None:
        super().__init__(device)
        self.simulator = simulator
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
        return self.simulator.record_event(stream.name if stream else self.simulator.current())

    def wait_event(self, event: SimEvent | None) -> None:
        if event is not None:
            self.simulator.wait_event(event)

    def synchronize(self, event: SimEvent | None) -> None:
        if event is not None:
            self.simulator.synchronize(event)

    @property
    def pins(self) -> bool:
        return True

    def host_empty(self, numel: int, dtype: torch.dtype, host: torch.device, pinned: bool = True) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype, device=host)
        self.simulator.register_host(buffer, pinned)
        return buffer

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self.simulator.is_pinned(tensor)

    def host_buffer_free(self, buffer: torch.Tensor) -> None:
        if buffer.is_floating_point() and not buffer.is_meta:
            buffer.fill_(float("nan"))  # a host write: a copy still using the buffer is an error


_ACTIVE: list[Simulator] = []


def simulated_layer(device: torch.device) -> SimulatedLayer:
    """The layer of the simulated device in effect (one made, and its checks entered on this
    thread for good, when ``CHUNKMEM_DEVICE`` asks for it outside :func:`simulated_device`)."""
    if not _ACTIVE:
        simulator = Simulator()
        _Mode(simulator).__enter__()
        _ACTIVE.append(simulator)
    return SimulatedLayer(device, _ACTIVE[-1])


@contextmanager
def simulated_device(check: bool = True) -> Iterator[Simulator]:
    """Within the block, the CPU is the simulated asynchronous device for models boosted in it,
    with its checks on this thread. On exit with ``check``, raise if an error was recorded (one a
    worker thread swallowed), or if nothing computed on the simulated device: a model boosted
    before the block, or handed a GPU, runs on its own device and the block would check nothing."""
    simulator = Simulator()
    previous = os.environ.get("CHUNKMEM_DEVICE")
    os.environ["CHUNKMEM_DEVICE"] = SIMULATED
    _ACTIVE.append(simulator)
    # Work on pool threads (early host steps, disk I/O) is checked too.
    work_item = concurrent.futures.thread._WorkItem
    run = work_item.run

    def checked_run(item: Any) -> None:
        with _Mode(simulator):
            run(item)

    work_item.run = checked_run
    try:
        with _Mode(simulator):
            yield simulator
    finally:
        work_item.run = run
        _ACTIVE.remove(simulator)
        if previous is None:
            os.environ.pop("CHUNKMEM_DEVICE", None)
        else:
            os.environ["CHUNKMEM_DEVICE"] = previous
    if check and simulator.errors:
        raise UnorderedAccessError(simulator.errors[0])
    if check and not simulator.layers:
        raise RuntimeError(
            "simulated_device(): nothing computed on the simulated device, so nothing was checked. Boost the model "
            "inside the block (a model boosted before it keeps its own device layer) on the CPU: the plugin's default "
            "device, or a Communicator on torch.device('cpu'), not on a GPU"
        )
